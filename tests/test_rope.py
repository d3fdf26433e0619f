"""Rope: rotation against an independent float64 reference, positions, backward, validation.

Every correctness case runs on both CPU paths (``numpy`` and the Numba ``fused`` kernel).
Scaling types are covered in ``test_rope_scaling.py``. The refusal of negative positions per
sequence runs over ``device`` (the CPU and ``CUDA:0``); the CUDA op's own checks are in
``test_rope_cuda.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided
from rope_helpers import (
    BACKEND_PARAMS,
    BF16,
    DECODE_CONFIGS,
    DECODE_PROGRAMS,
    FP16,
    FP32,
    INFERENCE,
    NARROW_POSITIONS,
    PRECISIONS,
    TRAINING,
    arange_positions,
    assert_close,
    check_negative_positions_refused,
    dtype_of,
    f64,
    make_rope,
    random_qk,
    reference,
    rope_config,
    run_decode_program,
)

from mila_py import BuildContext, Network, Precision
from mila_py.components import Rope, RopeConfig, get_rope
from mila_py.ops.cpu import _rope_fused

HEAD_DIM = 12  # not a power of two; n_freq = 6
#: (n_heads, n_kv_heads): single head, MQA, MHA, odd MHA, odd MQA, GQA
HEADS = [(1, 1), (4, 1), (4, 4), (3, 3), (5, 1), (6, 2)]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240531)


def _bits(x: Any) -> bytes:
    return np.ascontiguousarray(x).tobytes()


def _assert_bit_identical(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert _bits(actual) == _bits(expected)


# ---------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial8of12"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
def test_forward_and_prefill_match_reference(
    backend: str,
    heads: tuple[int, int],
    rotary_dim: int,
    layout: str,
    precision: Precision,
    rng: np.random.Generator,
) -> None:
    cfg = rope_config(heads, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 6
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    for offset in (0, 5, 1000, cfg.max_seq_len - tokens):
        q, k = random_qk(rng, cfg, batch, tokens, precision)
        q0, k0 = q.copy(), k.copy()
        if offset == 0:
            rope.forward(q, k)
        else:
            rope.prefill(q, k, offset)
        ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, offset))
        assert_close(q, ref_q, precision)
        assert_close(k, ref_k, precision)
        if rotary_dim:  # channels past the rotated part pass through untouched
            for x, x0, h in ((q, q0, heads[0]), (k, k0, heads[1])):
                rest = x.reshape(batch, tokens, h, HEAD_DIM)[..., rotary_dim:]
                rest0 = x0.reshape(batch, tokens, h, HEAD_DIM)[..., rotary_dim:]
                _assert_bit_identical(rest, rest0)


def test_position_zero_is_identity_and_position_changes_values(backend: str, rng) -> None:
    cfg = rope_config()
    rope = make_rope(cfg, 1, 1, backend=backend)
    q, k = random_qk(rng, cfg, 1, 1)
    q0, k0 = q.copy(), k.copy()
    rope.forward(q, k)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    rope.decode(q, k, 1)
    assert not np.allclose(q, q0)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    "shape",
    [(2, 600), (300, 2)],
    ids=["long-sequences", "many-sequences"],
)
def test_large_calls_cross_block_boundaries(
    backend: str,
    layout: str,
    precision: Precision,
    shape: tuple[int, int],
    rng,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls large enough for the NumPy path to block and the fused kernel to run in parallel."""
    import mila_py.ops.cpu.rope as cpu_rope

    monkeypatch.setattr(cpu_rope, "_NUMPY_BLOCK_BYTES", 64 * 1024)  # 64 tokens: 10 blocks
    monkeypatch.setattr(cpu_rope, "_PARALLEL_ELEMENTS", 1)  # blocks spread over the cores
    cfg = rope_config((4, 1), head_dim=64, max_seq_len=2048, layout=layout)
    batch, tokens = shape
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, batch, tokens, precision)
    q0, k0 = q.copy(), k.copy()
    rope.prefill(q, k, 1400)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 1400))
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)
    positions = rng.integers(0, cfg.max_seq_len, size=(batch, tokens))
    q, k = q0.copy(), k0.copy()
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)


@pytest.mark.parametrize(
    "make_positions",
    [
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)),
        lambda rng, b, t: rng.integers(1000, 2048, size=(t,)),
        lambda rng, b, t: rng.integers(1000, 2048, size=(b, 1)),
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)).astype(np.int32),
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)).astype(np.uint16),
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)).tolist(),
        lambda rng, b, t: np.full((b, t), 2047),
    ],
    ids=["BT", "T", "B1", "int32", "uint16", "list", "last-row"],
)
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_rotate_explicit_positions(
    backend: str, precision: Precision, make_positions: Callable[..., Any], rng
) -> None:
    cfg = rope_config((5, 1), layout="interleaved")
    batch, tokens = 3, 5
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    positions = make_positions(rng, batch, tokens)
    q, k = random_qk(rng, cfg, batch, tokens, precision)
    q0, k0 = q.copy(), k.copy()
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, np.asarray(positions))
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_smaller_calls_than_the_build(backend: str, precision: Precision, rng) -> None:
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 4, 16, precision=precision, backend=backend)
    for batch, tokens in ((1, 1), (4, 3), (2, 16)):
        q, k = random_qk(rng, cfg, batch, tokens, precision)
        q0, k0 = q.copy(), k.copy()
        rope.prefill(q, k, 700)
        ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 700))
        assert_close(q, ref_q, precision)
        assert_close(k, ref_k, precision)


# ---------------------------------------------------------------------------------- prefill / decode


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("start", [0, 1500])
def test_prefill_in_chunks_equals_one_call(
    backend: str, layout: str, precision: Precision, start: int, rng
) -> None:
    cfg = rope_config((4, 1), layout=layout, rotary_dim=8)
    batch, tokens = 2, 20
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, batch, tokens, precision)
    whole_q, whole_k = q.copy(), k.copy()
    if start == 0:
        rope.forward(whole_q, whole_k)
    else:
        rope.prefill(whole_q, whole_k, start)
    chunk_q, chunk_k = q.copy(), k.copy()
    for lo, hi in ((0, 7), (7, 14), (14, 19), (19, 20)):
        # slices of the same buffers: non-contiguous in T, rotated through the view
        rope.prefill(chunk_q[:, lo:hi], chunk_k[:, lo:hi], start + lo)
    _assert_bit_identical(chunk_q, whole_q)
    _assert_bit_identical(chunk_k, whole_k)


