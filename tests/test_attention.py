"""Causal GQA attention: the op against a naive float64 loop and finite differences."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from cuda_arrays import (
    EMULATED,
    PRECISIONS_16,
    REDUCED_PARAMS,
    agree,
    close,
    cupy,
    dev,
    host,
    skip_bf16_without_arrays,
)
from layer_helpers import check_16_bit_twin, f32

from mila_py import Precision
from mila_py.devices import create_execution_context
from mila_py.devices.graph import replayable
from mila_py.ops.cpu import _fused_attention, _fused_layers
from mila_py.ops.cpu import attention as attention_mod
from mila_py.ops.cpu.attention import (
    CpuAttentionOp,
    attention_backward,
    attention_forward,
    attention_prefill,
)
from mila_py.ops.cuda import attention as cuda_attention
from mila_py.ops.operation import DecodePositions
from mila_py.ops.registry import create_op

needs_numba = pytest.mark.skipif(
    not _fused_layers.enabled(np.float32),
    reason="Numba is not installed or MILA_PY_CPU_BACKEND=numpy",
)
KERNELS = ["numpy", pytest.param("fused", marks=needs_numba)]
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")


def forward_hooks(kernels: str) -> dict:  # type: ignore[type-arg]
    return {"softmax": _fused_attention.causal_softmax} if kernels == "fused" else {}


def backward_hooks(kernels: str) -> dict:  # type: ignore[type-arg]
    return (
        {"softmax_backward": _fused_attention.softmax_backward_rows} if kernels == "fused" else {}
    )


def naive_attention(q, k, v, hq, hk, scale, q_offset=0):  # type: ignore[no-untyped-def]
    """Token-by-token, head-by-head reference written without matmuls or masks."""
    n_b, n_tq = q.shape[0], q.shape[1]
    n_tk = k.shape[1]
    d = q.shape[2] // hq
    out = np.zeros((n_b, n_tq, hq * d))
    for b in range(n_b):
        for h in range(hq):
            kv = h // (hq // hk)
            for t in range(n_tq):
                qv = q[b, t, h * d : (h + 1) * d]
                visible = range(min(n_tk, q_offset + t + 1))
                logits = [scale * float(qv @ k[b, s, kv * d : (kv + 1) * d]) for s in visible]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for s, w in zip(visible, weights, strict=True):
                    out[b, t, h * d : (h + 1) * d] += w / total * v[b, s, kv * d : (kv + 1) * d]
    return out


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (4, 2), (6, 1), (3, 3)])
def test_forward_matches_naive_loop(hq: int, hk: int, kernels: str) -> None:
    rng = np.random.default_rng(hq * 10 + hk)
    n_b, n_t, d = 2, 5, 4
    q = rng.standard_normal((n_b, n_t, hq * d))
    k = rng.standard_normal((n_b, n_t, hk * d))
    v = rng.standard_normal((n_b, n_t, hk * d))
    out = np.empty_like(q)
    probs = attention_forward(q, k, v, hq, hk, 0.37, out, **forward_hooks(kernels))
    np.testing.assert_allclose(out, naive_attention(q, k, v, hq, hk, 0.37), rtol=1e-12, atol=1e-12)
    assert probs.shape == (n_b, hk, hq // hk, n_t, n_t)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-12)
    assert (probs[..., np.triu_indices(n_t, 1)[0], np.triu_indices(n_t, 1)[1]] == 0).all()


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_key_reaches_only_the_queries_that_see_it(kernels: str, bad: float) -> None:
    """Masked scores are set, not added to: NaN + -inf would be NaN and poison the row max of
    queries that never see the key (both paths agree, as torch's flash kernel does)."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 4, 8))  # 2 query heads of 4 over 1 key/value head
    k, v = rng.standard_normal((1, 4, 4)), rng.standard_normal((1, 4, 4))
    k[0, 3] = bad  # key 3: only query 3 sees it
    out = np.empty_like(q)
    with np.errstate(invalid="ignore"):  # inf * 0 in the scores of the query that sees it
        attention_forward(q, k, v, 2, 1, 0.5, out, **forward_hooks(kernels))
    clean = k.copy()
    clean[0, 3] = 0.0
    want = naive_attention(q[:, :3], clean, v, 2, 1, 0.5)
    np.testing.assert_allclose(out[:, :3], want, rtol=1e-12, atol=1e-12)
    ragged = np.empty_like(q[:, :1])  # ragged decode: a sequence that sees keys 0..2 only
    with np.errstate(invalid="ignore"):
        attention_forward(q[:, 2:3], k, v, 2, 1, 0.5, ragged, causal=False, visible=np.array([3]))
    np.testing.assert_allclose(ragged, want[:, 2:3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_value_reaches_only_the_sequences_that_see_it(bad: float) -> None:
    """Ragged decode on the NumPy path: a NaN or inf in a V row a sequence cannot see (a cache
    row past its position) stays out of its output (0 * NaN is NaN in a product over all
    rows)."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 1, 8))
    k, v = rng.standard_normal((2, 4, 4)), rng.standard_normal((2, 4, 4))
    v[0, 3] = bad  # sequence 0 sees keys 0..1 only; sequence 1 sees them all
    out = np.empty_like(q)
    attention_forward(q, k, v, 2, 1, 0.5, out, causal=False, visible=np.array([2, 4]))
    want = naive_attention(q[:1], k[:1, :2], v[:1, :2], 2, 1, 0.5, q_offset=1)
    np.testing.assert_allclose(out[:1], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(
        out[1:], naive_attention(q[1:], k[1:], v[1:], 2, 1, 0.5, q_offset=3), rtol=1e-12
    )


@pytest.mark.parametrize("kernels", KERNELS)
def test_query_offset_sees_the_cache(kernels: str) -> None:
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 8))
    k = rng.standard_normal((1, 6, 8))
    v = rng.standard_normal((1, 6, 8))
    out = np.empty_like(q)
    attention_forward(q, k, v, 2, 2, 0.5, out, q_offset=3, **forward_hooks(kernels))
    np.testing.assert_allclose(out, naive_attention(q, k, v, 2, 2, 0.5, q_offset=3), atol=1e-12)
    # not causal: every query sees every key (decode, one token per sequence at the end)
    attention_forward(q[:, :1], k, v, 2, 2, 0.5, out[:, :1], causal=False, **forward_hooks(kernels))
    np.testing.assert_allclose(
        out[:, :1], naive_attention(q[:, :1], k, v, 2, 2, 0.5, q_offset=5), atol=1e-12
    )


@needs_numba
@pytest.mark.parametrize("q_offset", [0, 37])
def test_fused_float32_attention_equals_the_numpy_passes(q_offset: int) -> None:
    rng = np.random.default_rng(11)
    n_b, n_t, hq, hk, d = 2, 70, 6, 2, 16
    q = (rng.standard_normal((n_b, n_t, hq * d)) * 3).astype(np.float32)
    k = (rng.standard_normal((n_b, q_offset + n_t, hk * d)) * 3).astype(np.float32)
    v = rng.standard_normal((n_b, q_offset + n_t, hk * d)).astype(np.float32)
    outs, probs = [np.empty_like(q), np.empty_like(q)], []
    for out, hooks in zip(outs, (forward_hooks("numpy"), forward_hooks("fused")), strict=True):
        probs.append(attention_forward(q, k, v, hq, hk, 0.25, out, q_offset=q_offset, **hooks))
    np.testing.assert_allclose(probs[1], probs[0], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(outs[1], outs[0], rtol=2e-5, atol=2e-6)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    if q_offset == 0:  # training: backward of both
        grads = [[np.empty_like(q), np.empty_like(k), np.empty_like(v)] for _ in range(2)]
        for g, hooks in zip(grads, (backward_hooks("numpy"), backward_hooks("fused")), strict=True):
            attention_backward(dout, q, k, v, probs[0], hq, hk, 0.25, *g, out=outs[0], **hooks)
        for a, b in zip(*grads, strict=True):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)


@needs_numba
def test_the_cpu_op_uses_the_fused_kernels_unless_told_not_to(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import mila_py.ops.cpu.attention as cpu_attention

    seen = []
    monkeypatch.setattr(
        cpu_attention, "attention_forward", lambda *a, **kw: seen.append(kw.get("softmax"))
    )
    real_decode = _fused_attention.decode_attention
    monkeypatch.setattr(
        _fused_attention,
        "decode_attention",
        lambda *a, **kw: seen.append("decode") or real_decode(*a, **kw),
    )
    op = CpuAttentionOp(None, None, None)  # type: ignore[arg-type]
    rng = np.random.default_rng(12)
    kv = rng.standard_normal((1, 3, 8)).astype(np.float32)
    for n_t in (2, 1):
        q = rng.standard_normal((1, n_t, 8)).astype(np.float32)
        op.forward(q, kv, kv, 2, 2, 0.5, out=np.empty_like(q), q_offset=3 - n_t)
    # the variable is read when an op is created: the op above keeps fusing, a new one does not
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", "numpy")
    op.forward(q, kv, kv, 2, 2, 0.5, out=np.empty_like(q), q_offset=2)
    CpuAttentionOp(None, None, None).forward(  # type: ignore[arg-type]
        q, kv, kv, 2, 2, 0.5, out=np.empty_like(q), q_offset=2
    )
    assert seen == [_fused_attention.causal_softmax, "decode", "decode", None]


@needs_numba
@pytest.mark.parametrize("q_offset", [4, 9])
def test_fused_decode_attention_equals_the_naive_loop(q_offset: int) -> None:
    """One query per sequence against a cache view (the rows a decode step reads)."""
    rng = np.random.default_rng(13)
    hq, hk, d, cache = 6, 2, 8, 16
    k_cache = rng.standard_normal((3, cache, hk * d))
    v_cache = rng.standard_normal((3, cache, hk * d))
    qkv = rng.standard_normal((3, 1, (hq + 2 * hk) * d))
    q = qkv[..., : hq * d]  # a view into a fused projection
    k, v = k_cache[:, : q_offset + 1], v_cache[:, : q_offset + 1]
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-6)):
        out = np.full((3, 1, hq * d), np.nan, dtype)
        args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), hq, hk, 0.3)
        probs = CpuAttentionOp(None, None, None).forward(*args, out=out, q_offset=q_offset)  # type: ignore[arg-type]
        ref = naive_attention(q, k, v, hq, hk, 0.3, q_offset=q_offset)
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        assert probs.shape == (3, hk, hq // hk, 1, q_offset + 1)
        np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=tol)
    # fewer visible keys than the view holds: the rest get probability 0
    visible = np.array([1, 3, 5])
    out = np.empty((3, 1, hq * d))
    probs = _fused_attention.decode_attention(q, k_cache, v_cache, visible, hq, hk, 0.3, out)
    for b, n in enumerate(visible):
        ref = naive_attention(
            q[b : b + 1],
            k_cache[b : b + 1, :n],
            v_cache[b : b + 1, :n],
            hq,
            hk,
            0.3,
            q_offset=n - 1,
        )
        np.testing.assert_allclose(out[b : b + 1], ref, rtol=1e-12, atol=1e-12)
        assert (probs[b, ..., n:] == 0).all()


@needs_numba
def test_decode_kernels_are_kept_per_array_type() -> None:
    """The kernel cache keys on what Numba's array types are made of: another layout, dtype
    or a read-only array gets its own compilation, the same types the same function."""
    q, out = np.zeros(8, np.float32), np.zeros(8, np.float32)
    k = np.zeros((5, 4), np.float32)
    probs = np.zeros((2, 5), np.float32)
    first = _fused_attention.decode_kernel(q, k, k, 2, 1, out, probs)
    assert _fused_attention.decode_kernel(q.copy(), k.copy(), k, 2, 1, out, probs) is first
    fortran = np.asfortranarray(k)
    assert _fused_attention.decode_kernel(q, fortran, k, 2, 1, out, probs) is not first
    frozen = k.copy()
    frozen.flags.writeable = False
    assert _fused_attention.decode_kernel(q, frozen, k, 2, 1, out, probs) is not first
    wide = [a.astype(np.float64) for a in (q, k, out, probs)]
    assert _fused_attention.decode_kernel(*wide[:2], wide[1], 2, 1, *wide[2:]) is not first


@needs_numba
def test_the_decode_kernel_takes_numpy_integer_head_counts() -> None:
    """Head counts that are NumPy integers (the op is public API) reach the kernel, whose head
    size and group are compile-time literals, as Python ints."""
    rng = np.random.default_rng(18)
    q = rng.standard_normal((2, 1, 4 * 8)).astype(np.float32)
    k = rng.standard_normal((2, 6, 2 * 8)).astype(np.float32)
    ref = naive_attention(q, k, k, 4, 2, 0.3, q_offset=5)
    op = CpuAttentionOp(None, None, None)  # type: ignore[arg-type]
    for hq, hk in ((np.int64(4), np.int64(2)), (np.int32(4), np.int32(2))):
        out = np.full_like(q, np.nan)
        op.forward(q, k, k, hq, hk, 0.3, out, q_offset=5)
        np.testing.assert_allclose(out, ref, rtol=3e-6, atol=3e-6)
        out = np.full_like(q, np.nan)
        _fused_attention.decode_attention(q, k, k, [6, 6], hq, hk, 0.3, out)
        np.testing.assert_allclose(out, ref, rtol=3e-6, atol=3e-6)
        positions = DecodePositions(2)
        out = np.full_like(q, np.nan)
        step = op.bind_decode(q, k, k, hq, hk, 0.3, out, positions)
        positions.set(5, 5, 5)
        step()
        np.testing.assert_allclose(out, ref, rtol=3e-6, atol=3e-6)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(
    ("n_tq", "q_offset", "block"), [(10, 0, 4), (10, 5, 3), (7, 2, 7), (5, 0, 8)]
)
def test_blocked_prefill_equals_the_naive_loop_and_reads_no_key_past_the_chunk(
    kernels: str, n_tq: int, q_offset: int, block: int
) -> None:
    """Query blocks each see the keys up to their last query: the same output as one call,
    and the cache rows past the chunk (NaN here, never written yet) are never read."""
    rng = np.random.default_rng(16)
    hq, hk, d = 4, 2, 8
    end = q_offset + n_tq
    q = rng.standard_normal((2, n_tq, hq * d))
    k = np.full((2, end + 3, hk * d), np.nan)
    v = np.full((2, end + 3, hk * d), np.nan)
    k[:, :end] = rng.standard_normal((2, end, hk * d))
    v[:, :end] = rng.standard_normal((2, end, hk * d))
    out = np.full_like(q, np.nan)
    attention_prefill(q, k, v, hq, hk, 0.3, out, q_offset, block=block, **forward_hooks(kernels))
    ref = naive_attention(q, k[:, :end], v[:, :end], hq, hk, 0.3, q_offset=q_offset)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_op_prefills_long_chunks_in_blocks(
    kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CpuAttentionOp.prefill: a chunk longer than PREFILL_BLOCK goes in blocks, a shorter one
    is one forward call; both equal the reference (float32 and float64)."""
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", "numpy" if kernels == "numpy" else "auto")
    rng = np.random.default_rng(17)
    hq, hk, d = 4, 2, 8
    op = CpuAttentionOp(None, None, None)  # type: ignore[arg-type]
    calls: list[int] = []
    real = attention_mod.attention_forward
    monkeypatch.setattr(
        attention_mod,
        "attention_forward",
        lambda q, *a, **kw: calls.append(q.shape[1]) or real(q, *a, **kw),
    )
    block = attention_mod.PREFILL_BLOCK
    for n_tq, blocks in ((block + 5, [block, 5]), (block, [block])):
        for dtype, tol in ((np.float64, 1e-12), (np.float32, 3e-5)):
            calls.clear()
            q = rng.standard_normal((1, n_tq, hq * d))
            k = rng.standard_normal((1, 3 + n_tq, hk * d))
            v = rng.standard_normal((1, 3 + n_tq, hk * d))
            out = np.empty((1, n_tq, hq * d), dtype)
            op.prefill(q.astype(dtype), k.astype(dtype), v.astype(dtype), hq, hk, 0.3, out, 3)
            np.testing.assert_allclose(
                out, naive_attention(q, k, v, hq, hk, 0.3, 3), rtol=tol, atol=tol
            )
            assert calls == blocks


@needs_numba
@pytest.mark.parametrize(
    ("hq", "hk", "d"), [(6, 2, 64), (4, 4, 24), (8, 1, 80), (2, 1, 128), (3, 3, 1)]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_decode_kernel_for_each_head_geometry_equals_the_naive_loop(
    hq: int, hk: int, d: int, dtype: type
) -> None:
    """The kernel is compiled per head size and group (compile-time constants): every visible
    length (its four-row blocks and the rows left over) and a bound plan step, against the
    float64 reference; the probabilities past the visible keys are 0."""
    rng = np.random.default_rng(15)
    cache = 11
    k_cache = rng.standard_normal((2, cache, hk * d)).astype(dtype)
    v_cache = rng.standard_normal((2, cache, hk * d)).astype(dtype)
    q = rng.standard_normal((2, 1, hq * d)).astype(dtype)
    tol = 1e-12 if dtype is np.float64 else 3e-6

    def reference_row(b: int, seen: int) -> np.ndarray:
        """Sequence ``b``'s output over its first ``seen`` keys, in float64."""
        rows = (q[b : b + 1], k_cache[b : b + 1, :seen], v_cache[b : b + 1, :seen])
        wide = [a.astype(np.float64) for a in rows]
        return naive_attention(*wide, hq, hk, 0.3, q_offset=seen - 1)

    for n in range(1, cache + 1):
        out = np.full((2, 1, hq * d), np.nan, dtype)
        visible = [n, max(1, n - 5)]
        probs = _fused_attention.decode_attention(q, k_cache, v_cache, visible, hq, hk, 0.3, out)
        for b, seen in enumerate(visible):
            ref = reference_row(b, seen)
            np.testing.assert_allclose(out[b : b + 1], ref, rtol=tol, atol=tol)
            assert (probs[b, ..., seen:] == 0).all()
    positions = DecodePositions(2)
    out = np.full((2, 1, hq * d), np.nan, dtype)
    op = CpuAttentionOp(None, None, None)  # type: ignore[arg-type]
    step = op.bind_decode(q, k_cache, v_cache, hq, hk, 0.3, out, positions)
    positions.set(np.array([6, 2]), 2, 6)
    step()
    for b, seen in enumerate((7, 3)):
        np.testing.assert_allclose(out[b : b + 1], reference_row(b, seen), rtol=tol, atol=tol)


@pytest.mark.parametrize("kernels", KERNELS)
def test_visible_keys_per_sequence_equal_the_naive_loop(kernels: str) -> None:
    """Ragged decode: sequence b sees its first visible[b] keys (a -inf bias on the rest)."""
    rng = np.random.default_rng(14)
    hq, hk, d = 4, 2, 8
    k = rng.standard_normal((3, 9, hk * d))
    v = rng.standard_normal((3, 9, hk * d))
    q = rng.standard_normal((3, 1, hq * d))
    visible = np.array([9, 2, 5])
    out = np.full_like(q, np.nan)
    if kernels == "fused":
        probs = CpuAttentionOp(None, None, None).forward(  # type: ignore[arg-type]
            q, k, v, hq, hk, 0.4, out=out, causal=False, visible=visible
        )
    else:
        probs = attention_forward(q, k, v, hq, hk, 0.4, out, causal=False, visible=visible)
    for b, n in enumerate(visible):
        ref = naive_attention(q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], hq, hk, 0.4, n - 1)
        np.testing.assert_allclose(out[b : b + 1], ref, rtol=1e-12, atol=1e-12)
        assert (probs[b, ..., n:] == 0).all()


@needs_numba
def test_decode_over_key_rows_that_are_not_dense_takes_the_general_path() -> None:
    rng = np.random.default_rng(16)
    hq, hk, d = 4, 2, 8
    kv = rng.standard_normal((2, 7, 3 * hk * d))  # keys and values side by side, plus padding
    k, v = kv[..., : hk * d], kv[..., hk * d : 2 * hk * d]  # rows with a gap between them
    q = rng.standard_normal((2, 1, hq * d))
    out = np.full_like(q, np.nan)
    CpuAttentionOp(None, None, None).forward(q, k, v, hq, hk, 0.4, out=out, causal=False)  # type: ignore[arg-type]
    np.testing.assert_allclose(
        out, naive_attention(q, k, v, hq, hk, 0.4, 6), rtol=1e-12, atol=1e-12
    )


@needs_numba
def test_the_decode_fast_path_leaves_positional_options_to_the_general_path() -> None:
    rng = np.random.default_rng(15)
    q = rng.standard_normal((1, 1, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 3, 8)).astype(np.float32)
    probs = np.full((1, 2, 1, 1, 3), np.nan, np.float32)
    out = np.empty_like(q)
    returned = CpuAttentionOp(None, None, None).forward(q, kv, kv, 2, 2, 0.5, out, probs)  # type: ignore[arg-type]
    assert returned is not None and np.shares_memory(returned, probs)  # written into the buffer
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("hq", "hk"), [(4, 2), (2, 2), (3, 1)])
def test_backward_matches_finite_differences(hq: int, hk: int, kernels: str) -> None:
    rng = np.random.default_rng(7 + hq)
    n_b, n_t, d, scale = 2, 4, 3, 0.6
    q = rng.standard_normal((n_b, n_t, hq * d))
    k = rng.standard_normal((n_b, n_t, hk * d))
    v = rng.standard_normal((n_b, n_t, hk * d))
    weight = rng.standard_normal((n_b, n_t, hq * d))  # loss = sum(weight * out): asymmetric

    def loss(q_, k_, v_):  # type: ignore[no-untyped-def]
        out = np.empty_like(q_)
        attention_forward(q_, k_, v_, hq, hk, scale, out, **forward_hooks(kernels))
        return float((weight * out).sum())

    out = np.empty_like(q)
    probs = attention_forward(q, k, v, hq, hk, scale, out, **forward_hooks(kernels))
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    hooks = backward_hooks(kernels)
    attention_backward(weight, q, k, v, probs, hq, hk, scale, dq, dk, dv, **hooks)
    via_out = [np.empty_like(q), np.empty_like(k), np.empty_like(v)]
    attention_backward(weight, q, k, v, probs, hq, hk, scale, *via_out, out=out, **hooks)
    for a, b in zip((dq, dk, dv), via_out, strict=True):  # rowsum(dP*P) == dO.O
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    eps = 1e-6
    for array, grad in ((q, dq), (k, dk), (v, dv)):
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            saved = array[index]
            array[index] = saved + eps
            up = loss(q, k, v)
            array[index] = saved - eps
            down = loss(q, k, v)
            array[index] = saved
            numeric[index] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kernels", KERNELS)
def test_outputs_may_be_views_with_any_strides(kernels: str) -> None:
    """``out``, ``dq``, ``dk`` and ``dv`` as every other column of larger buffers (a last axis
    that is not contiguous, which a reshape would copy): written in place, equal to dense
    outputs, and the columns between them untouched."""
    rng = np.random.default_rng(11)
    n_b, n_t, hq, hk, d, scale = 2, 5, 4, 2, 3, 0.7
    q = rng.standard_normal((n_b, n_t, hq * d)).astype(np.float32)
    k = rng.standard_normal((n_b, n_t, hk * d)).astype(np.float32)
    v = rng.standard_normal((n_b, n_t, hk * d)).astype(np.float32)
    dout = rng.standard_normal((n_b, n_t, hq * d)).astype(np.float32)
    dense = [np.empty_like(q), np.empty_like(q), np.empty_like(k), np.empty_like(v)]
    probs = attention_forward(q, k, v, hq, hk, scale, dense[0], **forward_hooks(kernels))
    attention_backward(dout, q, k, v, probs, hq, hk, scale, *dense[1:], **backward_hooks(kernels))
    bigs = [np.full((*a.shape[:2], 2 * a.shape[2]), 7.0, np.float32) for a in dense]
    views = [big[..., ::2] for big in bigs]
    probs = attention_forward(q, k, v, hq, hk, scale, views[0], **forward_hooks(kernels))
    attention_backward(dout, q, k, v, probs, hq, hk, scale, *views[1:], **backward_hooks(kernels))
    for view, want, big in zip(views, dense, bigs, strict=True):
        np.testing.assert_array_equal(view, want)
        assert (big[..., 1::2] == 7.0).all()


def test_deepseek_softmax_multiplier_is_opt_in(device) -> None:
    from mila_py import BuildContext, RuntimeMode
    from mila_py.components import AttentionConfig, GroupedQueryAttention

    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }
    scales = {}
    for opt_in in (False, True):
        cfg = AttentionConfig(
            dim=32, n_heads=4, n_kv_heads=2, max_seq_len=64, rope_scaling=yarn,
            rope_softmax_scale=opt_in,
        )  # fmt: skip
        attn = GroupedQueryAttention("attn", cfg, device=device)
        attn.build(BuildContext((1, 4, 32), RuntimeMode.INFERENCE))
        scales[opt_in] = attn.scale
    mscale = 0.1 * 0.8 * math.log(8.0) + 1.0  # DeepSeek: softmax scale * mscale(factor, all_dim)^2
    assert scales[False] == pytest.approx(1 / math.sqrt(8))
    assert scales[True] == pytest.approx(mscale**2 / math.sqrt(8))


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_its_float64_twin(device, precision: Precision) -> None:
    """A 16-bit GroupedQueryAttention (grouped heads, RoPE) against the float64 CPU layer of
    the same weights, forward and backward (see :func:`check_16_bit_twin`); its backward
    rounds the QKV product, the attention output and their gradients to 16 bits in turn
    (twice the one-layer tolerance)."""
    skip_bf16_without_arrays(device, precision)
    from mila_py.components import AttentionConfig, GroupedQueryAttention

    check_16_bit_twin(
        lambda p, d: GroupedQueryAttention(
            "attn", AttentionConfig(32, 4, 2, max_seq_len=16), device=d, precision=p
        ),
        (2, 5, 32),
        lambda rng, dtype: (rng.standard_normal((2, 5, 32)).astype(dtype),),
        device,
        precision,
        np.random.default_rng(2024),
        stages=2.0,
    )


# ------------------------------------------------------------------ CUDA op against the CPU op
@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20260601)


