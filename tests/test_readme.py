"""The Python examples of README.md and docs/*.md run as written, so that what a reader copies
cannot drift from the API.

Each ```python block is executed in a fresh namespace, in a temporary directory (the blocks
write files), exactly as a reader would paste it. Where a block reads ``path/to/llama``, the
test writes a checkpoint there first; the CUDA block runs only where CuPy sees a GPU. Besides
raising nothing, each block's results are checked for shape and meaning. Snippets that cannot
run alone are ```text blocks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_CUDA, NO_CUDA_REASON

from mila_py.interop.hf_rope import rope_config_from_hf

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

#: per page, one marker per python block: each marker appears in exactly one block of its page
MARKERS: dict[str, list[str]] = {
    "README.md": [
        "rope.set_training_mode",
        "required_memory",
        "rope_config_from_hf(",
        "eos_token_ids(",
        "model.complete(",
        "opt.step",
    ],
    "docs/cuda.md": ["import cupy"],
    "docs/distributed.md": [],
    "docs/llama.md": ["server.generate", "save_hf_checkpoint("],
    "docs/performance.md": [],
    "docs/rope.md": ["register_rope_type(", "rope_configs_from_hf_layers", "mrope_section="],
    "docs/sampling.md": [],
    "docs/text.md": [],
    "docs/training.md": ["load_checkpoint("],
}


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def _block(page: str, marker: str) -> str:
    """The one python block of ``page`` that contains ``marker``."""
    found = [block for block in _blocks(page) if marker in block]
    assert len(found) == 1, f"{page}: {len(found)} python blocks contain {marker!r}"
    return found[0]


def _run(page: str, marker: str, where: Path, monkeypatch: Any) -> dict[str, Any]:
    monkeypatch.chdir(where)
    namespace: dict[str, Any] = {}
    exec(compile(_block(page, marker), str(ROOT / page), "exec"), namespace)
    return namespace


def test_every_page_is_listed() -> None:
    assert sorted(MARKERS) == sorted(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_covered(page: str) -> None:
    markers = MARKERS.get(page, [])
    assert len(_blocks(page)) == len(markers), f"{page}: a python block without a test"
    for marker in markers:
        _block(page, marker)


def _hf_checkpoint(where: Path) -> Any:
    """A small random Llama (TRAINING build) saved as a Hugging Face folder at ``where``."""
    from mila_py import BuildContext, RuntimeMode
    from mila_py.interop.hf import save_hf_checkpoint
    from mila_py.models import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=512
    )
    source = Llama("llama", cfg, device="CPU")
    source.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    save_hf_checkpoint(source, where)
    return source


def _same_parameters(a: Any, b: Any) -> None:
    for (name, want), (_, got) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert np.array_equal(want, got), name


# ------------------------------------------------------------------------------------ README.md
def test_components_and_build_context(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py.components import Rope

    ns = _run("README.md", "rope.set_training_mode", tmp_path, monkeypatch)
    rope, net = ns["rope"], ns["net"]
    assert isinstance(rope, Rope) and rope.is_built and not rope.is_training_mode
    assert ns["dq_in"].shape == ns["q"].shape and ns["dk_in"].shape == ns["k"].shape
    printed = capsys.readouterr().out
    assert "l0" in printed and "l1" in printed
    # the two layers share one table: the network's state is one layer's
    layer = net.get_component("l0").get_memory_stats()
    assert net.get_memory_stats().total_bytes == layer.total_bytes > 0


def test_runtime_mode_and_memory(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py import TrainingMode

    ns = _run("README.md", "required_memory", tmp_path, monkeypatch)
    trainer, server = ns["trainer"], ns["server"]
    assert capsys.readouterr().out.splitlines()[:2] == ["True", "TrainingMode.EVAL"]
    assert ns["predicted"] == trainer.get_memory_stats()
    assert trainer.training_mode is TrainingMode.NORMAL  # eval() then train()
    with pytest.raises(RuntimeError, match="INFERENCE"):
        server.set_training_mode(TrainingMode.NORMAL)
    trained, served = trainer.get_memory_stats(), server.get_memory_stats()
    assert trained.device_parameter_bytes == served.device_parameter_bytes > 0
    assert trained.device_gradient_bytes > 0 and served.device_gradient_bytes == 0
    assert served.device_state_bytes < trained.device_state_bytes


def test_rope_tour(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from rope_helpers import arange_positions, reference

    np.random.seed(7)  # the block draws from NumPy's global generator: draw the same again
    ns = _run("README.md", "rope_config_from_hf(", tmp_path, monkeypatch)
    np.random.seed(7)
    cfg = ns["cfg"]
    q0 = np.random.randn(1, 1000, cfg.channels).astype(np.float32)
    k0 = np.random.randn(1, 1000, cfg.kv_channels).astype(np.float32)
    q1 = np.random.randn(1, 1, cfg.channels).astype(np.float32)
    k1 = np.random.randn(1, 1, cfg.kv_channels).astype(np.float32)
    assert cfg.scaling["rope_type"] == "llama3" and cfg.head_dim == 128 and cfg.n_kv_heads == 2
    assert capsys.readouterr().out.split() == ["True", "True"]
    # the chunks rotated the prompt at positions 0..999, the decode its token at 1000
    want_q, want_k = reference(cfg, q0, k0, arange_positions(1, 1000))
    np.testing.assert_allclose(ns["q"], want_q, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ns["k"], want_k, rtol=2e-5, atol=2e-5)
    want_q1, want_k1 = reference(cfg, q1, k1, np.array([[1000]]))
    np.testing.assert_allclose(ns["q_next"], want_q1, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(ns["k_next"], want_k1, rtol=2e-5, atol=2e-5)


def test_hugging_face_block(tmp_path: Path, monkeypatch: Any) -> None:
    from mila_py import RuntimeMode
    from mila_py.models import Llama

    folder = tmp_path / "path" / "to" / "llama"
    source = _hf_checkpoint(folder)
    # the EOS id: a token greedy decoding emits at some step for the first time
    greedy = Llama.from_pretrained(folder, runtime_mode=RuntimeMode.INFERENCE)
    prompt = [1, 15, 7, 42, 3]
    new = [int(t) for t in greedy.generate(prompt, max_new_tokens=32)[len(prompt) :]]
    stop = next((i for i in range(1, len(new)) if new[i] not in new[:i]), 0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [new[stop]]}))

    ns = _run("README.md", "eos_token_ids(", tmp_path, monkeypatch)
    model, out = ns["model"], ns["out"]
    assert np.array_equal(out[: len(prompt)], ns["prompt_ids"])
    assert ns["new_ids"].tolist() == new[: stop + 1]  # greedy up to and including the EOS
    assert model.build_context.is_inference and model.chunk_size == 256
    _same_parameters(source, model)


def test_text_block(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from text_helpers import make_model_folder

    folder = make_model_folder(tmp_path / "path" / "to" / "chat-model")
    ns = _run("README.md", "model.complete(", tmp_path, monkeypatch)
    model, stream = ns["model"], ns["stream"]
    assert model.tokenizer is not None and model.build_context.input_shape[0] == 2
    assert ns["text"] == model.complete("Once upon a time", max_new_tokens=16)
    texts = ns["texts"]
    assert len(texts) == 3 and all("\n" not in t for t in texts)
    assert texts == [model.complete(p, stop=["\n"]) for p in ("def main(", "Hello", "2 + 2 =")]
    assert ns["reply"] == model.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=16)
    assert "".join(ns["pieces"]) == ns["text"]
    assert capsys.readouterr().out.split() == [stream.finish_reason, str(stream.completion_tokens)]
    assert folder.is_dir() and not model.run_lock.locked


def test_training_block(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py import BuildContext, RuntimeMode
    from mila_py.models import Llama

    ns = _run("README.md", "opt.step", tmp_path, monkeypatch)
    model, loss = ns["model"], float(ns["loss"])
    # the repeated sentence is learned: the loss falls well below a uniform guess's ln(256)
    assert math.isfinite(loss) and loss < math.log(256) - 1
    assert capsys.readouterr().out.strip() == f"loss {loss:.2f}"
    assert ns["opt"].step_count == 30
    served = Llama("llama", ns["cfg"], device="CPU")
    served.build(BuildContext((1, ns["T"]), RuntimeMode.INFERENCE))
    served.load(tmp_path / "llama.safetensors")
    _same_parameters(model, served)


# ------------------------------------------------------------------------------------- docs/*.md
def test_register_rope_type_block(tmp_path: Path, monkeypatch: Any) -> None:
    from mila_py.components import RopeConfig, get_rope
    from mila_py.rope import scaling as rope_scaling

    # the block registers "my_linear" for the whole process: register it in a copy
    monkeypatch.setattr(rope_scaling, "_TYPES", dict(rope_scaling._TYPES))
    ns = _run("docs/rope.md", "register_rope_type(", tmp_path, monkeypatch)
    assert "my_linear" in rope_scaling.registered_rope_types()
    linear = RopeConfig(
        channels=1024, n_heads=8, n_kv_heads=2, max_seq_len=4096,
        scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    want, want_scaling = get_rope(linear).frequencies()
    np.testing.assert_allclose(ns["inv_freq"], want, rtol=1e-14)
    assert ns["attention_scaling"] == want_scaling == 1.0
    with pytest.raises(ValueError, match="factor"):  # required=("factor",) is enforced
        RopeConfig(
            channels=1024, n_heads=8, n_kv_heads=2, max_seq_len=4096,
            scaling={"rope_type": "my_linear"},
        )  # fmt: skip


def test_per_layer_block(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:

    ns = _run("docs/rope.md", "rope_configs_from_hf_layers", tmp_path, monkeypatch)
    layers, full = ns["layers"], ns["full"]
    assert len(layers) == 34 and len({id(t) for t in ns["tables"]}) == 2
    assert [i for i, c in enumerate(layers) if c == full] == [5, 11, 17, 23, 29]
    sliding = rope_config_from_hf(ns["gemma3"], layer_type="sliding_attention", max_seq_len=8192)
    assert all(c == sliding for i, c in enumerate(layers) if i % 6 != 5)
    # the comment in the block says what it prints
    assert capsys.readouterr().out.split() == ["1000000.0", "8.0", "10000.0", "2"]


def test_mrope_block(tmp_path: Path, monkeypatch: Any) -> None:
    from rope_helpers import reference

    ns = _run("docs/rope.md", "mrope_section=", tmp_path, monkeypatch)
    rope, positions = ns["rope"], ns["positions"]
    assert positions.shape == (3, 1, 54)
    # text tokens sit at one position on every axis; the image's rows and columns differ
    assert (positions[:, 0, :4] == np.arange(4)).all() and (positions[:, 0, 52:] == [12, 13]).all()
    assert len({tuple(positions[:, 0, i]) for i in range(4, 52)}) == 48
    # the block's rope rotates every frequency at its axis' position (the float64 reference)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 54, rope.config.channels)).astype(np.float32)
    k = rng.standard_normal((1, 54, rope.config.kv_channels)).astype(np.float32)
    want_q, want_k = reference(rope.config, q, k, positions)
    rope.rotate(q, k, positions)
    np.testing.assert_allclose(q, want_q, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(k, want_k, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
def test_cuda_block(tmp_path: Path, monkeypatch: Any) -> None:
    import cupy

    ns = _run("docs/cuda.md", "import cupy", tmp_path, monkeypatch)
    ns["rope"].synchronize()
    assert isinstance(ns["q"], cupy.ndarray) and bool(cupy.isfinite(ns["q"]).all())


def test_training_and_serving(tmp_path: Path, monkeypatch: Any) -> None:
    from mila_py import TrainingMode

    ns = _run("docs/llama.md", "server.generate", tmp_path, monkeypatch)
    assert (tmp_path / "llama.safetensors").is_file()
    assert np.isfinite(ns["loss"]) and ns["loss"] > 0
    assert ns["model"].training_mode is TrainingMode.EVAL
    assert ns["last"].shape == (1, 256) and ns["step"].shape == (1, 256)
    prompt = ns["prompt"]
    out = ns["ids"]
    assert out.shape == (prompt.size + 32,) and np.array_equal(out[: prompt.size], prompt)
    # the decode step continues the prefill: its logits are those of a full forward
    full = np.concatenate([prompt, ns["next_token"]])
    server = ns["server"]
    server.reset()
    np.testing.assert_allclose(ns["step"], server.prefill(full[None]), rtol=1e-4, atol=1e-5)
    # the served weights are the trained ones
    _same_parameters(ns["model"], server)


def test_save_hf_checkpoint_block(tmp_path: Path, monkeypatch: Any) -> None:
    from mila_py import RuntimeMode
    from mila_py.models import Llama

    source = _hf_checkpoint(tmp_path / "path" / "to" / "llama")
    ns = _run("docs/llama.md", "save_hf_checkpoint(", tmp_path, monkeypatch)
    trainer = ns["trainer"]
    assert trainer.build_context.is_training and trainer.build_context.input_shape == (4, 512)
    _same_parameters(source, trainer)
    # the folder written is a checkpoint that loads again, with the trainer's weights
    again = Llama.from_pretrained(
        tmp_path / "path" / "to" / "finetuned", runtime_mode=RuntimeMode.INFERENCE
    )
    _same_parameters(trainer, again)


def test_quick_start_runs_the_hugging_face_comparisons_with_the_pinned_releases() -> None:
    """The quick start's test command is the one CI runs, it installs the ``hf`` extra (so a
    newcomer's run compares with Hugging Face as CI's does), and the README names the releases
    that extra pins."""
    import tomllib

    root = ROOT
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci = re.search(r"^test_cmd='(.*)'$", (root / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    assert ci is not None, ".ci/run: no test_cmd='...' line"
    assert ci.group(1) in lines
    extras = re.search(r'install -e "\.\[([\w,]+)\]"', ci.group(1))
    assert extras is not None and "hf" in extras.group(1).split(",")
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = dict(r.split("==") for r in project["optional-dependencies"]["hf"] if "==" in r)
    assert set(pins) == {"torch", "transformers"}
    text = " ".join(lines)
    for package, release in pins.items():
        assert f"{package} {release}" in text, f"README.md does not name {package} {release}"


def test_resumable_training_block(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py.train import read_log

    ns = _run("docs/training.md", "load_checkpoint(", tmp_path, monkeypatch)
    records = ns["records"]
    assert [r["step"] for r in records] == list(range(21, 41))
    assert ns["opt"].step_count + ns["opt"].skipped_steps == 40
    assert ns["schedule"].step_count == 40 and ns["opt"].lr == pytest.approx(3e-4)
    log = read_log(tmp_path / "run.jsonl")
    assert [r["step"] for r in log] == list(range(1, 41))
    # the repeated sentence is learned: the loss falls well below a uniform guess's ln(256)
    assert log[-1]["loss"] < math.log(256) - 1 < log[0]["loss"]
    assert capsys.readouterr().out.strip() == f"40 {round(records[-1]['loss'], 2)}"
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["optimizer"]["step_count"] + state["optimizer"]["skipped_steps"] == 40