def test_prefill_chunks_given_the_whole_length_rotate_as_one_call(backend: str, rng) -> None:
    """A length-dependent scaling (dynamic NTK) picks its frequencies for ``seq_len``: chunks
    given the whole prompt's end rotate as one call over it, and a bad ``seq_len`` is refused
    before anything is rotated."""
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}
    cfg = RopeConfig(4 * 16, 4, 1, 64, scaling=scaling)
    rope = make_rope(cfg, 1, 24, backend=backend)
    q, k = random_qk(rng, cfg, 1, 24)
    whole_q, whole_k = q.copy(), k.copy()
    rope.forward(whole_q, whole_k)
    for lo, hi in ((0, 5), (5, 12), (12, 24)):
        rope.prefill(q[:, lo:hi], k[:, lo:hi], lo, seq_len=24)
    _assert_bit_identical(q, whole_q)
    _assert_bit_identical(k, whole_k)
    before = q.copy()
    for bad in (4, 65, 2.0):
        with pytest.raises((ValueError, TypeError), match="seq_len"):
            rope.prefill(q[:, :5], k[:, :5], 0, seq_len=bad)  # type: ignore[arg-type]
    _assert_bit_identical(q, before)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_decode_at_each_position_equals_forward(
    backend: str, layout: str, precision: Precision, rng
) -> None:
    cfg = rope_config((3, 3), layout=layout, max_seq_len=64)
    batch, tokens = 2, 64
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, batch, tokens, precision)
    whole_q, whole_k = q.copy(), k.copy()
    rope.forward(whole_q, whole_k)
    for t in range(tokens):
        step_q, step_k = q[:, t : t + 1].copy(), k[:, t : t + 1].copy()
        rope.decode(step_q, step_k, t if t % 2 else np.int64(t))
        _assert_bit_identical(step_q, whole_q[:, t : t + 1])
        _assert_bit_identical(step_k, whole_k[:, t : t + 1])


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_decode_per_sequence_positions(backend: str, precision: Precision, rng) -> None:
    cfg = rope_config((4, 1))
    batch = 4
    rope = make_rope(cfg, batch, 8, precision=precision, backend=backend)
    positions = np.array([3, 1500, 2047, 0])
    q, k = random_qk(rng, cfg, batch, 1, precision)
    q0, k0 = q.copy(), k.copy()
    rope.decode(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions[:, None])
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)
    for b, p in enumerate(positions):  # the same as decoding each sequence on its own
        one_q, one_k = q0[b : b + 1].copy(), k0[b : b + 1].copy()
        rope.decode(one_q, one_k, int(p))
        _assert_bit_identical(one_q, q[b : b + 1])
        _assert_bit_identical(one_k, k[b : b + 1])
    # a list and a one-element array (broadcast to every sequence) work too
    list_q, list_k = q0.copy(), k0.copy()
    rope.decode(list_q, list_k, positions.tolist())
    _assert_bit_identical(list_q, q)
    same_q, same_k = q0.copy(), k0.copy()
    rope.decode(same_q, same_k, np.array([1500]))
    ref_q, ref_k = reference(cfg, q0, k0, np.full((batch, 1), 1500))
    assert_close(same_q, ref_q, precision)
    assert_close(same_k, ref_k, precision)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("heads", [(4, 1), (3, 3)], ids=["mqa", "mha"])
def test_fused_qkv_views_rotate_through_the_view(
    backend: str, heads: tuple[int, int], layout: str, precision: Precision, rng
) -> None:
    hq, hk = heads
    cfg = rope_config(heads, layout=layout, rotary_dim=8)
    d = HEAD_DIM
    batch, tokens = 2, 5
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    qkv = rng.standard_normal((batch, tokens, (hq + 2 * hk) * d)).astype(dtype_of(precision))
    qkv0 = qkv.copy()
    q = qkv[:, :, : hq * d]
    k = qkv[:, :, hq * d : (hq + hk) * d]
    rope.prefill(q, k, 900)
    ref_q, ref_k = reference(
        cfg,
        qkv0[:, :, : hq * d],
        qkv0[:, :, hq * d : (hq + hk) * d],
        arange_positions(batch, tokens, 900),
    )
    assert_close(qkv[:, :, : hq * d], ref_q, precision)
    assert_close(qkv[:, :, hq * d : (hq + hk) * d], ref_k, precision)
    _assert_bit_identical(qkv[:, :, (hq + hk) * d :], qkv0[:, :, (hq + hk) * d :])  # V untouched
    # decode through views of a [B, 1, ...] slice of the same buffer
    step = qkv0[:, :1].copy()
    rope.decode(step[:, :, : hq * d], step[:, :, hq * d : (hq + hk) * d], np.array([7, 1999]))
    ref_q, ref_k = reference(
        cfg, qkv0[:, :1, : hq * d], qkv0[:, :1, hq * d : (hq + hk) * d], np.array([[7], [1999]])
    )
    assert_close(step[:, :, : hq * d], ref_q, precision)
    assert_close(step[:, :, hq * d : (hq + hk) * d], ref_k, precision)
    _assert_bit_identical(step[:, :, (hq + hk) * d :], qkv0[:, :1, (hq + hk) * d :])


@pytest.mark.parametrize(
    "call",
    [
        lambda r, q, k: r.forward(q, k),
        lambda r, q, k: r.prefill(q, k, 2048 - q.shape[1]),
        lambda r, q, k: r.rotate(q, k, np.zeros(1, np.int64)),  # broadcasts to [B, T]
        lambda r, q, k: r.decode(q[:, :1], k[:, :1], 5) if q.shape[1] else None,
        lambda r, q, k: r.backward(q, k),
        # positions of the batch's own shape: empty too
        lambda r, q, k: r.rotate(q, k, np.zeros(q.shape[:2], np.int64)),
        lambda r, q, k: r.backward(q, k, np.zeros(q.shape[:2], np.int64)),
    ],
    ids=[
        "forward",
        "prefill",
        "rotate",
        "decode",
        "backward",
        "rotate-positions",
        "backward-positions",
    ],
)
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["B0", "T0"])
@pytest.mark.parametrize("precision", [FP32, FP16], ids=str)
def test_empty_calls_are_no_ops(backend: str, shape, precision: Precision, call) -> None:
    """Like PyTorch on empty tensors: B == 0 or T == 0 rotates nothing and does not fail."""
    cfg = rope_config((3, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend)
    q = np.zeros((*shape, cfg.channels), dtype_of(precision))
    k = np.zeros((*shape, cfg.kv_channels), dtype_of(precision))
    call(rope, q, k)
    assert q.shape == (*shape, cfg.channels)


@pytest.mark.parametrize("position", [5, np.zeros(0, np.int64)], ids=["int", "per-sequence"])
def test_an_empty_batch_decodes_nothing(backend: str, position: Any) -> None:
    """decode with B == 0 (T is 1 by contract), through the component and through its op."""
    cfg = rope_config((3, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend)
    q = np.zeros((0, 1, cfg.channels), np.float32)
    k = np.zeros((0, 1, cfg.kv_channels), np.float32)
    rope.decode(q, k, position)
    rope._op.decode(q, k, position)
    assert q.shape == (0, 1, cfg.channels)


SCALINGS_ACROSS_1024: dict[str, Any] = {
    "none": None,
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 1024},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 1.7 * i for i in range(8)],
        "original_max_position_embeddings": 1024,
    },
}


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize("scaling", list(SCALINGS_ACROSS_1024))
def test_a_decode_loop_on_the_same_buffers(
    backend: str, scaling: str, precision: Precision, rng
) -> None:
    """A decode loop writes each token into the same Q/K buffers, at positions across the
    original context (dynamic NTK's rows, LongRoPE's long table): each step gives the bits of a
    fresh component's call and the float64 reference."""
    cfg = rope_config((3, 1), 16, max_seq_len=4096, scaling=SCALINGS_ACROSS_1024[scaling])
    batch = 2
    rope = make_rope(cfg, batch, 1, precision=precision, backend=backend)
    checked = make_rope(cfg, batch, 1, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, batch, 1, precision)
    for position in (5, 6, 1022, 1023, 1024, 1500, 4095, np.int64(9), 2):
        q0, k0 = random_qk(rng, cfg, batch, 1, precision)
        q[...], k[...] = q0, k0
        rope.decode(q, k, position)
        fresh_q, fresh_k = q0.copy(), k0.copy()
        checked.decode(fresh_q, fresh_k, int(position))
        assert _bits(q) == _bits(fresh_q) and _bits(k) == _bits(fresh_k)
        ref_q, ref_k = reference(cfg, q0, k0, np.full((batch, 1), int(position)))
        assert_close(q, ref_q, precision)
        assert_close(k, ref_k, precision)


