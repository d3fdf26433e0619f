"""Rope against Hugging Face transformers (skipped when transformers or torch is missing).

A tiny Llama ``config.json`` dict per scaling type goes both to ``rope_config_from_hf`` and to
``LlamaConfig``; the inverse frequencies must agree to float32 precision (HF forms them in
float32) and the rotation of Q and K must agree with ``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb`` at moderate positions (HF's angles are float32 products).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.llama.modeling_llama")

from rope_helpers import make_rope, random_qk  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from mila_py.interop.hf_rope import rope_config_from_hf  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 64, 4, 2, 16, 128
TABLE = 512  # mila's table reaches past max_position_embeddings (dynamic scaling beyond it)

ROPE_PARAMETERS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 32,
    },
    "yarn-deepseek": {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 24,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 32,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.0 + 2.0 * i for i in range(HEAD_DIM // 2)],
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 32,
    },
}

#: positions per call: below and above the original lengths (32 for yarn/llama3/longrope,
#: 128 = max_position_embeddings for dynamic)
POSITIONS = {
    "low": np.arange(4, 20),
    "above-32": np.arange(40, 56),
    "above-128": np.arange(150, 166),
}


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _config_json(parameters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POS,
        "rope_parameters": dict(parameters),
        **extra,
    }


def _hf_rotate(
    config_json: dict[str, Any], q: np.ndarray, k: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Any]:
    """HF's rotation of mila-layout ``q [B, T, H*d]``, ``k`` at ``positions [T]`` (fresh module)."""
    hf_config = LlamaConfig(
        **{**config_json, "rope_parameters": dict(config_json["rope_parameters"])}
    )
    emb = LlamaRotaryEmbedding(hf_config)
    batch, tokens = q.shape[0], q.shape[1]
    tq = torch.from_numpy(q.reshape(batch, tokens, HEADS, HEAD_DIM)).transpose(1, 2)
    tk = torch.from_numpy(k.reshape(batch, tokens, KV_HEADS, HEAD_DIM)).transpose(1, 2)
    position_ids = torch.from_numpy(np.broadcast_to(positions, (batch, tokens)).copy())
    cos, sin = emb(tq, position_ids)
    rq, rk = apply_rotary_pos_emb(tq, tk, cos, sin)
    return (
        rq.transpose(1, 2).reshape(batch, tokens, -1).numpy(),
        rk.transpose(1, 2).reshape(batch, tokens, -1).numpy(),
        emb,
    )


@pytest.mark.parametrize("where", list(POSITIONS))
@pytest.mark.parametrize("name", list(ROPE_PARAMETERS))
def test_rotation_matches_llama_rotary_embedding(name: str, where: str) -> None:
    config_json = _config_json(ROPE_PARAMETERS[name])
    cfg = rope_config_from_hf(config_json, max_seq_len=TABLE)
    assert cfg.rope_type == name.split("-")[0]
    positions = POSITIONS[where]
    rng = np.random.default_rng(3)
    batch, tokens = 2, len(positions)
    rope = make_rope(cfg, batch, tokens)
    q, k = random_qk(rng, cfg, batch, tokens)
    want_q, want_k, emb = _hf_rotate(config_json, q, k, positions)
    rope.rotate(q, k, positions)
    # HF forms angles and frequencies in float32: its error grows with the position (~1e-5 at
    # position 165 here, most for dynamic's float32 power of the rescaled base).
    atol = 5e-6 + 2e-7 * int(positions.max()) * rope.attention_scaling
    np.testing.assert_allclose(q, want_q, rtol=0, atol=atol)
    np.testing.assert_allclose(k, want_k, rtol=0, atol=atol)
    # the frequencies HF used for this call (dynamic/longrope update them per call)
    seq_len = int(positions.max()) + 1
    inv_freq, attention = rope.table.frequencies(seq_len)
    np.testing.assert_allclose(inv_freq, emb.inv_freq.double().numpy(), rtol=2e-6)
    assert attention == pytest.approx(emb.attention_scaling, rel=1e-6)


