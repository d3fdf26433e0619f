"""Hugging Face checkpoints: mila_py's Llama against transformers' LlamaForCausalLM.

Small random checkpoints are made locally (no downloads) with ``save_pretrained``; weights are
drawn wider than HF's default init (so attention is far from uniform and RoPE matters) and the
RMSNorm weights are perturbed (so swapping two norms would show). Positions run to T = 40, past
the ``original_max_position_embeddings`` = 16 of the scaled-RoPE cases, so scaled frequencies
matter (``test_scaling_matters`` checks that dropping the scaling is visible).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mila_py import BuildContext, Precision, RuntimeMode  # noqa: E402
from mila_py.interop.hf import (  # noqa: E402
    eos_token_ids,
    hf_to_mila,
    llama_config_from_hf,
    load_hf_weights,
    mila_to_hf,
    read_hf_checkpoint,
    read_hf_config,
    save_hf_checkpoint,
)
from mila_py.models import Llama, LlamaConfig  # noqa: E402

B, T = 2, 40
VOCAB = 64
TOL = 1e-4  # relative to the largest |value| of the reference tensor

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    rms_norm_eps=1e-5,
)

CASES: dict[str, dict[str, Any]] = {
    "gqa": {},
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "head-dim-16": dict(head_dim=16),  # Hq * head_dim = 64 != hidden_size
    "llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
        }
    ),
    # attention factor mscale(8, 1.0) / mscale(8, 0.8) folded into cos/sin; softmax scale unchanged
    "yarn-mscale": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        }
    ),
    "linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # dynamic only rescales past max_position_embeddings, which a mila build cannot reach
    "dynamic": dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    "longrope": dict(
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 1.7, 2.0],
            "long_factor": [1.0, 3.0, 9.0, 20.0],
            "original_max_position_embeddings": 16,
        }
    ),
    "mistral": dict(model="mistral", sliding_window=None),
    # biases on Q, K, V (Qwen2) and on the output projection too (Llama's attention_bias)
    "qwen2-tied": dict(model="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "llama-bias": dict(attention_bias=True, mlp_bias=True),
    # Q/K head norms; head_dim 16 (Hq * d = 64 != hidden_size), with and without biases
    "qwen3": dict(model="qwen3", head_dim=16),
    "qwen3-bias-tied": dict(model="qwen3", attention_bias=True, tie_word_embeddings=True),
}


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def make_hf(seed: int = 0, **overrides: Any) -> Any:
    """A random ``LlamaForCausalLM`` (or ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``) in eval mode, float32, with norm weights and biases moved off their
    initial 1 and 0."""
    fields = {**BASE, **overrides}
    kind = fields.pop("model", "llama")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    config = config_cls(**fields, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def tokens(seed: int = 0, t: int = T) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(B, t))


def hf_logits(model: Any, toks: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(toks)).logits.float().numpy()


def rel_err(got: Any, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, dtype=np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for name, overrides in CASES.items():
        model = make_hf(**overrides)
        out[name] = (model, save(model, tmp_path_factory.mktemp(name)))
    return out


# ---------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", [RuntimeMode.TRAINING, RuntimeMode.INFERENCE])
def test_forward_matches_hf(
    checkpoints: dict[str, tuple[Any, Path]], case: str, mode: RuntimeMode
) -> None:
    hf_model, path = checkpoints[case]
    toks = tokens(1)
    ref = hf_logits(hf_model, toks)
    # INFERENCE: a context capacity above T, forward over the first T positions
    seq_len = T if mode is RuntimeMode.TRAINING else T + 8
    model = Llama.from_pretrained(path, runtime_mode=mode, batch_size=B, seq_len=seq_len)
    assert model.build_context.runtime_mode is mode
    got = model.forward(toks)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < TOL, (case, rel_err(got, ref), float(np.abs(ref).max()))


@pytest.mark.parametrize(
    "case",
    [
        "gqa",
        "mha-tied",
        "head-dim-16",
        "llama3",
        "yarn",
        "longrope",
        "qwen2-tied",
        "llama-bias",
        "qwen3",
        "qwen3-bias-tied",
    ],
)
def test_backward_matches_hf(checkpoints: dict[str, tuple[Any, Path]], case: str) -> None:
    hf_model, path = checkpoints[case]
    toks = tokens(2)
    weight = np.random.default_rng(3).standard_normal((B, T, VOCAB)).astype(np.float32)

    hf_model.zero_grad()
    logits = hf_model(torch.from_numpy(toks)).logits
    (logits * torch.from_numpy(weight)).sum().backward()
    hf_grads = {n: p.grad.numpy().copy() for n, p in hf_model.named_parameters()}
    hf_model.zero_grad()

    model = Llama.from_pretrained(path, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T)
    model.forward(toks)
    model.backward(weight)
    expected = hf_to_mila(hf_grads, model.config)
    got = dict(model.named_gradients())
    assert set(got) == set(expected)
    for name, ref in expected.items():
        assert rel_err(got[name], ref) < TOL, (name, rel_err(got[name], ref))


def test_generation_stops_at_eos_as_hf_does(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    """With EOS ids and a pad id, the same tokens, padding and length as ``transformers``."""
    hf_model, path = checkpoints["gqa"]
    prompt = tokens(4, t=5)
    model = Llama.from_pretrained(path, batch_size=B, seq_len=T, prefill_size=2)
    greedy = model.generate(prompt, max_new_tokens=12, eos_token_id=None)
    stop = [int(greedy[0, 5 + 1]), int(greedy[1, 5 + 4])]  # both rows finish early
    with torch.no_grad():
        ref = hf_model.generate(
            torch.from_numpy(prompt),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=1,
        ).numpy()
    got = model.generate(prompt, max_new_tokens=12, eos_token_id=stop, pad_token_id=1)
    np.testing.assert_array_equal(got, ref)
    assert (got == 1).any()  # some row was padded


@pytest.mark.parametrize(
    "case", ["gqa", "mha-tied", "llama3", "yarn-mscale", "qwen2-tied", "qwen3-bias-tied"]
)
def test_greedy_generation_matches_hf(checkpoints: dict[str, tuple[Any, Path]], case: str) -> None:
    """Chunked prefill + decode picks the same greedy tokens as ``transformers.generate``."""
    hf_model, path = checkpoints[case]
    prompt = tokens(4, t=5)
    new = 12
    with torch.no_grad():
        ref = hf_model.generate(
            torch.from_numpy(prompt),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,  # no early stop, no EOS suppression
            pad_token_id=0,
        ).numpy()
    model = Llama.from_pretrained(path, batch_size=B, seq_len=T, prefill_size=2)
    assert model.chunk_size == 2
    # as HF's call: no EOS (the checkpoint's generation_config.json names one)
    got = model.generate(prompt, max_new_tokens=new, temperature=0.0, eos_token_id=None)
    np.testing.assert_array_equal(got, ref)


def test_greedy_generation_with_a_repetition_penalty_matches_hf(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    """transformers' repetition penalty in a greedy ``generate`` (its logits processor over
    the prompt and the new tokens): the same tokens, which the penalty changes."""
    hf_model, path = checkpoints["gqa"]
    prompt = tokens(4, t=5)
    with torch.no_grad():
        ref = hf_model.generate(
            torch.from_numpy(prompt),
            max_new_tokens=12,
            do_sample=False,
            repetition_penalty=1.5,
            eos_token_id=None,
            pad_token_id=0,
        ).numpy()
    model = Llama.from_pretrained(path, batch_size=B, seq_len=T, prefill_size=2)
    # eos_token_id=None as in the reference (the checkpoint's own EOS id would stop it)
    got = model.generate(prompt, max_new_tokens=12, repetition_penalty=1.5, eos_token_id=None)
    np.testing.assert_array_equal(got, ref)
    assert not np.array_equal(got, model.generate(prompt, max_new_tokens=12, eos_token_id=None))


def test_scaling_matters(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    """The llama3 case with its scaling dropped is far from HF: the parity tests see RoPE."""
    hf_model, path = checkpoints["llama3"]
    config, tensors = read_hf_checkpoint(path)
    cfg = llama_config_from_hf(config)
    unscaled = LlamaConfig(**{**cfg.__dict__, "rope_scaling": None})
    model = Llama("llama", unscaled)
    model.build(BuildContext((B, T), RuntimeMode.INFERENCE))
    load_hf_weights(model, tensors)
    toks = tokens(1)
    assert rel_err(model.forward(toks), hf_logits(hf_model, toks)) > 100 * TOL


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = make_hf(seed=5, **CASES["llama3"])
    path = save(hf_model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    _, tensors = read_hf_checkpoint(path)
    assert set(tensors) == set(index["weight_map"])
    for name, p in hf_model.state_dict().items():
        np.testing.assert_array_equal(tensors[name], p.numpy())
    model = Llama.from_pretrained(path, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T)
    toks = tokens(4)
    assert rel_err(model.forward(toks), hf_logits(hf_model, toks)) < TOL


def test_sharded_checkpoint_missing_shard(tmp_path: Path) -> None:
    path = save(make_hf(seed=5), tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted(path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(shard.name)):
        read_hf_checkpoint(path)


def test_bf16_checkpoint(tmp_path: Path) -> None:
    hf_model = make_hf(seed=6, **CASES["yarn"]).to(torch.bfloat16)
    path = save(hf_model, tmp_path / "bf16")
    header_len = int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((path / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    _, tensors = read_hf_checkpoint(path)
    for name, p in hf_model.state_dict().items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], p.float().numpy())  # exact widening
    # the bf16 values computed in float32 (hf_model.float() would keep RoPE's inv_freq buffer
    # rounded to bf16 by .to(torch.bfloat16))
    reference = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert reference.model.embed_tokens.weight.dtype == torch.float32
    model = Llama.from_pretrained(
        path, runtime_mode=RuntimeMode.INFERENCE, batch_size=B, seq_len=T, precision=Precision.FP32
    )
    toks = tokens(7)
    assert rel_err(model.forward(toks), hf_logits(reference, toks)) < TOL


def test_save_hf_checkpoint_loads_in_transformers(
    checkpoints: dict[str, tuple[Any, Path]], tmp_path: Path
) -> None:
    for case in ("llama3", "mha-tied", "qwen2-tied", "llama-bias", "qwen3", "qwen3-bias-tied"):
        hf_model, path = checkpoints[case]
        model = Llama.from_pretrained(path, batch_size=B, seq_len=T)
        out = tmp_path / case
        save_hf_checkpoint(model, out)
        again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        assert type(again) is type(hf_model)
        toks = tokens(8)
        assert rel_err(hf_logits(again.eval(), toks), hf_logits(hf_model, toks)) < 1e-6, case
        assert llama_config_from_hf(json.loads((out / "config.json").read_text())) == model.config


# ---------------------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    "case", ["gqa", "mha-tied", "head-dim-16", "qwen2-tied", "llama-bias", "qwen3-bias-tied"]
)
def test_round_trip(checkpoints: dict[str, tuple[Any, Path]], case: str) -> None:
    _, path = checkpoints[case]
    config, tensors = read_hf_checkpoint(path)
    cfg = llama_config_from_hf(config)
    mila = hf_to_mila(tensors, cfg)
    back = mila_to_hf(mila, cfg)
    assert list(back) != [] and set(back) == set(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(back[name], array)
    model = Llama.from_pretrained(path, batch_size=1, seq_len=8)
    names = [name for name, _ in model.named_parameters()]
    assert list(mila) == names  # same names, same order
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p, mila[name])
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    v = tensors["model.layers.1.self_attn.v_proj.weight"]
    np.testing.assert_array_equal(
        mila["layer1.self_attn.qkv_proj.weight"], np.concatenate([q, k, v])
    )
    if cfg.qkv_bias:
        biases = [tensors[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"]
        np.testing.assert_array_equal(
            mila["layer1.self_attn.qkv_proj.bias"], np.concatenate(biases)
        )


def test_names_without_model_prefix_and_old_inv_freq_buffers(
    checkpoints: dict[str, tuple[Any, Path]],
) -> None:
    config, tensors = read_hf_checkpoint(checkpoints["gqa"][1])
    cfg = llama_config_from_hf(config)
    bare = {k.removeprefix("model."): v for k, v in tensors.items()}
    bare["layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    a, b = hf_to_mila(bare, cfg), hf_to_mila(tensors, cfg)
    assert list(a) == list(b)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_tied_checkpoint_with_lm_head(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    config, tensors = read_hf_checkpoint(checkpoints["mha-tied"][1])
    cfg = llama_config_from_hf(config)
    assert cfg.tie_embeddings and "lm_head.weight" not in tensors
    same = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}
    assert "lm_head.weight" not in hf_to_mila(same, cfg)
    differs = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}
    with pytest.raises(ValueError, match=re.escape("lm_head.weight differs")):
        hf_to_mila(differs, cfg)


def test_every_tensor_problem_reported_at_once(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    path = checkpoints["gqa"][1]
    _, tensors = read_hf_checkpoint(path)
    bad = dict(tensors)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.0.self_attn.bogus.weight"] = np.zeros(3, np.float32)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    model = Llama.from_pretrained(path, batch_size=B, seq_len=T)
    before = [p.copy() for p in model.get_parameters()]
    with pytest.raises(ValueError) as info:
        load_hf_weights(model, bad)
    message = str(info.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.self_attn.bogus.weight" in message
    assert "shape of model.layers.0.self_attn.k_proj.weight: got (8, 32), expected (16, 32)" in (
        message
    )
    for a, p in zip(before, model.get_parameters(), strict=True):  # nothing was loaded
        np.testing.assert_array_equal(a, p)
    with pytest.raises(ValueError, match=re.escape("missing: layer0.self_attn.qkv_proj.weight")):
        mila_to_hf({}, model.config)


def test_load_needs_a_built_model(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    config, tensors = read_hf_checkpoint(checkpoints["gqa"][1])
    with pytest.raises(RuntimeError, match="build"):
        load_hf_weights(Llama("llama", llama_config_from_hf(config)), tensors)


def test_eos_token_ids_as_transformers_reads_them(tmp_path: Path) -> None:
    """generation_config.json first (what transformers.generate stops at), then config.json."""
    hf_model = make_hf(eos_token_id=7)
    hf_model.generation_config.eos_token_id = [7, 9]
    path = save(hf_model, tmp_path / "chat")
    assert eos_token_ids(path) == [7, 9] == hf_model.generation_config.eos_token_id
    (path / "generation_config.json").unlink()
    assert eos_token_ids(path) == [7]
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert eos_token_ids(path) is None
    (path / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(path)
    with pytest.raises(FileNotFoundError, match=re.escape("config.json")):
        eos_token_ids(tmp_path)


def test_read_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_hf_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=re.escape("config.json")):
        read_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=re.escape("model.safetensors")):
        read_hf_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------- config
def hf_config(**overrides: Any) -> dict[str, Any]:
    return {**transformers.LlamaConfig(**BASE).to_dict(), **overrides}


def test_config_mapping() -> None:
    cfg = llama_config_from_hf(hf_config(**CASES["llama3"]))
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 32, 2, 4, 2)
    assert (cfg.hidden_dim, cfg.max_seq_len, cfg.norm_eps) == (48, 128, 1e-5)
    assert cfg.tie_embeddings is False and cfg.head_dim is None  # head_dim 8 = 32 / 4
    assert cfg.rope_base == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 16
    legacy = {  # transformers 4.x style
        "model_type": "llama",
        **{k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size")},
        **{k: BASE[k] for k in ("num_hidden_layers", "num_attention_heads")},
        "max_position_embeddings": 128,
        "rope_theta": 20000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "pretraining_tp": 2,  # ignored: same arithmetic
    }
    old = llama_config_from_hf(legacy)
    assert old.n_kv_heads == 4 and old.norm_eps == 1e-6 and old.rope_base == 20000.0
    assert dict(old.rope_scaling or {}) == {"rope_type": "linear", "factor": 2.0}
    assert llama_config_from_hf(hf_config(head_dim=16)).head_dim == 16
    plain = llama_config_from_hf(hf_config())
    assert (plain.qkv_bias, plain.out_bias) == (False, False)
    llama_bias = llama_config_from_hf(hf_config(attention_bias=True))
    assert (llama_bias.qkv_bias, llama_bias.out_bias, llama_bias.mlp_bias) == (True, True, False)
    assert llama_config_from_hf(hf_config(mlp_bias=True)).mlp_bias
    qwen2 = {**transformers.Qwen2Config(**BASE).to_dict()}
    assert (qwen2["model_type"], qwen2["use_sliding_window"]) == ("qwen2", False)
    qwen = llama_config_from_hf(qwen2)
    assert (qwen.qkv_bias, qwen.out_bias) == (True, False)
    # Qwen2.5 config.json files carry a window that use_sliding_window=false switches off; a
    # qwen2 config without the flag has it off too (transformers' default)
    del qwen2["use_sliding_window"], qwen2["layer_types"]
    assert llama_config_from_hf({**qwen2, "sliding_window": 32}) == qwen


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(model_type="gemma"), "model_type"),
        (dict(model_type="mistral", attention_bias=True), "attention_bias"),
        (dict(model_type="mistral", mlp_bias=True), "mlp_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(model_type="mistral", sliding_window=16), "sliding_window"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(hidden_size=None), "hidden_size"),
        (
            dict(rope_parameters={"full_attention": {"rope_type": "default"}}),
            "rope_parameters",
        ),
    ],
)
def test_unsupported_config_is_refused(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        llama_config_from_hf(hf_config(**overrides))


def test_config_problems_are_listed_together() -> None:
    with pytest.raises(ValueError) as info:
        llama_config_from_hf(
            hf_config(model_type="mistral", attention_bias=True, mlp_bias=True, hidden_act="relu")
        )
    for key in ("attention_bias", "mlp_bias", "hidden_act"):
        assert key in str(info.value)


FULL_LAYERS: dict[str, Any] = {"layer_types": ["full_attention"] * 30}


@pytest.mark.parametrize(
    ("model_type", "fields", "refused"),
    [
        ("mistral", {}, True),  # transformers' default window: 4096 < 8192
        ("mistral", {"sliding_window": None}, False),
        ("mistral", {"sliding_window": 8192}, False),
        ("qwen2", {"sliding_window": 1024}, False),  # use_sliding_window is off by default
        ("qwen2", {"use_sliding_window": True}, True),  # window 4096 on layers 28, 29
        ("qwen3", {"use_sliding_window": True, "sliding_window": 1024}, True),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 30}, False),  # none slides
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8192}, False),
        ("llama", {"sliding_window": 16}, False),  # Llama reads no window
        # Qwen attends per layer_types when given; Mistral ignores them and slides everywhere
        ("qwen2", {"use_sliding_window": True, "sliding_window": 1024, **FULL_LAYERS}, False),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 1024, **FULL_LAYERS}, False),
        ("mistral", {"sliding_window": 1024, **FULL_LAYERS}, True),
    ],
)
def test_sliding_windows_as_transformers_resolves_them(
    model_type: str, fields: dict[str, Any], refused: bool
) -> None:
    """The window each model type gets in transformers, defaults included (``layer_types``
    absent, as in transformers 4.x files, unless given), is refused when it is shorter than the
    context."""
    config = hf_config(max_position_embeddings=8192, num_hidden_layers=30)
    config.pop("layer_types", None)
    config.update(fields, model_type=model_type)
    if refused:
        with pytest.raises(ValueError, match="sliding_window"):
            llama_config_from_hf(config)
    else:
        assert llama_config_from_hf(config).n_layers == 30


def test_qwen3_head_dim_defaults_to_128() -> None:
    """Qwen3Config's head_dim is 128 unless given, whatever hidden_size / heads is."""
    config = {**transformers.Qwen3Config(**BASE).to_dict()}
    assert llama_config_from_hf(config).head_dim == config["head_dim"]
    del config["head_dim"]
    cfg = llama_config_from_hf(config)
    assert cfg.head_dim == 128 and cfg.qk_norm and not cfg.qkv_bias