@pytest.mark.parametrize(("dtype", "max_seq_len"), NARROW_POSITIONS)
def test_negative_positions_per_sequence_are_refused(
    device: str, dtype: Any, max_seq_len: int, rng
) -> None:
    check_negative_positions_refused(dtype, max_seq_len, rng, device=device)


@settings(max_examples=60, deadline=None)
@given(program=DECODE_PROGRAMS, config=DECODE_CONFIGS, seed=st.integers(0, 2**16))
def test_any_program_of_decodes_matches_a_fresh_checked_component(program, config, seed) -> None:  # type: ignore[no-untyped-def]
    """Decode calls in any order on two buffer pairs, with positions in and out of range (and
    not ints), a pair made read-only or reshaped in place before a call, the backend switched,
    a position given as np.int64: each call does what the same call on fresh copies through a
    new component does, the same values or the same error (and then leaves Q and K as they
    were)."""
    pytest.importorskip("numba")
    run_decode_program(program, np.random.default_rng(seed), device="CPU", config=config)


def test_backends_agree(rng) -> None:
    pytest.importorskip("numba")
    cfg = rope_config((5, 1), layout="interleaved", rotary_dim=10)
    for precision in PRECISIONS:
        results = []
        q, k = random_qk(rng, cfg, 2, 9, precision)
        for backend in ("numpy", "fused"):
            rope = make_rope(cfg, 2, 9, precision=precision, backend=backend)
            x, y = q.copy(), k.copy()
            rope.prefill(x, y, 1234)
            results.append((x, y))
        np.testing.assert_allclose(f64(results[0][0]), f64(results[1][0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(f64(results[0][1]), f64(results[1][1]), rtol=1e-6, atol=1e-6)


def test_backend_setting() -> None:
    rope = make_rope(rope_config(), 1, 1)
    assert rope.op.backend in ("numpy", "fused", "auto")
    with pytest.raises(ValueError, match="backend"):
        rope.op.backend = "cuda"
    rope.op.backend = "numpy"
    assert rope.op.backend == "numpy" and not rope.op.uses_fused


# ---------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("heads", [(4, 1), (3, 3), (1, 1)], ids=["mqa", "mha-odd", "single"])
def test_backward_matches_reference(
    backend: str,
    heads: tuple[int, int],
    rotary_dim: int,
    layout: str,
    precision: Precision,
    rng,
) -> None:
    cfg = rope_config(heads, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 6
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, precision=precision, backend=backend)
    dq, dk = random_qk(rng, cfg, batch, tokens, precision)
    dq0, dk0 = dq.copy(), dk.copy()
    dq_in, dk_in = rope.backward(dq, dk)
    _assert_bit_identical(dq, dq0)  # upstream gradients are not modified
    _assert_bit_identical(dk, dk0)
    ref_q, ref_k = reference(cfg, dq0, dk0, arange_positions(batch, tokens), inverse=True)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)
    positions = rng.integers(1000, cfg.max_seq_len, size=(batch, tokens))
    dq_in, dk_in = rope.backward(dq, dk, positions=positions)
    ref_q, ref_k = reference(cfg, dq0, dk0, positions, inverse=True)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)
    # a smaller call fills the leading part of the component's buffers
    dq_in, dk_in = rope.backward(dq[:1, :3], dk[:1, :3], positions=np.array([1500, 7, 2047]))
    assert dq_in.shape == (1, 3, cfg.channels) and dk_in.shape == (1, 3, cfg.kv_channels)
    ref_q, ref_k = reference(cfg, dq0[:1, :3], dk0[:1, :3], np.array([1500, 7, 2047]), inverse=True)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)


def test_backward_returns_component_owned_buffers(backend: str, rng) -> None:
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend)
    assert rope.get_gradients() == []  # no parameters: nothing aligned with get_parameters
    grads = rope.input_gradients
    assert [g.shape for g in grads] == [(2, 4, cfg.channels), (2, 4, cfg.kv_channels)]
    dq, dk = random_qk(rng, cfg, 2, 4)
    dq.flags.writeable = False  # backward only reads its inputs
    dk.flags.writeable = False
    dq_in, dk_in = rope.backward(dq, dk)
    assert np.shares_memory(dq_in, grads[0]) and np.shares_memory(dk_in, grads[1])
    assert not np.shares_memory(dq_in, dq)
    first = dq_in.copy()
    rope.backward(dq * 2, dk * 2)  # overwritten by the next backward
    np.testing.assert_allclose(grads[0], 2 * first, rtol=1e-6, atol=1e-6)