def test_dynamic_matches_one_hf_module_through_a_growing_generation() -> None:
    """One HF rotary module across the calls of a generation (prefill past the original length,
    then decode steps), as docs/rope.md says: mila_py's per-call frequencies agree at each call.
    A shorter call past the original length after a longer one is where they part: HF keeps the
    longest length it saw, mila_py computes the call's own (documented, no history)."""
    config_json = _config_json(ROPE_PARAMETERS["dynamic"])
    cfg = rope_config_from_hf(config_json, max_seq_len=TABLE)
    hf_config = LlamaConfig(**{**config_json, "rope_parameters": dict(ROPE_PARAMETERS["dynamic"])})
    emb = LlamaRotaryEmbedding(hf_config)
    table = make_rope(cfg, 1, 1).table
    x = torch.zeros(1, HEADS, 1, HEAD_DIM)
    calls = [np.arange(0, 200), np.array([200]), np.array([201]), np.array([202])]
    for positions in calls:
        emb(x, torch.from_numpy(positions[None]))
        got, _ = table.frequencies(int(positions.max()) + 1)
        np.testing.assert_allclose(got, emb.inv_freq.double().numpy(), rtol=2e-6)
    emb(x, torch.from_numpy(np.arange(140, 160)[None]))  # shorter, still past 128
    got, _ = table.frequencies(160)
    assert not np.allclose(got, emb.inv_freq.double().numpy(), rtol=1e-3)
    np.testing.assert_allclose(got, table.frequencies(160)[0])  # history-free: same again
    np.testing.assert_allclose(emb.inv_freq.double().numpy(), table.frequencies(203)[0], rtol=2e-6)


@pytest.mark.parametrize("name", ["linear", "dynamic", "yarn", "llama3", "longrope"])
def test_partial_rotary_frequencies_match_rope_init_functions(name: str) -> None:
    parameters = dict(ROPE_PARAMETERS[name], partial_rotary_factor=0.5)
    if name == "longrope":
        parameters["short_factor"] = parameters["short_factor"][: HEAD_DIM // 4]
        parameters["long_factor"] = parameters["long_factor"][: HEAD_DIM // 4]
    config_json = _config_json(parameters)
    cfg = rope_config_from_hf(config_json, max_seq_len=TABLE)
    assert cfg.rotary_dim == HEAD_DIM // 2
    hf_config = LlamaConfig(**{**config_json, "rope_parameters": dict(parameters)})
    table = make_rope(cfg, 1, 1).table
    for seq_len in (None, 20, 100, 300):
        want, attention = ROPE_INIT_FUNCTIONS[name](hf_config, None, seq_len=seq_len)
        got, got_attention = table.frequencies(seq_len)
        if name == "dynamic" and seq_len is not None and seq_len <= MAX_POS:
            want, attention = ROPE_INIT_FUNCTIONS[name](hf_config, None, seq_len=MAX_POS)
        np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6)
        assert got_attention == pytest.approx(attention, rel=1e-6)


def test_proportional_frequencies_match_hf() -> None:
    config_json = _config_json(
        {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0},
        partial_rotary_factor=0.5,
    )
    cfg = rope_config_from_hf(config_json)
    hf_config = LlamaConfig(
        **{**config_json, "rope_parameters": dict(config_json["rope_parameters"])}
    )
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](hf_config, None)
    got, _ = make_rope(cfg, 1, 1).table.frequencies()
    assert got.shape == (HEAD_DIM // 2,)
    np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6)


def test_interleaved_layout_is_half_layout_on_permuted_channels() -> None:
    """GPT-J pairs (2i, 2i+1) = Llama pairs (i, i+n) after moving evens before odds."""
    config_json = _config_json(ROPE_PARAMETERS["default"])
    cfg = rope_config_from_hf(config_json, layout="interleaved")
    rng = np.random.default_rng(5)
    q, k = random_qk(rng, cfg, 1, 8)
    perm = np.concatenate([np.arange(0, HEAD_DIM, 2), np.arange(1, HEAD_DIM, 2)])

    def to_half(x: np.ndarray, heads: int) -> np.ndarray:
        return x.reshape(1, 8, heads, HEAD_DIM)[..., perm].reshape(1, 8, -1)

    positions = np.arange(30, 38)
    want_q, want_k, _ = _hf_rotate(config_json, to_half(q, HEADS), to_half(k, KV_HEADS), positions)
    make_rope(cfg, 1, 8).rotate(q, k, positions)
    np.testing.assert_allclose(to_half(q, HEADS), want_q, rtol=0, atol=5e-5)
    np.testing.assert_allclose(to_half(k, KV_HEADS), want_k, rtol=0, atol=5e-5)


def test_legacy_rope_scaling_key() -> None:
    config_json = {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": MAX_POS,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = rope_config_from_hf(config_json)
    hf_config = LlamaConfig(**{**config_json, "rope_scaling": dict(config_json["rope_scaling"])})
    want, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config, None)
    np.testing.assert_allclose(
        make_rope(cfg, 1, 1).table.inv_freq, want.double().numpy(), rtol=2e-6
    )