@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 8), (6, 1, 16), (3, 3, 64)])
def test_cuda_op_training_matches_the_cpu_op(cuda_ctx, rng, hq: int, hk: int, d: int) -> None:
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    n_b, n_t, scale = 2, 33, 0.3
    qkv = f32(rng, n_b, n_t, (hq + 2 * hk) * d)
    q, k, v = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d], qkv[..., (hq + hk) * d :]
    g_qkv = dev(qkv)
    gq, gk, gv = (
        g_qkv[..., : hq * d],
        g_qkv[..., hq * d : (hq + hk) * d],
        g_qkv[..., (hq + hk) * d :],
    )
    probs = cupy.empty((n_b, hk, hq // hk, n_t, n_t), cupy.float32)
    out = cupy.empty((n_b, n_t, hq * d), cupy.float32)
    p = op.forward(gq, gk, gv, hq, hk, scale, out=out, probs=probs)
    out_ref = np.empty((n_b, n_t, hq * d), np.float32)
    p_ref = attention_forward(q, k, v, hq, hk, scale, out_ref)
    close(p, p_ref)
    close(out, out_ref)
    np.testing.assert_array_equal(host(g_qkv), qkv)  # Q, K, V untouched
    dout = f32(rng, n_b, n_t, hq * d)
    dqkv = cupy.zeros(qkv.shape, cupy.float32)
    dq, dk, dv = dqkv[..., : hq * d], dqkv[..., hq * d : (hq + hk) * d], dqkv[..., (hq + hk) * d :]
    op.backward(dev(dout), gq, gk, gv, p, hq, hk, scale, dq, dk, dv, out=out)
    dqkv_ref = np.zeros_like(qkv)
    rq, rk, rv = (
        dqkv_ref[..., : hq * d],
        dqkv_ref[..., hq * d : (hq + hk) * d],
        dqkv_ref[..., (hq + hk) * d :],
    )
    attention_backward(dout, q, k, v, p_ref, hq, hk, scale, rq, rk, rv, out=out_ref)
    close(dqkv, dqkv_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ragged", [False, True])
def test_cuda_op_prefill_and_decode_match_the_cpu_op(cuda_ctx, rng, ragged: bool) -> None:
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    hq, hk, d, scale, n_b = 4, 2, 16, 0.25, 3
    cache = f32(rng, n_b, 40, 2 * hk * d)
    q = f32(rng, n_b, 5, hq * d)
    k, v = cache[:, :30, : hk * d], cache[:, :30, hk * d :]
    gk, gv = dev(cache)[:, :30, : hk * d], dev(cache)[:, :30, hk * d :]
    out = cupy.empty((n_b, 5, hq * d), cupy.float32)  # prefill of 5 queries at offset 25
    op.forward(dev(q), gk, gv, hq, hk, scale, out=out, q_offset=25)
    out_ref = np.empty((n_b, 5, hq * d), np.float32)
    attention_forward(q, k, v, hq, hk, scale, out_ref, q_offset=25)
    close(out, out_ref)
    pos = np.array([7, 29, 18]) if ragged else np.full(n_b, 29)
    kwargs_ref: dict[str, Any] = {"causal": False}
    kwargs: dict[str, Any] = {"causal": False}
    if ragged:
        visible = np.arange(30)[None, :] <= pos[:, None]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, None, None, :]
        kwargs_ref["bias"], kwargs["bias"] = bias, dev(bias)
    q1 = q[:, :1]
    out1 = cupy.empty((n_b, 1, hq * d), cupy.float32)
    op.forward(dev(np.ascontiguousarray(q1)), gk, gv, hq, hk, scale, out=out1, **kwargs)
    ref1 = np.empty((n_b, 1, hq * d), np.float32)
    attention_forward(q1, k, v, hq, hk, scale, ref1, **kwargs_ref)
    close(out1, ref1)


def _qkv_views(buf: Any, hq: int, hk: int, d: int) -> tuple[Any, Any, Any]:
    """Q, K, V: views of one fused ``[B, T, (Hq + 2 Hk) d]`` buffer, like the component's."""
    return buf[..., : hq * d], buf[..., hq * d : (hq + hk) * d], buf[..., (hq + hk) * d :]


@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 8), (3, 3, 5)])
def test_cuda_op_into_a_batch_slice_and_backward_without_the_output(
    cuda_ctx, rng, hq: int, hk: int, d: int
) -> None:
    """The output a batch slice of a larger buffer (the rows past it untouched), and the
    backward without the forward's output (``rowsum(dP * P)`` in its place)."""
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    n_b, n_t, scale = 2, 9, 0.41
    qkv = f32(rng, n_b, n_t, (hq + 2 * hk) * d)
    q, k, v = _qkv_views(qkv, hq, hk, d)
    gq, gk, gv = _qkv_views(dev(qkv), hq, hk, d)
    probs = cupy.empty((n_b, hk, hq // hk, n_t, n_t), cupy.float32)
    out_buf = cupy.zeros((n_b + 1, n_t, hq * d), cupy.float32)
    p = op.forward(gq, gk, gv, hq, hk, scale, out=out_buf[:n_b], probs=probs)
    out_ref = np.empty((n_b, n_t, hq * d), np.float32)
    p_ref = attention_forward(q, k, v, hq, hk, scale, out_ref)
    close(p, p_ref, atol=1e-6)
    close(out_buf[:n_b], out_ref, atol=1e-6)
    assert not host(out_buf)[n_b:].any()
    dout = f32(rng, n_b, n_t, hq * d)
    dqkv = cupy.zeros(qkv.shape, cupy.float32)
    op.backward(dev(dout), gq, gk, gv, dev(p_ref), hq, hk, scale, *_qkv_views(dqkv, hq, hk, d))
    dqkv_ref = np.zeros_like(qkv)
    attention_backward(
        dout, q, k, v, p_ref, hq, hk, scale, *_qkv_views(dqkv_ref, hq, hk, d), out=out_ref
    )
    close(dqkv, dqkv_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ragged", [False, True])
def test_cuda_op_decode_with_a_non_finite_key_only_one_sequence_sees(
    cuda_ctx, rng, ragged: bool
) -> None:
    """Decode through the additive bias (``-inf`` past each sequence's position): a NaN key at
    row 10 reaches only the sequence that sees it (a NaN V row would reach every row through
    0 * NaN in the product, as in torch); Q untouched, the output rows of a wider buffer."""
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    hq, hk, d, scale, n_b = 6, 2, 4, 0.5, 3
    q = f32(rng, n_b, 1, hq * d)
    cache = f32(rng, n_b, 30, 2 * hk * d)
    pos = np.array([4, 17, 9]) if ragged else np.array([12, 12, 12])
    end = int(pos.max()) + 1
    kwargs: dict[str, Any] = {"causal": False}
    kwargs_ref: dict[str, Any] = {"causal": False}
    if ragged:
        cache[:, 10, : hk * d] = np.nan
        visible = np.arange(end)[None, :] <= pos[:, None]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, None, None, :]
        kwargs["bias"], kwargs_ref["bias"] = dev(bias), bias
    k, v = cache[:, :end, : hk * d], cache[:, :end, hk * d :]
    g_cache, gq = dev(cache), dev(q)
    out_buf = cupy.zeros((n_b, 4, hq * d), cupy.float32)
    out_ref = np.empty((n_b, 1, hq * d), np.float32)
    with np.errstate(invalid="ignore"):
        p = op.forward(
            gq, g_cache[:, :end, : hk * d], g_cache[:, :end, hk * d :], hq, hk, scale,
            out=out_buf[:, :1], **kwargs,
        )  # fmt: skip
        p_ref = attention_forward(q, k, v, hq, hk, scale, out_ref, **kwargs_ref)
    close(p, p_ref, atol=1e-6)
    out = host(out_buf)
    close(out[:, :1], out_ref, atol=1e-6)
    if ragged:
        assert np.isfinite(out[[0, 2], :1]).all() and np.isnan(out[1, :1]).all()
    np.testing.assert_array_equal(host(gq), q)  # a decode Q is contiguous per head: not scaled
    assert not out[:, 1:].any()


def test_cuda_op_decode_keeps_an_unseen_non_finite_value_out(cuda_ctx, rng) -> None:
    """Ragged decode given ``visible`` (as the component passes it): a NaN in a V row a
    sequence cannot see stays out of its output, as on the CPU."""
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    hq, hk, d, scale, n_b = 4, 2, 4, 0.5, 2
    q = f32(rng, n_b, 1, hq * d)
    k, v = f32(rng, n_b, 8, hk * d), f32(rng, n_b, 8, hk * d)
    v[0, 5] = np.nan  # sequence 0 sees rows 0..3; sequence 1 all 8
    visible = np.array([4, 8])
    out = cupy.empty((n_b, 1, hq * d), cupy.float32)
    op.forward(dev(q), dev(k), dev(v), hq, hk, scale, out=out, causal=False, visible=visible)
    out_ref = np.empty((n_b, 1, hq * d), np.float32)
    attention_forward(q, k, v, hq, hk, scale, out_ref, causal=False, visible=visible)
    assert np.isfinite(host(out)).all()
    close(out, out_ref, atol=1e-6)


def _decode_reference(q, k_cache, v_cache, hq: int, hk: int, scale: float, pos) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Decode attention in float64, from its definition: sequence b, head h attends with
    softmax(scale q.k_j) over keys 0 .. pos[b] of its key/value head h // (hq // hk)."""
    n_b, d = q.shape[0], q.shape[2] // hq
    out = np.zeros((n_b, 1, hq * d))
    for b in range(n_b):
        for h in range(hq):
            g = h // (hq // hk)
            qh = q[b, 0, h * d : (h + 1) * d].astype(np.float64)
            keys = k_cache[b, : pos[b] + 1, g * d : (g + 1) * d].astype(np.float64)
            values = v_cache[b, : pos[b] + 1, g * d : (g + 1) * d].astype(np.float64)
            s = keys @ qh * scale
            p = np.exp(s - s.max())
            out[b, 0, h * d : (h + 1) * d] = p @ values / p.sum()
    return out


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
@pytest.mark.parametrize(
    ("hq", "hk", "d"), [(6, 2, 4), (4, 4, 40), (8, 1, 12), (2, 1, 128), (2, 1, 320)], ids=str
)
def test_cuda_decode_plan_matches_a_float64_reference(
    cuda_ctx, rng, monkeypatch, ragged: bool, hq: int, hk: int, d: int
) -> None:
    """The decode plan's one-launch kernel (``bind_decode``): Q a view of the QKV buffer, the
    caches ``[B, T_max, Hk*d]``, one length for all or one per sequence (1 key, several warp
    rounds; heads of 4 to 320 channels: 64 key groups of 4 channels, 6 groups of 40 and 16
    idle threads, two passes over 320), against float64; for caches of more keys than fit
    shared memory, the GEMM path (chosen at bind time: every step launches the same). The
    kernel reads each step's positions from the step's device buffer."""
    n_b, t_max, scale = 3, 80, 0.37
    qkv = f32(rng, n_b, 1, (hq + 2 * hk) * d)
    q, gq = qkv[..., : hq * d], dev(qkv)[..., : hq * d]
    k_cache, v_cache = f32(rng, n_b, t_max, hk * d), f32(rng, n_b, t_max, hk * d)
    gk, gv = dev(k_cache), dev(v_cache)
    out_buf = cupy.zeros((n_b + 1, 1, hq * d), cupy.float32)
    out = out_buf[:n_b]
    positions = DecodePositions(n_b, cuda_ctx)
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    attend = op.bind_decode(gq, gk, gv, hq, hk, scale, out, positions)
    assert replayable(attend)
    program = [[0, 0, 0], [70, 3, 41], [5, 5, 5], [79, 79, 79]] if ragged else [[0] * 3, [66] * 3]
    for step in program:
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        attend()
        if EMULATED:
            assert cuda_ctx.launches[-1] == "attention_decode<float>"
        close(out, _decode_reference(q, k_cache, v_cache, hq, hk, scale, pos), 1e-5, 1e-5)
    np.testing.assert_array_equal(host(gq), q)
    assert not host(out_buf)[n_b:].any()
    monkeypatch.setattr(cuda_attention, "_DECODE_MAX_KEYS", 60)  # a cache of 80 keys: too many
    attend = op.bind_decode(gq, gk, gv, hq, hk, scale, out, positions)
    assert not replayable(attend)  # it slices the caches by the positions on the host
    for step in ([66, 12, 40], [3, 3, 3]) if ragged else ([66] * 3, [3] * 3):
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        if EMULATED:
            launched = len(cuda_ctx.launches)
        attend()
        if EMULATED:
            assert "attention_decode" not in cuda_ctx.launches[launched:]
        close(out, _decode_reference(q, k_cache, v_cache, hq, hk, scale, pos), 1e-5, 1e-5)


def test_cuda_decode_plan_at_its_key_limit_fits_shared_memory(cuda_ctx, rng, monkeypatch) -> None:
    """The most keys the decode kernel takes (``_DECODE_MAX_KEYS``): the scores of a cache
    of that many keys (the shared memory of every step) and the kernel's static shared arrays
    fit the 48 KiB a launch gets by default. The kernel emulator counts both, as the GPU does,
    and refuses 1,100 keys more by name (a GPU refuses that launch with a driver error)."""
    n = cuda_attention._DECODE_MAX_KEYS
    hq, hk, d = 2, 1, 4
    q = f32(rng, 1, 1, hq * d)
    k_cache, v_cache = f32(rng, 1, n + 1100, hk * d), f32(rng, 1, n + 1100, hk * d)
    gk, gv = dev(k_cache), dev(v_cache)
    out = cupy.zeros((1, 1, hq * d), cupy.float32)
    positions = DecodePositions(1, cuda_ctx)
    op = create_op("AttentionOp", cuda_ctx, None, Precision.FP32)
    attend = op.bind_decode(dev(q), gk[:, :n], gv[:, :n], hq, hk, 0.5, out, positions)
    positions.set(n - 1, n - 1, n - 1)
    attend()
    close(out, _decode_reference(q, k_cache, v_cache, hq, hk, 0.5, [n - 1]), 1e-5, 1e-5)
    if not EMULATED:
        return
    assert cuda_ctx.launches[-1] == "attention_decode<float>"
    monkeypatch.setattr(cuda_attention, "_DECODE_MAX_KEYS", n + 1100)
    attend = op.bind_decode(dev(q), gk, gv, hq, hk, 0.5, out, positions)
    positions.set(0, 0, 0)
    with pytest.raises(ValueError, match="static"):
        attend()


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_cuda_kv_cache_write_matches_the_cpu_op(cuda_ctx, rng, ragged: bool) -> None:
    """The CUDA op's bound cache write (``kv_cache_write``; K a view of the QKV buffer, V of
    another, with other row strides; the rows from the step's device buffer of positions)
    against the CPU op's array assignments; other rows and sequences untouched."""
    hq, hk, d, n_b, t_max = 4, 2, 6, 3, 10
    qkv = f32(rng, n_b, 1, (hq + 2 * hk) * d)
    v_wide = f32(rng, n_b, 1, hk * d + 5)  # V's rows at another stride than K's
    k, v = qkv[:, 0, hq * d : (hq + hk) * d], v_wide[:, 0, 2 : 2 + hk * d]
    gk, gv = dev(qkv)[:, 0, hq * d : (hq + hk) * d], dev(v_wide)[:, 0, 2 : 2 + hk * d]
    k_cache, v_cache = f32(rng, n_b, t_max, hk * d), f32(rng, n_b, t_max, hk * d)
    before = [k_cache.copy(), v_cache.copy()]
    g_caches = [dev(k_cache), dev(v_cache)]
    positions = DecodePositions(n_b, cuda_ctx)
    cuda_write = create_op("AttentionOp", cuda_ctx, None, Precision.FP32).bind_cache_write(
        gk, gv, g_caches[0], g_caches[1], positions
    )
    cpu_positions = DecodePositions(n_b)
    cpu_op = create_op("AttentionOp", create_execution_context("CPU"), None, Precision.FP32)
    cpu_write = cpu_op.bind_cache_write(k, v, k_cache, v_cache, cpu_positions)
    program = [[3, 7, 0], [9, 9, 9], [1, 2, 5]] if ragged else [[4, 4, 4], [9, 9, 9]]
    for step in program:
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        cpu_positions.set(pos, int(pos.min()), int(pos.max()))
        cuda_write()
        cpu_write()
        if EMULATED:
            assert cuda_ctx.launches[-1] == "kv_cache_write<float>"
        np.testing.assert_array_equal(host(g_caches[0]), k_cache)
        np.testing.assert_array_equal(host(g_caches[1]), v_cache)
        for b, p in enumerate(pos):
            np.testing.assert_array_equal(k_cache[b, p], k[b])
            np.testing.assert_array_equal(v_cache[b, p], v[b])
    written = np.zeros((n_b, t_max), bool)
    for step in program:
        written[np.arange(n_b), step] = True
    for cache, old in zip((k_cache, v_cache), before, strict=True):
        np.testing.assert_array_equal(cache[~written], old[~written])


def test_cuda_host_orchestration_with_numpy_kernels(rng) -> None:
    """The CUDA op's host-side functions (CPU only: NumPy stands in for the device) with NumPy
    kernels written from their documented contracts, against the CPU op."""

    def softmax(scores: Any, n_tq: int, q_offset: int, causal: bool) -> None:
        rows, n_tk = scores.shape
        t = (np.arange(rows) % n_tq)[:, None]
        if causal:
            scores[np.arange(n_tk)[None, :] > q_offset + t] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)

    def softmax_backward(dp: Any, p: Any, row: Any) -> None:
        dp -= row[:, None]
        dp *= p

    hq, hk, d, scale = 4, 2, 3, 0.7
    q, k, v = _qkv_views(f32(rng, 2, 5, (hq + 2 * hk) * d), hq, hk, d)
    out, out_ref = np.empty((2, 5, hq * d), np.float32), np.empty((2, 5, hq * d), np.float32)
    p = cuda_attention.attention_forward(q, k, v, hq, hk, scale, out, xp=np, softmax=softmax)
    p_ref = attention_forward(q, k, v, hq, hk, scale, out_ref)
    close(p, p_ref, atol=1e-6)
    close(out, out_ref, atol=1e-6)
    dout = f32(rng, 2, 5, hq * d)
    grads = [np.empty_like(a) for a in (q, k, v) for _ in range(2)]
    cuda_attention.attention_backward(
        dout, q, k, v, p_ref, hq, hk, scale, *grads[0::2], out=out_ref, xp=np,
        softmax_backward=softmax_backward,
    )  # fmt: skip
    attention_backward(dout, q, k, v, p_ref, hq, hk, scale, *grads[1::2], out=out_ref)
    for ours, ref in zip(grads[0::2], grads[1::2], strict=True):
        close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_in_16_bits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """The training forward (float32 probabilities) and backward over views of one 16-bit
    QKV buffer, and a prefill chunk at an offset into a 16-bit cache, against the CPU op in
    the same precision."""
    p, dtype = precision, precision.numpy_dtype
    hq, hk, d, n_b, n_t, scale = 4, 2, 8, 2, 9, 0.41
    gpu, cpu = create_op("AttentionOp", cuda_ctx, None, p), create_op("AttentionOp", CPU, None, p)
    qkv = f32(rng, n_b, n_t, (hq + 2 * hk) * d).astype(dtype)
    q, k, v = _qkv_views(qkv, hq, hk, d)
    gq, gk, gv = _qkv_views(dev(qkv), hq, hk, d)
    probs = cupy.empty((n_b, hk, hq // hk, n_t, n_t), cupy.float32)
    probs_ref = np.empty((n_b, hk, hq // hk, n_t, n_t), np.float32)
    out, out_ref = cupy.empty((n_b, n_t, hq * d), dtype), np.empty((n_b, n_t, hq * d), dtype)
    gpu.forward(gq, gk, gv, hq, hk, scale, out=out, probs=probs)
    cpu.forward(q, k, v, hq, hk, scale, out=out_ref, probs=probs_ref)
    close(probs, probs_ref, rtol=1e-5, atol=1e-6)
    agree(out, out_ref, p)
    dout = f32(rng, n_b, n_t, hq * d).astype(dtype)
    dqkv, dqkv_ref = cupy.zeros(qkv.shape, dtype), np.zeros_like(qkv)
    gpu.backward(
        dev(dout), gq, gk, gv, dev(probs_ref), hq, hk, scale, *_qkv_views(dqkv, hq, hk, d),
        out=dev(out_ref),
    )  # fmt: skip
    cpu.backward(
        dout, q, k, v, probs_ref, hq, hk, scale, *_qkv_views(dqkv_ref, hq, hk, d), out=out_ref
    )
    agree(dqkv, dqkv_ref, p)
    cache = f32(rng, n_b, 20, 2 * hk * d).astype(dtype)
    g_cache = dev(cache)
    chunk, chunk_ref = cupy.empty((n_b, 3, hq * d), dtype), np.empty((n_b, 3, hq * d), dtype)
    gpu.prefill(gq[:, :3], g_cache[:, :12, : hk * d], g_cache[:, :12, hk * d :], hq, hk, scale,
                chunk, 9)  # fmt: skip
    cpu.prefill(q[:, :3], cache[:, :12, : hk * d], cache[:, :12, hk * d :], hq, hk, scale,
                chunk_ref, 9)  # fmt: skip
    agree(chunk, chunk_ref, p)


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_decode_kernels_in_16_bits_match_the_cpu_op(
    cuda_ctx, rng, precision: Precision
) -> None:
    """``kv_cache_write<T>`` and ``attention_decode<T>`` (the 16-bit cache read as it is)
    against the CPU op's decode plan on the same 16-bit values, uniform and ragged: the caches
    bit for bit, the output to a rounding."""
    p, dtype = precision, precision.numpy_dtype
    hq, hk, d, n_b, t_max, scale = 6, 2, 16, 3, 40, 0.37
    qkv = f32(rng, n_b, 1, (hq + 2 * hk) * d).astype(dtype)
    caches = [f32(rng, n_b, t_max, hk * d).astype(dtype) for _ in range(2)]
    sides = {
        "gpu": (cuda_ctx, _qkv_views(dev(qkv), hq, hk, d), [dev(c) for c in caches]),
        "cpu": (CPU, _qkv_views(qkv, hq, hk, d), [c.copy() for c in caches]),
    }
    outs = {"gpu": cupy.zeros((n_b, 1, hq * d), dtype), "cpu": np.zeros((n_b, 1, hq * d), dtype)}
    cells, steps = {}, {}
    for side, (ctx, (q, k_new, v_new), (kc, vc)) in sides.items():
        op = create_op("AttentionOp", ctx, None, p)
        cells[side] = cell = DecodePositions(n_b, cuda_ctx if side == "gpu" else None)
        write = op.bind_cache_write(k_new[:, 0], v_new[:, 0], kc, vc, cell)
        steps[side] = (write, op.bind_decode(q, kc, vc, hq, hk, scale, outs[side], cell))
    for positions in ([7, 7, 7], [3, 30, 12]):
        pos = np.array(positions)
        for side in sides:
            cells[side].set(pos, int(pos.min()), int(pos.max()))
            for step in steps[side]:
                step()
        for g, c in zip(sides["gpu"][2], sides["cpu"][2], strict=True):
            np.testing.assert_array_equal(host(g), c)
        agree(outs["gpu"], outs["cpu"], p)
    if EMULATED:
        tag = "mila_bf16" if p is Precision.BF16 else "mila_half"
        assert {f"attention_decode<{tag}>", f"kv_cache_write<{tag}>"} <= set(cuda_ctx.launches)