TORCH_DTYPES = {FP32: "float32", FP16: "float16", BF16: "bfloat16"}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_torch_tensors_are_rotated_in_place_without_a_copy(
    backend: str, precision: Precision, rng
) -> None:
    """Every call takes torch CPU tensors as they are (views of their memory, bf16 included):
    prefill, rotate, decode at per-sequence torch positions, backward; Q and K as views of one
    fused torch QKV tensor too. Overlapping views are refused with the tensor unchanged."""
    torch = pytest.importorskip("torch")
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 5, mode=TRAINING, precision=precision, backend=backend)
    dtype = getattr(torch, TORCH_DTYPES[precision])
    q0, k0 = random_qk(rng, cfg, 2, 5, precision)
    width = cfg.channels + cfg.kv_channels
    qkv = torch.from_numpy(np.concatenate([q0, k0], axis=2).astype(np.float32)).to(dtype)
    qkv = torch.cat([qkv, torch.ones(2, 5, 3, dtype=dtype)], dim=2)  # a V-like tail
    q, k = qkv[:, :, : cfg.channels], qkv[:, :, cfg.channels : width]

    def host(t: Any) -> np.ndarray:  # a float32 copy (for FP32, .float() is the tensor itself)
        return t.float().numpy().copy()

    rope.prefill(q, k, 1000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 5, 1000))
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)
    assert (host(qkv[:, :, width:]) == 1).all()

    rotated = host(qkv)
    positions = torch.tensor([[3, 9, 0, 2047, 5], [1, 1, 1, 1, 1]])
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(
        cfg, rotated[:, :, : cfg.channels], rotated[:, :, cfg.channels : width], positions.numpy()
    )
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)

    one_q, one_k = q[:, :1].clone(), k[:, :1].clone()
    start_q, start_k = host(one_q), host(one_k)
    rope.decode(one_q, one_k, torch.tensor([7, 2047]))
    ref_q, ref_k = reference(cfg, start_q, start_k, np.array([[7], [2047]]))
    assert_close(host(one_q), ref_q, precision)
    assert_close(host(one_k), ref_k, precision)

    dq_in, dk_in = rope.backward(q, k)
    ref_q, ref_k = reference(cfg, host(q), host(k), arange_positions(2, 5), inverse=True)
    assert isinstance(dq_in, np.ndarray)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)

    before = host(qkv)
    with pytest.raises(ValueError, match="share memory"):
        rope.forward(q, qkv[:, :, 4 : 4 + cfg.kv_channels])
    assert np.array_equal(host(qkv), before) and not np.array_equal(before, rotated)
    with pytest.raises(TypeError, match="dtype"):
        rope.forward(q.double(), k.double())
    with pytest.raises(TypeError, match=r"requires grad.*detach\(\)"):
        rope.forward(q.clone().requires_grad_(), k)
    assert np.array_equal(host(qkv), before)


@pytest.mark.parametrize(
    "call",
    [
        lambda rope, q, k: rope.forward(q, k),
        lambda rope, q, k: rope.decode(q[:, :1], k[:, :1], 3),
        lambda rope, q, k: rope.rotate(q, k, np.arange(4)),
        lambda rope, q, k: rope.backward(q, k),
    ],
    ids=["forward", "decode", "rotate", "backward"],
)
def test_foreign_producers_are_released_even_when_adopting_k_fails(
    call: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, rng
) -> None:
    """Q adopted, then K's export raises: the call still ends by ordering Q's producer (on a
    GPU, a stream left recorded would be waited on by an unrelated later call)."""
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 4, mode=TRAINING)
    ctx = rope.execution_context
    events: list[str] = []

    def adopt(array: Any) -> Any:
        events.append("adopt")
        if len(events) == 2:
            raise BufferError("cannot export")
        return array

    monkeypatch.setattr(ctx, "as_device_array", adopt)
    monkeypatch.setattr(ctx, "release_foreign", lambda: events.append("release"))
    q, k = random_qk(rng, cfg, 2, 4)
    with pytest.raises(BufferError):
        call(rope, q, k)
    assert events == ["adopt", "adopt", "release"]


def test_backward_refuses_gradients_that_lie_in_the_other_output_buffer(backend: str, rng) -> None:
    """The results of one backward passed back swapped (dq in the dk_in buffer) would be
    overwritten before they are read: refused, nothing changed. Passed back in their own
    buffers, they are rotated in place correctly."""
    cfg = rope_config((3, 3))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend)
    dq, dk = random_qk(rng, cfg, 2, 4)
    first_q, first_k = rope.backward(dq, dk)
    saved_q, saved_k = first_q.copy(), first_k.copy()
    for args, name in (((first_k, first_q), "dq"), ((dq, first_q[:, :, :]), "dk")):
        with pytest.raises(ValueError, match=f"{name} lies in this component's"):
            rope.backward(*args)
        _assert_bit_identical(first_q, saved_q)
        _assert_bit_identical(first_k, saved_k)
    dq_in, dk_in = rope.backward(first_q, first_k)  # each in its own buffer: in place
    ref_q, ref_k = reference(cfg, saved_q, saved_k, arange_positions(2, 4), inverse=True)
    assert np.shares_memory(dq_in, first_q)
    assert_close(dq_in, ref_q, FP32)
    assert_close(dk_in, ref_k, FP32)


