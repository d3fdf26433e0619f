"""Paths a mutation audit found untested: each test fails under a mutation the rest of the
suite let through (a sign flip in the strided interleaved NumPy rotation, the op's own
prefill/decode choosing the wrong length, top-p dropping the token that crosses the
threshold, a stale single checkpoint file losing to its index)."""

from __future__ import annotations

import numpy as np
import pytest
from rope_helpers import (
    BACKEND_PARAMS,
    FP32,
    arange_positions,
    assert_close,
    make_rope,
    random_qk,
    reference,
    rope_config,
)

from mila_py.models.sampling import SamplingParams, sample


# --- R6: a Q/K whose channel axis is strided (a documented "any strides" input) -------------
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_strided_channel_axis_matches_reference(backend: str, layout: str) -> None:
    cfg = rope_config((2, 1), 8, layout=layout)
    rope = make_rope(cfg, 2, 3, backend=backend)
    rng = np.random.default_rng(0)
    qb = rng.standard_normal((2, 3, 2 * cfg.channels)).astype(np.float32)
    kb = rng.standard_normal((2, 3, 2 * cfg.kv_channels)).astype(np.float32)
    q, k = qb[..., ::2], kb[..., ::2]  # last-axis stride 8 bytes
    q0, k0, gaps = q.copy(), k.copy(), qb[..., 1::2].copy()
    rope.prefill(q, k, 5)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 3, 5))
    assert_close(q, ref_q, FP32)
    assert_close(k, ref_k, FP32)
    np.testing.assert_array_equal(qb[..., 1::2], gaps)  # the channels between stay as they were


# --- B18/B19: the op's own prefill/decode (PositionalPairedOp) for length-dependent types ----
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.2, 1.3],
    "long_factor": [1.0, 2.0, 3.0, 4.0],
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
def test_op_prefill_and_decode_equal_the_component(backend: str, scaling) -> None:
    cfg = rope_config((2, 1), 8, max_seq_len=4096, scaling=scaling)
    rope = make_rope(cfg, 2, 4, backend=backend)
    q, k = random_qk(np.random.default_rng(1), cfg, 2, 4)
    a, b = (q.copy(), k.copy()), (q.copy(), k.copy())
    rope.prefill(*a, 100)
    rope.op.prefill(*b, 100)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    pos = np.array([10, 200])
    c, d = (q[:, :1].copy(), k[:, :1].copy()), (q[:, :1].copy(), k[:, :1].copy())
    rope.decode(*c, pos)
    rope.op.decode(*d, pos)
    np.testing.assert_array_equal(c[0], d[0])
    np.testing.assert_array_equal(c[1], d[1])


# --- B6: top_p keeps the smallest set whose probability reaches top_p -----------------------
def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    logits = np.log(np.tile([0.5, 0.3, 0.2], (4000, 1)))
    params = SamplingParams(temperature=1.0, top_p=0.6)
    seen = set(sample(logits, params, rng=np.random.default_rng(0)).tolist())
    assert seen == {0, 1}  # 0.5 < 0.6, so the 0.3 token is needed; the 0.2 one never
    params = SamplingParams(temperature=1.0, top_p=0.5)
    seen = set(sample(logits, params, rng=np.random.default_rng(0)).tolist())
    assert seen == {0}  # 0.5 reaches 0.5 already


# --- D9: a stale model.safetensors beside an index wins (documented, as in transformers) -----
def test_a_single_file_beside_an_index_wins(tmp_path) -> None:
    import json

    from safetensors.numpy import load_file, save_file

    from mila_py import BuildContext, RuntimeMode
    from mila_py.interop.hf import read_hf_checkpoint, save_hf_checkpoint
    from mila_py.models import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=24, max_seq_len=64
    )
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    path = tmp_path / "ckpt"
    save_hf_checkpoint(model, path)
    single = load_file(path / "model.safetensors")
    shards = {n: a + 1.0 for n, a in single.items()}  # different values in the shard
    save_file(shards, path / "model-1.safetensors")
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(shards, "model-1.safetensors")})
    )
    _, tensors = read_hf_checkpoint(path)
    for name, array in single.items():
        np.testing.assert_array_equal(tensors[name], array, err_msg=name)