def test_mistral_window_covering_the_context_is_accepted() -> None:
    cfg = llama_config_from_hf(hf_config(model_type="mistral", sliding_window=128))
    assert cfg.max_seq_len == 128


def test_a_window_covering_the_requested_context_loads(tmp_path: Path) -> None:
    """A Mistral window shorter than max_position_embeddings but covering the build's seq_len
    never binds: from_pretrained loads it and matches transformers there; a longer seq_len is
    refused with the way out."""
    hf_model = make_hf(model="mistral", sliding_window=T, max_position_embeddings=128)
    path = save(hf_model, tmp_path / "mistral")
    with pytest.raises(ValueError, match=r"covers max_position_embeddings=128"):
        llama_config_from_hf(read_hf_config(path))
    with pytest.raises(ValueError, match=rf"covers the context {2 * T}; a shorter seq_len="):
        Llama.from_pretrained(path, batch_size=B, seq_len=2 * T)
    model = Llama.from_pretrained(path, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T)
    toks = tokens(4)
    assert rel_err(model.forward(toks), hf_logits(hf_model, toks)) < TOL


def test_from_pretrained_takes_every_precision_a_llama_runs_in(tmp_path: Path) -> None:
    """An FP32 checkpoint loads as FP32 by default and in any CPU precision on request (its
    weights rounded to it); a precision that is not a Precision is a TypeError."""
    path = save(make_hf(), tmp_path / "llama")
    wide = Llama.from_pretrained(path, batch_size=B, seq_len=T)
    assert wide.precision is Precision.FP32
    for precision in (Precision.BF16, Precision.FP16, Precision.FP64):
        model = Llama.from_pretrained(path, batch_size=B, seq_len=T, precision=precision)
        assert model.precision is precision
        for (name, p), (_, q) in zip(
            model.named_parameters(), wide.named_parameters(), strict=True
        ):
            assert p.dtype == precision.numpy_dtype, name
            np.testing.assert_array_equal(p, q.astype(precision.numpy_dtype), err_msg=name)
    with pytest.raises(TypeError, match="must be a Precision"):
        Llama.from_pretrained(path, batch_size=B, seq_len=T, precision="FP32")  # type: ignore[arg-type]


def test_wrong_arguments_to_the_checkpoint_helpers_are_type_errors(tmp_path: Path) -> None:
    from mila_py.optim import AdamW, clip_grad_norm

    path = save(make_hf(), tmp_path / "llama")
    model = Llama.from_pretrained(path, runtime_mode=RuntimeMode.TRAINING, batch_size=B, seq_len=T)
    with pytest.raises(TypeError, match="model must be a Llama"):
        save_hf_checkpoint(tmp_path / "out", model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tensors must be a mapping"):
        load_hf_weights(model, str(path))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not its parameters"):
        AdamW(model.get_parameters())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not its parameters"):
        clip_grad_norm(model.get_parameters(), 1.0)  # type: ignore[arg-type]