def _loss(rope: Rope, q: np.ndarray, k: np.ndarray, wq, wk, positions) -> float:
    x, y = q.copy(), k.copy()
    rope.rotate(x, y, positions)
    return float(np.sum(f64(x) * wq) + np.sum(f64(y) * wk))


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}],
    ids=["default", "yarn"],
)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 4], ids=["full", "partial"])
def test_backward_against_finite_differences(
    backend: str, rotary_dim: int, layout: str, scaling, rng
) -> None:
    """dL/dq by central differences of L = <Wq, rope(q)> + <Wk, rope(k)>, element by element."""
    cfg = RopeConfig(
        channels=18,
        n_heads=3,
        n_kv_heads=1,
        max_seq_len=4096,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=scaling,
    )
    batch, tokens = 2, 2
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, backend=backend)
    positions = np.array([[1000, 3001], [4095, 17]])
    q, k = random_qk(rng, cfg, batch, tokens)
    wq = rng.standard_normal(q.shape)  # random, asymmetric upstream gradients
    wk = rng.standard_normal(k.shape)
    dq_in, dk_in = rope.backward(wq.astype(np.float32), wk.astype(np.float32), positions=positions)
    h = 0.5  # the loss is linear: central differences are exact up to fp32 rounding
    for x, grad in ((q, dq_in), (k, dk_in)):
        numeric = np.zeros(x.shape)
        for index in np.ndindex(x.shape):
            saved = x[index]
            x[index] = saved + h
            plus = _loss(rope, q, k, wq, wk, positions)
            x[index] = saved - h
            minus = _loss(rope, q, k, wq, wk, positions)
            x[index] = saved
            numeric[index] = (plus - minus) / (2 * h)
        np.testing.assert_allclose(f64(grad), numeric, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_forward_after_backward_is_identity(backend: str, layout: str, rng) -> None:
    cfg = rope_config((3, 1), layout=layout, rotary_dim=8)
    batch, tokens = 2, 5
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, backend=backend)
    dq, dk = random_qk(rng, cfg, batch, tokens)
    # positions None = 0..T-1
    dq_in, dk_in = rope.backward(dq, dk)
    x, y = dq_in.copy(), dk_in.copy()
    rope.forward(x, y)
    np.testing.assert_allclose(x, dq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, dk, rtol=1e-6, atol=1e-6)
    # explicit positions
    positions = rng.integers(0, cfg.max_seq_len, size=(batch, tokens))
    dq_in, dk_in = rope.backward(dq, dk, positions=positions)
    x, y = dq_in.copy(), dk_in.copy()
    rope.rotate(x, y, positions)
    np.testing.assert_allclose(x, dq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, dk, rtol=1e-6, atol=1e-6)
    # and the other way round: backward(forward(x)) = x
    x, y = dq.copy(), dk.copy()
    rope.prefill(x, y, 1800)
    dq_in, dk_in = rope.backward(x, y, positions=np.arange(1800, 1800 + tokens))
    np.testing.assert_allclose(dq_in, dq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dk_in, dk, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", [FP16, BF16], ids=str)
def test_backward_rounds_once_in_reduced_precision(backend: str, precision: Precision, rng) -> None:
    cfg = rope_config((4, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend)
    dq, dk = random_qk(rng, cfg, 2, 4, precision)
    dq_in, dk_in = rope.backward(dq, dk, positions=np.array([2000, 1, 1024, 77]))
    assert dq_in.dtype == dtype_of(precision)
    ref_q, ref_k = reference(cfg, dq, dk, np.array([2000, 1, 1024, 77]), inverse=True)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)


def test_inference_build_has_no_gradients_and_no_backward(rng) -> None:
    cfg = rope_config((4, 1))
    rope = make_rope(cfg, 2, 4, mode=INFERENCE)
    assert rope.get_gradients() == []
    stats = rope.get_memory_stats()
    assert stats.gradient_bytes == 0
    assert stats.state_bytes == rope.table.nbytes == 2 * cfg.max_seq_len * (HEAD_DIM // 2) * 4
    dq, dk = random_qk(rng, cfg, 2, 4)
    with pytest.raises(RuntimeError, match="INFERENCE"):
        rope.backward(dq, dk)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_training_build_memory(precision: Precision) -> None:
    cfg = rope_config((4, 2), rotary_dim=8)
    rope = make_rope(cfg, 3, 5, mode=TRAINING, precision=precision)
    stats = rope.get_memory_stats()
    item = dtype_of(precision).itemsize
    assert stats.gradient_bytes == 3 * 5 * (cfg.channels + cfg.kv_channels) * item
    assert stats.parameter_bytes == 0
    assert stats.state_bytes == 2 * cfg.max_seq_len * 4 * 4  # cos + sin, 4 pairs, float32
    assert stats.host_total_bytes == 0
    grads = rope.input_gradients
    assert [g.dtype for g in grads] == [dtype_of(precision)] * 2
    assert rope.get_parameters() == [] and rope.parameter_count() == 0


# ---------------------------------------------------------------------------------- bad input

Q_W, K_W = 3 * 8, 1 * 8
_BAD_CFG = dict(channels=Q_W, n_heads=3, n_kv_heads=1, max_seq_len=64)


def _readonly(x: np.ndarray) -> np.ndarray:
    view = x.view()
    view.flags.writeable = False
    return view


class _DuckArray:
    """Quacks like an array (shape, dtype, __array__) but is not one of the device's arrays."""

    def __init__(self, x: np.ndarray) -> None:
        self._x = x
        self.shape, self.dtype, self.ndim = x.shape, x.dtype, x.ndim
        self.flags = x.flags

    def __array__(self, dtype=None, copy=None):
        return self._x


def _overlapping_views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Q and K views of one buffer whose channels overlap by 4 (an off-by-4 fused QKV split)."""
    return buf[:, :, :Q_W], buf[:, :, Q_W - 4 : Q_W - 4 + K_W], 3


F32 = np.float32
#: (id, method, args(q, k, dq, dk), exception, message pattern); q [2, 4, 24], k [2, 4, 8]
BAD_CALLS: list[tuple[str, str, Callable[..., tuple], type[Exception], str]] = [
    ("q-rank-2", "forward", lambda q, k, *_: (q[0], k), ValueError, r"\[B, T, 24\]"),
    ("q-rank-4", "forward", lambda q, k, *_: (q.reshape(2, 4, 3, 8), k), ValueError, r"\[B, T"),
    ("q-width", "forward", lambda q, k, *_: (q[:, :, :16], k), ValueError, r"\[B, T, 24\]"),
    ("k-width", "forward", lambda q, k, *_: (q, q), ValueError, r"\[B, T, 8\]"),
    ("k-rank", "forward", lambda q, k, *_: (q, k[:, :, None]), ValueError, r"\[B, T, 8\]"),
    (
        "B-beyond-build",
        "forward",
        lambda *_: (np.ones((3, 4, Q_W), F32), np.ones((3, 4, K_W), F32)),
        ValueError,
        "build shape",
    ),
    (
        "T-beyond-build",
        "prefill",
        lambda *_: (np.ones((2, 5, Q_W), F32), np.ones((2, 5, K_W), F32), 0),
        ValueError,
        "build shape",
    ),
    ("B-mismatch", "forward", lambda q, k, *_: (q, k[:1]), ValueError, "share B and T"),
    ("T-mismatch", "forward", lambda q, k, *_: (q, k[:, :2]), ValueError, "share B and T"),
    ("q-float64", "forward", lambda q, k, *_: (q.astype(np.float64), k), TypeError, "dtype"),
    ("k-float16", "forward", lambda q, k, *_: (q, k.astype(np.float16)), TypeError, "dtype"),
    ("q-list", "forward", lambda q, k, *_: (q.tolist(), k), TypeError, "must be an array"),
    ("k-duck", "forward", lambda q, k, *_: (q, _DuckArray(k)), TypeError, "must be an array"),
    ("q-read-only", "forward", lambda q, k, *_: (_readonly(q), k), ValueError, "read-only"),
    ("k-read-only", "prefill", lambda q, k, *_: (q, _readonly(k), 3), ValueError, "read-only"),
    ("k-inside-q", "forward", lambda q, k, *_: (q, q[:, :, 8:16]), ValueError, "share memory"),
    (
        "q-k-views-overlap",
        "prefill",
        lambda q, k, *_: _overlapping_views(np.concatenate([q, k], axis=2)),
        ValueError,
        "share memory",
    ),
    (
        "q-rows-alias",
        "forward",
        lambda q, k, *_: (as_strided(q, q.shape, (0, *q.strides[1:])), k),
        ValueError,
        "elements that share memory",
    ),
    ("offset-negative", "prefill", lambda q, k, *_: (q, k, -1), ValueError, ">= 0"),
    ("offset-float", "prefill", lambda q, k, *_: (q, k, 1.0), TypeError, "int"),
    ("offset-bool", "prefill", lambda q, k, *_: (q, k, True), TypeError, "int"),
    (
        "prefill-past-table",
        "prefill",
        lambda q, k, *_: (q, k, 61),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "prefill-far-past-table",
        "prefill",
        lambda q, k, *_: (q, k, 10**6),
        ValueError,
        r"position 1000003\b.*64",
    ),
    (
        "decode-at-limit",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], 64),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "decode-np-int-past",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.int32(99)),
        ValueError,
        r"position 99\b.*64",
    ),
    ("decode-negative", "decode", lambda q, k, *_: (q[:, :1], k[:, :1], -1), ValueError, ">= 0"),
    (
        "decode-per-seq-past",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([3, 64])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "decode-per-seq-negative",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([3, -2])),
        ValueError,
        ">= 0",
    ),
    (
        "decode-per-seq-shape",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([1, 2, 3])),
        ValueError,
        "broadcast",
    ),
    (
        "decode-float-positions",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([1.0, 2.0])),
        TypeError,
        "integers",
    ),
    ("decode-str", "decode", lambda q, k, *_: (q[:, :1], k[:, :1], "3"), TypeError, "integers"),
    ("decode-T2", "decode", lambda q, k, *_: (q[:, :2], k[:, :2], 0), ValueError, "T == 1"),
    (
        "rotate-shape",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 5), np.int64)),
        ValueError,
        "broadcast",
    ),
    (
        "rotate-3d",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 2, 4), np.int64)),
        ValueError,
        "broadcast",
    ),
    (
        "rotate-float",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 4), np.float32)),
        TypeError,
        "integers",
    ),
    ("rotate-bool", "rotate", lambda q, k, *_: (q, k, np.zeros((2, 4), bool)), TypeError, "int"),
    (
        "rotate-past-table",
        "rotate",
        lambda q, k, *_: (q, k, np.array([[0, 1, 2, 3], [5, 6, 64, 7]])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "rotate-negative",
        "rotate",
        lambda q, k, *_: (q, k, np.array([0, -1, 2, 3])),
        ValueError,
        ">= 0",
    ),
    ("rotate-empty", "rotate", lambda q, k, *_: (q, k, np.zeros((0,), np.int64)), ValueError, "."),
    (
        "backward-dtype",
        "backward",
        lambda q, k, dq, dk: (dq.astype(np.float64), dk),
        TypeError,
        "dtype",
    ),
    ("backward-width", "backward", lambda q, k, dq, dk: (dk, dk), ValueError, r"\[B, T, 24\]"),
    ("backward-list", "backward", lambda q, k, dq, dk: (dq, dk.tolist()), TypeError, "array"),
    (
        "backward-B-beyond",
        "backward",
        lambda *_: (np.ones((3, 4, Q_W), F32), np.ones((3, 4, K_W), F32)),
        ValueError,
        "build shape",
    ),
    (
        "backward-past-table",
        "backward",
        lambda q, k, dq, dk: (dq, dk, np.array([1, 2, 3, 64])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "backward-positions-shape",
        "backward",
        lambda q, k, dq, dk: (dq, dk, np.arange(3)),
        ValueError,
        "broadcast",
    ),
    (
        "backward-float-positions",
        "backward",
        lambda q, k, dq, dk: (dq, dk, np.arange(4.0)),
        TypeError,
        "integers",
    ),
]


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize(
    ("method", "make_args", "error", "pattern"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_calls_raise_and_change_nothing(
    backend: str,
    method: str,
    make_args: Callable[..., tuple],
    error: type[Exception],
    pattern: str,
    precision: Precision,
    rng,
) -> None:
    cfg = RopeConfig(**_BAD_CFG)
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, 2, 4, precision)
    dq, dk = random_qk(rng, cfg, 2, 4, precision)
    rope.backward(dq, dk)  # the gradient buffers hold something to compare
    args = make_args(q, k, dq, dk)
    if precision is not FP32:
        args = tuple(
            a.astype(dtype_of(precision))
            if isinstance(a, np.ndarray) and a.dtype == np.float32
            else a
            for a in args
        )
    watched = [q, k, dq, dk, *rope.input_gradients, *rope.table.arrays()]
    watched += [a for a in args if isinstance(a, np.ndarray)]
    before = [(a, a.copy()) for a in watched]
    state = dict(rope.__dict__), dict(rope.op.__dict__)
    with pytest.raises(error, match=pattern):
        getattr(rope, method)(*args)
    for array, saved in before:
        _assert_bit_identical(array, saved)
    assert dict(rope.__dict__) == state[0] and dict(rope.op.__dict__) == state[1]
    # and the component still works
    q0, k0 = q.copy(), k.copy()
    rope.prefill(q, k, 60)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 4, 60))
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)


def test_wrong_precision_arrays_raise_type_error(rng) -> None:
    cfg = RopeConfig(**_BAD_CFG)
    for precision in PRECISIONS:
        rope = make_rope(cfg, 2, 4, precision=precision)
        for other in PRECISIONS:
            if other is precision:
                continue
            q, k = random_qk(rng, cfg, 2, 4, other)
            q0, k0 = q.copy(), k.copy()
            with pytest.raises(TypeError, match=str(precision)):
                rope.forward(q, k)
            _assert_bit_identical(q, q0)
            _assert_bit_identical(k, k0)


@pytest.mark.parametrize(
    "call",
    [
        lambda r, q, k: r.forward(q, k),
        lambda r, q, k: r.prefill(q, k, 0),
        lambda r, q, k: r.decode(q[:, :1], k[:, :1], 0),
        lambda r, q, k: r.rotate(q, k, np.arange(4)),
        lambda r, q, k: r.backward(q, k),
        lambda r, q, k: r.table,
        lambda r, q, k: r.attention_scaling,
    ],
    ids=["forward", "prefill", "decode", "rotate", "backward", "table", "attention_scaling"],
)
@pytest.mark.parametrize("standalone", [True, False], ids=["standalone", "no-context"])
def test_calls_before_build_raise_runtime_error(standalone: bool, call, rng) -> None:
    cfg = RopeConfig(**_BAD_CFG)
    rope = Rope("r", cfg, device="CPU") if standalone else Rope("r", cfg)
    q, k = random_qk(rng, cfg, 2, 4)
    q0 = q.copy()
    with pytest.raises(RuntimeError, match="build"):
        call(rope, q, k)
    _assert_bit_identical(q, q0)


def test_build_shape_must_be_q_shape() -> None:
    cfg = RopeConfig(**_BAD_CFG)
    rope = Rope("r", cfg, device="CPU")
    with pytest.raises(ValueError, match="build shape"):
        rope.build(BuildContext((2, 4, K_W), TRAINING))
    with pytest.raises(ValueError, match="build shape"):
        rope.build(BuildContext((2, 4, 2, Q_W), TRAINING))
    assert not rope.is_built and rope.get_gradients() == []
    rope.build(BuildContext((2, 4, Q_W), TRAINING))  # a failed build can be retried
    assert rope.is_built
    with pytest.raises(RuntimeError):
        rope.build(BuildContext((2, 4, Q_W), TRAINING))


def test_constructor_checks() -> None:
    with pytest.raises(TypeError, match="RopeConfig"):
        Rope("r", {"channels": 8}, device="CPU")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Rope("0bad", RopeConfig(**_BAD_CFG), device="CPU")


# ---------------------------------------------------------------------------------- RopeConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(channels=30, n_heads=4), ValueError, "divisible"),
        (dict(channels=12, n_heads=4, n_kv_heads=1), ValueError, "even"),
        (dict(n_kv_heads=5), ValueError, "n_kv_heads"),
        (dict(channels=0), ValueError, "channels"),
        (dict(n_heads=0), ValueError, "n_heads"),
        (dict(n_kv_heads=0), ValueError, "n_kv_heads"),
        (dict(n_heads=-4), ValueError, "n_heads"),
        (dict(max_seq_len=0), ValueError, "max_seq_len"),
        (dict(max_seq_len=-1), ValueError, "max_seq_len"),
        (dict(base=0.0), ValueError, "base"),
        (dict(base=-10000.0), ValueError, "base"),
        (dict(base=1.0), ValueError, "base"),
        (dict(base=float("nan")), ValueError, "base"),
        (dict(base=float("inf")), ValueError, "base"),
        (dict(base="10000"), ValueError, "base"),
        (dict(rotary_dim=-2), ValueError, "rotary_dim"),
        (dict(rotary_dim=3), ValueError, "rotary_dim"),
        (dict(rotary_dim=18), ValueError, "rotary_dim"),
        (dict(layout="neox"), ValueError, "layout"),
        (dict(channels=64.0), TypeError, "channels"),
        (dict(n_heads=True), TypeError, "n_heads"),
        (dict(max_seq_len=None), TypeError, "max_seq_len"),
        (dict(scaling="linear"), TypeError, "scaling"),
        (dict(scaling=[("rope_type", "linear")]), TypeError, "scaling"),
    ],
)
def test_rope_config_validation(kwargs: dict[str, Any], error, pattern: str) -> None:
    base = dict(channels=64, n_heads=4, n_kv_heads=2, max_seq_len=128)
    with pytest.raises(error, match=pattern):
        RopeConfig(**{**base, **kwargs})


def test_rope_config_accepts_edges_and_is_frozen() -> None:
    cfg = RopeConfig(channels=64, n_heads=4, n_kv_heads=4, max_seq_len=1, rotary_dim=16)
    assert cfg.head_dim == 16 and cfg.rotated_dim == 16 and cfg.kv_channels == 64
    cfg = RopeConfig(channels=64, n_heads=4, n_kv_heads=1, max_seq_len=8, rotary_dim=2)
    assert cfg.rotated_dim == 2
    assert RopeConfig(channels=8, n_heads=1, n_kv_heads=1, max_seq_len=8).head_dim == 8
    assert RopeConfig(64, 4, 1, 8, layout="interleaved").layout.value == "interleaved"
    with pytest.raises(AttributeError):
        cfg.base = 2.0  # type: ignore[misc]
    scaled = RopeConfig(64, 4, 1, 8, scaling={"rope_type": "linear", "factor": 2})
    assert scaled == RopeConfig(64, 4, 1, 8, scaling={"factor": 2, "rope_type": "linear"})
    assert hash(scaled) == hash(
        RopeConfig(64, 4, 1, 8, scaling={"rope_type": "linear", "factor": 2})
    )


# ---------------------------------------------------------------------------------- sharing


def test_get_rope_shares_one_table_per_table_configuration() -> None:
    cfg = rope_config((4, 1), max_seq_len=512)
    table = get_rope(cfg, "CPU")
    assert get_rope(rope_config((4, 1), max_seq_len=512), "cpu") is table
    # head counts and layout do not change the table
    assert get_rope(rope_config((8, 8), max_seq_len=512, layout="interleaved")) is table
    assert get_rope(rope_config((1, 1), max_seq_len=512)) is table
    for other in (
        rope_config((4, 1), max_seq_len=256),
        rope_config((4, 1), max_seq_len=512, base=500000.0),
        rope_config((4, 1), max_seq_len=512, rotary_dim=8),
        rope_config((4, 1), max_seq_len=512, head_dim=16),
        rope_config((4, 1), max_seq_len=512, scaling={"rope_type": "linear", "factor": 2.0}),
    ):
        assert get_rope(other) is not table
    # spellings of one table share it: the default type named, the type or the theta repeated
    for scaling in (
        {"rope_type": "default"},
        {"type": "default", "rope_theta": cfg.base},
        {"rope_type": "default", "partial_rotary_factor": 1.0},
    ):
        assert get_rope(rope_config((4, 1), max_seq_len=512, scaling=scaling)) is table
    linear = get_rope(rope_config((4, 1), max_seq_len=512, scaling={"type": "linear", "factor": 2}))
    assert linear is not table and linear is get_rope(
        rope_config((4, 1), max_seq_len=512, scaling={"factor": 2, "rope_type": "linear"})
    )
    assert linear is not get_rope(
        rope_config((4, 1), max_seq_len=512, scaling={"rope_type": "linear", "factor": 3})
    )
    assert table.cos.dtype == np.float32 and table.sin.dtype == np.float32
    assert table.cos.shape == (512, HEAD_DIM // 2)
    with pytest.raises(TypeError):
        get_rope({"channels": 12})  # type: ignore[arg-type]


def test_ropes_share_the_table_and_a_network_counts_it_once() -> None:
    cfg = rope_config((4, 1), max_seq_len=256)
    other_heads = rope_config((4, 4), max_seq_len=256, layout="interleaved")
    net = Network("n", device="CPU")
    net.add_component(Rope("a", cfg)).add_component(Rope("b", cfg))
    net.add_component(Rope("c", other_heads))
    net.build(BuildContext((2, 3, cfg.channels), TRAINING))
    a, b, c = (net.get_component(name) for name in "abc")
    assert a.table is b.table is c.table
    table_bytes = a.table.nbytes
    assert table_bytes == 2 * 256 * (HEAD_DIM // 2) * 4
    stats = net.get_memory_stats()
    assert stats.state_bytes == table_bytes
    grads = 2 * (2 * 3 * (cfg.channels + cfg.kv_channels) * 4)
    grads += 2 * 3 * (other_heads.channels + other_heads.kv_channels) * 4
    assert stats.gradient_bytes == grads
    assert a.get_memory_stats().state_bytes == table_bytes  # each alone still reports it
    assert net.get_gradients() == []  # Rope has no parameters
    assert sum(len(r.input_gradients) for r in (a, b, c)) == 6


def test_network_of_ropes_inference_has_no_gradients() -> None:
    cfg = rope_config((4, 1), max_seq_len=128)
    net = Network("n", device="CPU", precision=Precision.BF16)
    net.add_component(Rope("a", cfg, precision=Precision.BF16))
    net.add_component(Rope("b", cfg, precision=Precision.BF16))
    net.build(BuildContext((1, 2, cfg.channels), INFERENCE))
    stats = net.get_memory_stats()
    assert stats.gradient_bytes == 0
    assert stats.state_bytes == 2 * 128 * (HEAD_DIM // 2) * 4
    assert net.get_gradients() == []


# ---------------------------------------------------------------------------------- properties

_PROPERTY_CFG = st.tuples(
    st.sampled_from(["half", "interleaved"]),
    st.sampled_from([0, 2, 4]),  # rotary_dim of head_dim 8
    st.sampled_from(
        [
            None,
            {"rope_type": "linear", "factor": 4.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ]
    ),
)


def _property_rope(layout: str, rotary_dim: int, scaling: Any, backend: str) -> Rope:
    cfg = RopeConfig(
        channels=16,
        n_heads=2,
        n_kv_heads=1,
        max_seq_len=4096,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=scaling,
    )
    return make_rope(cfg, 2, 3, backend=backend)


_ROPES: dict[tuple[str, int, str, str], Rope] = {}


def _cached_rope(layout: str, rotary_dim: int, scaling: Any, backend: str) -> Rope:
    key = (layout, rotary_dim, repr(scaling), backend)
    if key not in _ROPES:
        _ROPES[key] = _property_rope(layout, rotary_dim, scaling, backend)
    return _ROPES[key]


def _pairs(x: np.ndarray, n_heads: int, n_freq: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    heads = f64(x).reshape(x.shape[0], x.shape[1], n_heads, -1)
    if layout == "half":
        return heads[..., :n_freq], heads[..., n_freq : 2 * n_freq]
    return heads[..., 0 : 2 * n_freq : 2], heads[..., 1 : 2 * n_freq : 2]


_vectors = st.integers(min_value=0, max_value=2**32 - 1)
_backends = st.sampled_from(["numpy", "fused"] if _rope_fused.AVAILABLE else ["numpy"])


@settings(max_examples=30, deadline=None)
@given(
    cfg=_PROPERTY_CFG,
    seed=_vectors,
    positions=st.lists(st.integers(0, 4095), min_size=6, max_size=6),
    backend=_backends,
)
def test_property_norm_of_every_pair_is_preserved(cfg, seed, positions, backend) -> None:
    layout, rotary_dim, scaling = cfg
    rope = _cached_rope(layout, rotary_dim, scaling, backend)
    rng = np.random.default_rng(seed)
    q, k = random_qk(rng, rope.config, 2, 3)
    q0, k0 = q.copy(), k.copy()
    rope.rotate(q, k, np.array(positions).reshape(2, 3))
    n_freq = (rotary_dim or 8) // 2
    attention = rope.attention_scaling
    for x, x0, heads in ((q, q0, 2), (k, k0, 1)):
        a, b = _pairs(x, heads, n_freq, layout)
        a0, b0 = _pairs(x0, heads, n_freq, layout)
        np.testing.assert_allclose(
            np.hypot(a, b), attention * np.hypot(a0, b0), rtol=2e-6, atol=2e-6
        )
        rest = f64(x).reshape(2, 3, heads, 8)[..., 2 * n_freq :]
        np.testing.assert_array_equal(rest, f64(x0).reshape(2, 3, heads, 8)[..., 2 * n_freq :])


@settings(max_examples=30, deadline=None)
@given(
    cfg=_PROPERTY_CFG,
    seed=_vectors,
    m=st.integers(0, 2047),
    n=st.integers(0, 2047),
    shift=st.integers(0, 2048),
    backend=_backends,
)
def test_property_scores_depend_only_on_relative_position(cfg, seed, m, n, shift, backend) -> None:
    """<R_m q, R_n k> per head equals <R_{m+s} q, R_{n+s} k>."""
    layout, rotary_dim, scaling = cfg
    rope = _cached_rope(layout, rotary_dim, scaling, backend)
    rng = np.random.default_rng(seed)
    q, k = random_qk(rng, rope.config, 1, 1)

    def scores(pos_q: int, pos_k: int) -> np.ndarray:
        x = np.concatenate([q, q], axis=1)  # token 0 rotated at pos_q ...
        y = np.concatenate([k, k], axis=1)  # ... token 1 at pos_k
        rope.rotate(x, y, np.array([[pos_q, pos_k]]))
        qh = f64(x[0, 0]).reshape(2, 8)
        kh = f64(y[0, 1]).reshape(1, 8)
        return qh @ kh[0]

    base = scores(m, n)
    shifted = scores(m + shift, n + shift)
    np.testing.assert_allclose(shifted, base, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_forked_child_rotates_large_calls(backend: str) -> None:
    """The op's thread pool does not survive fork; the child must start its own, not hang."""
    code = f"""
import os, signal, numpy as np
from mila_py import BuildContext, RuntimeMode
from mila_py.components import Rope, RopeConfig
rope = Rope("r", RopeConfig(4096, 32, 8, 2048), device="CPU")
rope.build(BuildContext((1, 1024, 4096), RuntimeMode.INFERENCE))
rope.op.backend = {backend!r}
q, k = np.ones((1, 1024, 4096), np.float32), np.ones((1, 1024, 1024), np.float32)
rope.forward(q, k)  # large enough for the pool: the parent starts it
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a hang ends the child with SIGALRM
    rope.forward(q, k)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "0", result.stderr


def test_a_rope_op_that_is_not_a_positional_paired_op_is_refused(monkeypatch) -> None:
    """The registry's RopeOp must have prefill and decode (checked once, at op creation)."""
    import mila_py.components.rope as rope_module
    from mila_py.ops.operation import Operation, PositionalPairedOp

    assert isinstance(Rope("real", rope_config(), device="CPU").op, PositionalPairedOp)

    class Unpaired(Operation):
        def apply(self, *args: object, **kwargs: object) -> None: ...

    monkeypatch.setattr(rope_module, "create_op", lambda _name, *args: Unpaired(*args))
    with pytest.raises(TypeError, match="PositionalPairedOp"):
        Rope("rope", rope_config(), device="CPU")
    inner = Rope("inner", rope_config())
    with pytest.raises(TypeError, match="PositionalPairedOp"):
        Network("net").add_component(inner)
    assert not inner.has_execution_context  # the failed hook left no context
