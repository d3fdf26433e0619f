"""The README's Python examples run as written, so that the tour a newcomer copies cannot drift
from the API.

Each ```python block of README.md is executed in a fresh namespace, in a temporary directory (the
blocks write files), exactly as a reader would paste it: the Hugging Face block's checkpoint is
written by the test where the block says ``path/to/llama``; the CUDA block runs only where CuPy
sees a GPU. Besides raising
nothing, each block's results are checked for shape and meaning.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_CUDA, NO_CUDA_REASON

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def _block(marker: str) -> str:
    """The one README block that contains ``marker``."""
    found = [block for block in BLOCKS if marker in block]
    assert len(found) == 1, f"README.md: {len(found)} python blocks contain {marker!r}"
    return found[0]


def _run(source: str, namespace: dict[str, Any], where: Path, monkeypatch: Any) -> dict[str, Any]:
    monkeypatch.chdir(where)
    exec(compile(source, str(README), "exec"), namespace)
    return namespace


def test_every_block_is_covered() -> None:
    markers = [
        "rope.set_training_mode",
        "mrope_section=",
        "from_hf_layers",
        "import cupy",
        "server.generate",
        "from_pretrained",
    ]
    assert len(BLOCKS) == len(markers)
    for marker in markers:
        _block(marker)


def test_api_tour(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py.components import Rope

    ns = _run(_block("rope.set_training_mode"), {}, tmp_path, monkeypatch)
    rope, net = ns["rope"], ns["net"]
    assert isinstance(rope, Rope) and rope.is_built and not rope.is_training_mode
    assert ns["dq_in"].shape == ns["q"].shape and ns["dk_in"].shape == ns["k"].shape
    printed = capsys.readouterr().out
    assert "l0" in printed and "l1" in printed
    # the two layers share one table: the network's state is one layer's
    layer = net.get_component("l0").get_memory_stats()
    assert net.get_memory_stats().total_bytes == layer.total_bytes > 0


def test_mrope_block(tmp_path: Path, monkeypatch: Any) -> None:
    from rope_helpers import reference

    ns = _run(_block("mrope_section="), {}, tmp_path, monkeypatch)
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


def test_per_layer_block(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    from mila_py.components import RopeConfig

    ns = _run(_block("from_hf_layers"), {}, tmp_path, monkeypatch)
    layers, full = ns["layers"], ns["full"]
    assert len(layers) == 34 and len({id(t) for t in ns["tables"]}) == 2
    assert [i for i, c in enumerate(layers) if c == full] == [5, 11, 17, 23, 29]
    sliding = RopeConfig.from_hf(ns["gemma3"], layer_type="sliding_attention", max_seq_len=8192)
    assert all(c == sliding for i, c in enumerate(layers) if i % 6 != 5)
    # the comment in the block says what it prints
    assert capsys.readouterr().out.split() == ["1000000.0", "8.0", "10000.0", "2"]


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)
def test_cuda_block(tmp_path: Path, monkeypatch: Any) -> None:
    import cupy

    ns = _run(_block("import cupy"), {}, tmp_path, monkeypatch)
    ns["rope"].synchronize()
    assert isinstance(ns["q"], cupy.ndarray) and bool(cupy.isfinite(ns["q"]).all())


def test_training_and_serving(tmp_path: Path, monkeypatch: Any) -> None:
    ns = _run(_block("server.generate"), {}, tmp_path, monkeypatch)
    assert (tmp_path / "llama.safetensors").is_file()
    assert np.isfinite(ns["loss"]) and ns["loss"] > 0
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
    for (name, trained), (_, served) in zip(
        ns["model"].named_parameters(), ns["server"].named_parameters(), strict=True
    ):
        assert np.array_equal(trained, served), name


def test_hugging_face_block(tmp_path: Path, monkeypatch: Any) -> None:
    from mila_py import BuildContext, RuntimeMode
    from mila_py.components import Llama, LlamaConfig
    from mila_py.hf import save_hf_checkpoint

    cfg = LlamaConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=512
    )
    source = Llama("llama", cfg, device="CPU")
    source.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    save_hf_checkpoint(source, tmp_path / "path" / "to" / "llama")
    ns = _run(_block("from_pretrained"), {}, tmp_path, monkeypatch)
    out, trainer, prompt_ids = ns["out"], ns["trainer"], np.asarray(ns["prompt_ids"])
    assert out.shape == (5 + 32,) and np.array_equal(out[:5], prompt_ids)
    assert trainer.build_context.is_training and trainer.build_context.input_shape == (4, 512)
    for (name, want), (_, got) in zip(
        source.named_parameters(), trainer.named_parameters(), strict=True
    ):
        assert np.array_equal(want, got), name


def test_quick_start_runs_the_hugging_face_comparisons_with_the_pinned_releases() -> None:
    """The quick start's test command is the one CI runs, it installs the ``hf`` extra (so a
    newcomer's run compares with Hugging Face as CI's does), and the README names the releases
    that extra pins."""
    import tomllib

    root = README.parent
    lines = README.read_text(encoding="utf-8").splitlines()
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
