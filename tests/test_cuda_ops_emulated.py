"""The CUDA ops of the Llama, run on the CPU: NumPy arrays, their raw kernels emulated in C++.

Each CUDA op (host logic and kernels, see ``kernel_emulator.py``) is compared with its CPU op
on random inputs, including the awkward ones: views of a fused buffer, batch slices of larger
buffers, transposed weights, in-place gradients, ignored targets, repeated token ids, ragged
decode masks. Float32 results agree with the CPU ops to within reduction-order roundings; where
both sides do the same IEEE operations in the same order (AdamW) they agree bit for bit.

The CUDA sources are also compiled for sm_90 by ``nvcc`` where it is installed, and by NVRTC
through CuPy where CuPy and NVRTC load (no GPU needed). The same ops on
a real GPU are compared in the ops' test files (``cuda_device``). RoPE's op, whose template kernel
is in :data:`SOURCES` too, is checked in ``test_rope_cuda_emulated.py``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from kernel_emulator import (
    COMPILER,
    FILES,
    NAME_EXPRESSIONS,
    SOURCES,
    EmulatedContext,
    KernelLibrary,
    emulated_context,
    names_in,
)
from layer_helpers import assert_same_optimizer_state

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import (
    Linear,
    LinearConfig,
    RmsNormConfig,
    SoftmaxCrossEntropyConfig,
)
from mila_py.devices.graph import replayable
from mila_py.ops.cpu.attention import CpuAttentionOp
from mila_py.ops.cpu.attention import attention_backward as cpu_attention_backward
from mila_py.ops.cpu.attention import attention_forward as cpu_attention_forward
from mila_py.ops.cpu.rms_norm import rms_norm_backward, rms_norm_forward
from mila_py.ops.cpu.softmax_cross_entropy import (
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from mila_py.ops.cpu.swiglu import swiglu_backward, swiglu_forward
from mila_py.ops.cuda import (
    _kernels,
    attention,
    rms_norm,
)
from mila_py.ops.cuda.adamw import CudaAdamWOp
from mila_py.ops.cuda.attention import CudaAttentionOp
from mila_py.ops.cuda.rms_norm import CudaRmsNormOp
from mila_py.ops.cuda.softmax_cross_entropy import CudaSoftmaxCrossEntropyOp
from mila_py.ops.cuda.swiglu import CudaSwiGLUOp
from mila_py.ops.operation import DecodePositions
from mila_py.optim import AdamW

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

FP32 = Precision.FP32
#: float32 results of different summation orders (row sums of a few hundred terms)
RTOL, ATOL = 2e-6, 2e-7


@pytest.fixture
def ctx(library: KernelLibrary) -> Iterator[EmulatedContext]:
    with emulated_context(library) as context:
        yield context


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def close(actual: Any, expected: Any, rtol: float = RTOL, atol: float = ATOL) -> None:
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------- linear
# ------------------------------------------------------------------------------------ rmsnorm
@pytest.mark.parametrize(("n_rows", "dim"), [(1, 5), (7, 40), (37, 300), (2, 1000)])
def test_rms_norm_matches_cpu(ctx: EmulatedContext, rng, n_rows: int, dim: int) -> None:
    op = CudaRmsNormOp(ctx, RmsNormConfig(dim, eps=1e-5), FP32)
    big = f32(rng, n_rows, 2, dim, scale=3.0)
    x = big[:, 0]  # every other row: not contiguous
    w = f32(rng, dim) + 1
    y, r = np.empty((n_rows, dim), np.float32), np.empty(n_rows, np.float32)
    y_ref, r_ref = np.empty_like(y), np.empty_like(r)
    op.forward(x, w, y, r)
    rms_norm_forward(x, w, 1e-5, y_ref, r_ref)
    close(y, y_ref)
    close(r, r_ref)
    dy = f32(rng, n_rows, dim)
    dw0 = f32(rng, dim)
    dw, dw_ref = dw0.copy(), dw0.copy()
    dx, dx_ref = np.empty_like(y), np.empty_like(y)
    op.backward(x, w, r, dy, dw, dx)
    rms_norm_backward(x, w, r_ref, dy, dw_ref, dx_ref)
    close(dx, dx_ref, atol=1e-6)
    close(dw, dw_ref, rtol=1e-5, atol=1e-5)  # column sums of n_rows terms of size ~1
    assert ctx.launches == [
        "rms_norm_forward<float>",
        "rms_norm_backward_dx<float>",
        "rms_norm_backward_dw<float>",
    ]


@pytest.mark.parametrize("magnitude", [1e20, 1e-25])
def test_rms_norm_of_rows_whose_float32_squares_overflow(
    ctx: EmulatedContext, rng, magnitude: float
) -> None:
    """The squares summed in double, as the CPU ops: in float32 a row of 1e20 gave y = 0."""
    eps = 1e-45 if magnitude < 1 else 1e-5
    op = CudaRmsNormOp(ctx, RmsNormConfig(64, eps=eps), FP32)
    x = (f32(rng, 3, 64) * magnitude).astype(np.float32)
    w = np.ones(64, np.float32)
    y, r = np.empty_like(x), np.empty(3, np.float32)
    op.forward(x, w, y, r)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + np.float32(eps))
    np.testing.assert_allclose(y, want, rtol=1e-5)


def test_rms_norm_weight_gradient_chunks_cover_every_row() -> None:
    for n_rows in (1, 7, 8, 9, 4095, 4096, 4097, 100_000):
        per, chunks = rms_norm.dweight_chunks(n_rows)
        assert per * chunks >= n_rows > per * (chunks - 1)
        assert chunks <= 512


# ------------------------------------------------------------------------------------- swiglu
def test_swiglu_matches_cpu_in_place_and_at_extremes(ctx: EmulatedContext, rng) -> None:
    op = CudaSwiGLUOp(ctx, None, FP32)
    g, u = f32(rng, 3, 4, 50, scale=4.0), f32(rng, 3, 4, 50)
    g[0, 0, :4] = [-100.0, 100.0, -1e4, 1e4]  # exp overflows: the limits, no NaN
    h, h_ref = np.empty_like(g), np.empty_like(g)
    op.forward(g, u, h)
    swiglu_forward(g, u, h_ref)
    close(h, h_ref)
    dh = f32(rng, 3, 4, 50)
    dg, du = np.empty_like(g), np.empty_like(g)
    dg_ref, du_ref = np.empty_like(g), np.empty_like(g)
    with np.errstate(over="ignore"):
        swiglu_backward(g, u, dh, dg_ref, du_ref)
    op.backward(g, u, dh, dg, du)
    close(dg, dg_ref)
    close(du, du_ref)
    in_place = dh.copy()  # dgate is dh itself, as the SwiGLU component calls it
    op.backward(g, u, in_place, in_place, du)
    close(in_place, dg_ref)
    assert np.isfinite(h).all() and np.isfinite(dg).all()


# -------------------------------------------------------------------------------- embedding
# ------------------------------------------------------------------------------ cross-entropy
@pytest.mark.parametrize("vocab", [5, 300, 1031])
def test_softmax_cross_entropy_matches_cpu(ctx: EmulatedContext, rng, vocab: int) -> None:
    op = CudaSoftmaxCrossEntropyOp(ctx, SoftmaxCrossEntropyConfig(vocab, ignore_index=-100), FP32)
    logits = f32(rng, 2, 5, vocab, scale=5.0)
    targets = rng.integers(0, vocab, size=(2, 5))
    targets[0, 1] = targets[1, 4] = -100
    lse, lse_ref = np.empty((2, 5), np.float32), np.empty((2, 5), np.float32)
    loss, count = op.forward(logits, targets, lse)
    loss_ref, count_ref = softmax_cross_entropy_forward(logits, targets, -100, lse_ref)
    assert count == count_ref == 8
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    close(lse, lse_ref)
    d, d_ref = np.empty_like(logits), np.empty_like(logits)
    op.backward(logits, targets, lse, d, 0.37 / count)
    softmax_cross_entropy_backward(logits, targets, -100, lse_ref, d_ref, 0.37 / count)
    close(d, d_ref, atol=1e-8)
    assert not d[0, 1].any() and not d[1, 4].any()


@pytest.mark.parametrize("shift", [1e4, 1e7])
def test_softmax_cross_entropy_of_large_logits_is_exact(
    ctx: EmulatedContext, rng, shift: float
) -> None:
    """Max and log-sum apart in float64, and a backward that renormalizes each row (as the CPU
    op): logits around 1e4 lost ~2e-5 of the loss; three equal logits of 1e7 gave 1.0 for
    log 3."""
    vocab = 3 if shift == 1e7 else 50
    op = CudaSoftmaxCrossEntropyOp(ctx, SoftmaxCrossEntropyConfig(vocab), FP32)
    logits = np.full((1, 4, vocab), shift, np.float32)
    if shift == 1e4:
        logits += f32(rng, 1, 4, vocab, scale=3.0)
    targets = rng.integers(0, vocab, size=(1, 4))
    z = logits.astype(np.float64).reshape(4, vocab)
    m = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    want = float(np.mean((m - z[np.arange(4), targets[0]][:, None]) + log_sum))
    lse = np.empty((1, 4), np.float32)
    loss, count = op.forward(logits, targets, lse)
    assert count == 4 and loss == pytest.approx(want, rel=1e-6, abs=1e-6)
    d = np.empty_like(logits)
    op.backward(logits, targets, lse, d, 1.0 / count)
    p = np.exp(z - m - log_sum)
    p[np.arange(4), targets[0]] -= 1.0
    np.testing.assert_allclose(d.reshape(4, vocab), p / count, rtol=0, atol=2e-7)


def test_softmax_cross_entropy_with_every_target_ignored(ctx: EmulatedContext, rng) -> None:
    op = CudaSoftmaxCrossEntropyOp(ctx, SoftmaxCrossEntropyConfig(6, ignore_index=-1), FP32)
    lse = np.empty((1, 3), np.float32)
    loss, count = op.forward(f32(rng, 1, 3, 6), np.full((1, 3), -1), lse)
    assert np.isnan(loss) and count == 0


# ---------------------------------------------------------------------------------- attention
def _qkv(rng, n_b: int, n_t: int, hq: int, hk: int, d: int) -> tuple[Any, Any, Any, Any]:
    """Q, K, V as views of one fused [B, T, (Hq + 2 Hk) d] buffer, like the component's."""
    qkv = f32(rng, n_b, n_t, (hq + 2 * hk) * d)
    return qkv, qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d], qkv[..., (hq + hk) * d :]


@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 8), (3, 3, 5), (6, 1, 4)])
def test_attention_training_matches_cpu(ctx: EmulatedContext, rng, hq: int, hk: int, d: int):
    n_b, n_t, scale = 2, 9, 0.41
    qkv, q, k, v = _qkv(rng, n_b, n_t, hq, hk, d)
    before = qkv.copy()
    op = CudaAttentionOp(ctx, None, FP32)
    probs = np.empty((n_b, hk, hq // hk, n_t, n_t), np.float32)
    out_buf = np.zeros((n_b + 1, n_t, hq * d), np.float32)
    out = out_buf[:n_b]
    p = op.forward(q, k, v, hq, hk, scale, out=out, probs=probs)
    out_ref = np.empty((n_b, n_t, hq * d), np.float32)
    p_ref = cpu_attention_forward(q, k, v, hq, hk, scale, out_ref)
    assert p is not None and np.shares_memory(p, probs)
    close(p, p_ref, atol=1e-6)
    close(out, out_ref, atol=1e-6)
    np.testing.assert_array_equal(qkv, before)  # inputs untouched
    dout = f32(rng, n_b, n_t, hq * d)
    dqkv, dqkv_ref = np.zeros_like(qkv), np.zeros_like(qkv)
    for buf, fn in ((dqkv, op.backward), (dqkv_ref, cpu_attention_backward)):
        dq, dk, dv = buf[..., : hq * d], buf[..., hq * d : (hq + hk) * d], buf[..., (hq + hk) * d :]
        fn(dout, q, k, v, p_ref, hq, hk, scale, dq, dk, dv, out=out_ref)
    close(dqkv, dqkv_ref, rtol=1e-5, atol=1e-6)
    dqkv_rows = np.zeros_like(qkv)  # without the forward output: rowsum(dP * P)
    dq, dk, dv = (
        dqkv_rows[..., : hq * d],
        dqkv_rows[..., hq * d : (hq + hk) * d],
        dqkv_rows[..., (hq + hk) * d :],
    )
    op.backward(dout, q, k, v, p_ref, hq, hk, scale, dq, dk, dv)
    close(dqkv_rows, dqkv_ref, rtol=1e-5, atol=1e-6)


def test_attention_prefill_at_an_offset_matches_cpu(ctx: EmulatedContext, rng) -> None:
    hq, hk, d, scale = 4, 2, 6, 0.3
    _, q, _, _ = _qkv(rng, 2, 3, hq, hk, d)
    cache = f32(rng, 2, 20, 2 * hk * d)
    k, v = cache[:, :11, : hk * d], cache[:, :11, hk * d :]  # slices of a larger cache
    out, out_ref = np.empty((2, 3, hq * d), np.float32), np.empty((2, 3, hq * d), np.float32)
    p = CudaAttentionOp(ctx, None, FP32).forward(q, k, v, hq, hk, scale, out=out, q_offset=8)
    p_ref = cpu_attention_forward(q, k, v, hq, hk, scale, out_ref, q_offset=8)
    close(p, p_ref, atol=1e-6)
    close(out, out_ref, atol=1e-6)


@pytest.mark.parametrize("ragged", [False, True])
def test_attention_decode_matches_cpu(ctx: EmulatedContext, rng, ragged: bool) -> None:
    hq, hk, d, scale, n_b = 6, 2, 4, 0.5, 3
    _, q, _, _ = _qkv(rng, n_b, 1, hq, hk, d)
    cache = f32(rng, n_b, 30, 2 * hk * d)
    pos = np.array([4, 17, 9]) if ragged else np.array([12, 12, 12])
    end = int(pos.max()) + 1
    k, v = cache[:, :end, : hk * d], cache[:, :end, hk * d :]
    if ragged:  # the component's bias: -inf past each sequence's position
        cache[:, 10, : hk * d] = np.nan  # a key sequences 0 and 2 must not see (a V of NaN
        # would reach every row through 0 * NaN in the matmul, as in torch)
        visible = np.arange(end)[None, :] <= pos[:, None]
        bias = np.where(visible, 0.0, -np.inf).astype(np.float32)[:, None, None, None, :]
        kwargs: dict[str, Any] = {"bias": bias, "causal": False}
    else:
        kwargs = {"causal": False}
    out_buf = np.zeros((n_b, 4, hq * d), np.float32)
    out, out_ref = out_buf[:, :1], np.empty((n_b, 1, hq * d), np.float32)
    q_before = q.copy()
    with np.errstate(invalid="ignore"):
        p = CudaAttentionOp(ctx, None, FP32).forward(q, k, v, hq, hk, scale, out=out, **kwargs)
        p_ref = cpu_attention_forward(q, k, v, hq, hk, scale, out_ref, **kwargs)
    close(p, p_ref, atol=1e-6)
    close(out, out_ref, atol=1e-6)
    if ragged:  # the NaN row reaches only the sequence that sees it
        assert np.isfinite(out[[0, 2]]).all() and np.isnan(out[1]).all()
    np.testing.assert_array_equal(q, q_before)  # a decode Q is contiguous per head: not scaled
    assert not out_buf[:, 1:].any()


def test_attention_decode_keeps_an_unseen_non_finite_value_out(ctx: EmulatedContext, rng):
    """The GEMM path of ragged decode (given ``visible``, as the component passes it): a NaN
    in a V row a sequence cannot see stays out of its output, as on the CPU."""
    hq, hk, d, scale, n_b = 4, 2, 4, 0.5, 2
    _, q, _, _ = _qkv(rng, n_b, 1, hq, hk, d)
    k, v = f32(rng, n_b, 8, hk * d), f32(rng, n_b, 8, hk * d)
    v[0, 5] = np.nan  # sequence 0 sees rows 0..3; sequence 1 all 8
    visible = np.array([4, 8])
    out, out_ref = np.empty((n_b, 1, hq * d), np.float32), np.empty((n_b, 1, hq * d), np.float32)
    CudaAttentionOp(ctx, None, FP32).forward(
        q, k, v, hq, hk, scale, out=out, causal=False, visible=visible
    )
    cpu_attention_forward(q, k, v, hq, hk, scale, out_ref, causal=False, visible=visible)
    assert np.isfinite(out).all()
    close(out, out_ref, atol=1e-6)


def _decode_reference(q, k_cache, v_cache, hq: int, hk: int, scale: float, pos) -> np.ndarray:
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
def test_attention_decode_kernel_matches_a_float64_reference(
    ctx: EmulatedContext, rng, monkeypatch, ragged: bool, hq: int, hk: int, d: int
) -> None:
    """The decode plan's one-launch kernel (``bind_decode``): Q a view of the QKV buffer, the
    caches ``[B, T_max, Hk*d]``, one length for all or one per sequence (1 key, several warp
    rounds; heads of 4 to 320 channels: 64 key groups of 4 channels, 6 groups of 40 and 16
    idle threads, two passes over 320), against float64; for caches of more keys than fit
    shared memory, the GEMM path (chosen at bind time: every step launches the same). The
    kernel reads each step's positions from the step's device buffer."""
    n_b, t_max, scale = 3, 80, 0.37
    _, q, _, _ = _qkv(rng, n_b, 1, hq, hk, d)
    q_before = q.copy()
    k_cache, v_cache = f32(rng, n_b, t_max, hk * d), f32(rng, n_b, t_max, hk * d)
    out_buf = np.zeros((n_b + 1, 1, hq * d), np.float32)
    out = out_buf[:n_b]
    positions = DecodePositions(n_b, ctx)
    attend = CudaAttentionOp(ctx, None, FP32).bind_decode(
        q, k_cache, v_cache, hq, hk, scale, out, positions
    )
    program = [[0, 0, 0], [70, 3, 41], [5, 5, 5], [79, 79, 79]] if ragged else [[0] * 3, [66] * 3]
    for step in program:
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        attend()
        assert ctx.launches[-1] == "attention_decode<float>"
        close(out, _decode_reference(q, k_cache, v_cache, hq, hk, scale, pos), 1e-5, 1e-5)
    np.testing.assert_array_equal(q, q_before)
    assert not out_buf[n_b:].any()
    from mila_py.ops.cuda import attention as cuda_attention

    assert replayable(attend)
    monkeypatch.setattr(cuda_attention, "_DECODE_MAX_KEYS", 60)  # a cache of 80 keys: too many
    attend = CudaAttentionOp(ctx, None, FP32).bind_decode(
        q, k_cache, v_cache, hq, hk, scale, out, positions
    )
    assert not replayable(attend)  # it slices the caches by the positions on the host
    for step in ([66, 12, 40], [3, 3, 3]) if ragged else ([66] * 3, [3] * 3):
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        launched = len(ctx.launches)
        attend()
        assert "attention_decode" not in ctx.launches[launched:]
        close(out, _decode_reference(q, k_cache, v_cache, hq, hk, scale, pos), 1e-5, 1e-5)


def test_attention_decode_at_its_key_limit_fits_shared_memory(
    ctx: EmulatedContext, rng, monkeypatch
) -> None:
    """The most keys the decode kernel takes (``_DECODE_MAX_KEYS``): the scores of a cache
    of that many keys (the shared memory of every step) and the kernel's static shared arrays
    fit the 48 KiB a launch gets by default (the emulator counts both, as the GPU does);
    1,100 keys more would not."""
    from mila_py.ops.cuda import attention as cuda_attention

    n = cuda_attention._DECODE_MAX_KEYS
    hq, hk, d = 2, 1, 4
    _, q, _, _ = _qkv(rng, 1, 1, hq, hk, d)
    k_cache, v_cache = f32(rng, 1, n + 1100, hk * d), f32(rng, 1, n + 1100, hk * d)
    out = np.zeros((1, 1, hq * d), np.float32)
    positions = DecodePositions(1, ctx)
    op = CudaAttentionOp(ctx, None, FP32)
    attend = op.bind_decode(q, k_cache[:, :n], v_cache[:, :n], hq, hk, 0.5, out, positions)
    positions.set(n - 1, n - 1, n - 1)
    attend()
    assert ctx.launches[-1] == "attention_decode<float>"
    close(out, _decode_reference(q, k_cache, v_cache, hq, hk, 0.5, [n - 1]), 1e-5, 1e-5)
    monkeypatch.setattr(cuda_attention, "_DECODE_MAX_KEYS", n + 1100)
    attend = op.bind_decode(q, k_cache, v_cache, hq, hk, 0.5, out, positions)
    positions.set(0, 0, 0)
    with pytest.raises(ValueError, match="static"):
        attend()


def test_decode_positions_live_in_a_device_buffer_on_a_gpu() -> None:
    """A step's positions: on the CPU the host array alone; on a device also an int32 ``[B]``
    buffer of the context, allocated once and written by every ``set`` (CuPy: ``ndarray.set``
    on the context's stream, so the copy is ordered after the previous step's kernels)."""
    on_cpu = DecodePositions(3)
    on_cpu.set(np.array([4, 9, 2]), 2, 9)
    assert on_cpu.device is None
    np.testing.assert_array_equal(on_cpu.each, [4, 9, 2])
    assert (on_cpu.highest, on_cpu.uniform) == (9, False)

    emulated = EmulatedContext()
    positions = DecodePositions(3, emulated)
    buffer = positions.device
    assert buffer.dtype == np.int32 and buffer.shape == (3,)
    positions.set(np.array([4, 9, 2]), 2, 9)
    positions.set(7, 7, 7)
    assert positions.device is buffer and positions.uniform
    np.testing.assert_array_equal(buffer, [7, 7, 7])

    class DeviceArray:
        def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.writes: list[tuple[np.ndarray, Any]] = []

        def set(self, values: np.ndarray, stream: Any = None) -> None:
            assert values.shape == self.shape and values.dtype == self.dtype
            self.writes.append((values.copy(), stream))

    class Gpu(EmulatedContext):
        def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
            return DeviceArray(shape, dtype)

    gpu = Gpu()
    gpu.xp, gpu.stream = object(), "the context's stream"  # CuPy's place: not NumPy
    on_gpu = DecodePositions(2, gpu)
    on_gpu.set(np.array([5, 3]), 3, 5)
    on_gpu.set(np.array([6, 4]), 4, 6)
    writes = on_gpu.device.writes
    assert [w[1] for w in writes] == [gpu.stream] * 2
    np.testing.assert_array_equal(writes[0][0], [5, 3])
    np.testing.assert_array_equal(writes[1][0], [6, 4])


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged"])
def test_kv_cache_write_matches_the_array_assignments(
    ctx: EmulatedContext, rng, ragged: bool
) -> None:
    """The CUDA op's bound cache write (``kv_cache_write``; K a view of the QKV buffer, V of
    another, with other row strides; the rows from the step's device buffer of positions)
    against the generic array assignments of the CPU op; other rows and sequences untouched."""
    hq, hk, d, n_b, t_max = 4, 2, 6, 3, 10
    _, _, k, _ = _qkv(rng, n_b, 1, hq, hk, d)
    v = f32(rng, n_b, 1, hk * d + 5)[..., 2 : 2 + hk * d]  # rows at another stride than K's
    k_cache, v_cache = f32(rng, n_b, t_max, hk * d), f32(rng, n_b, t_max, hk * d)
    caches = [k_cache, v_cache, k_cache.copy(), v_cache.copy()]
    positions = DecodePositions(n_b, ctx)
    cuda_write = CudaAttentionOp(ctx, None, FP32).bind_cache_write(
        k[:, 0], v[:, 0], caches[0], caches[1], positions
    )
    cpu_write = CpuAttentionOp(ctx, None, FP32).bind_cache_write(
        k[:, 0], v[:, 0], caches[2], caches[3], positions
    )
    before = [c.copy() for c in caches]
    program = [[3, 7, 0], [9, 9, 9], [1, 2, 5]] if ragged else [[4, 4, 4], [9, 9, 9]]
    for step in program:
        pos = np.array(step)
        positions.set(pos, int(pos.min()), int(pos.max()))
        cuda_write()
        cpu_write()
        assert ctx.launches[-1] == "kv_cache_write<float>"
        np.testing.assert_array_equal(caches[0], caches[2])
        np.testing.assert_array_equal(caches[1], caches[3])
        for b, p in enumerate(pos):
            np.testing.assert_array_equal(caches[0][b, p], k[b, 0])
            np.testing.assert_array_equal(caches[1][b, p], v[b, 0])
    written = np.zeros((n_b, t_max), bool)
    for step in program:
        written[np.arange(n_b), step] = True
    for cache, old in zip(caches, before, strict=True):
        np.testing.assert_array_equal(cache[~written], old[~written])


def test_attention_orchestration_with_numpy_softmax(rng) -> None:
    """The host-side functions with NumPy kernels written from their documented contracts."""

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
    _, q, k, v = _qkv(rng, 2, 5, hq, hk, d)
    out, out_ref = np.empty((2, 5, hq * d), np.float32), np.empty((2, 5, hq * d), np.float32)
    p = attention.attention_forward(q, k, v, hq, hk, scale, out, xp=np, softmax=softmax)
    p_ref = cpu_attention_forward(q, k, v, hq, hk, scale, out_ref)
    close(p, p_ref, atol=1e-6)
    close(out, out_ref, atol=1e-6)
    dout = f32(rng, 2, 5, hq * d)
    grads = [np.empty_like(a) for a in (q, k, v) for _ in range(2)]
    attention.attention_backward(
        dout, q, k, v, p_ref, hq, hk, scale, *grads[0::2], out=out_ref, xp=np,
        softmax_backward=softmax_backward,
    )  # fmt: skip
    cpu_attention_backward(dout, q, k, v, p_ref, hq, hk, scale, *grads[1::2], out=out_ref)
    for ours, ref in zip(grads[0::2], grads[1::2], strict=True):
        close(ours, ref, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------- AdamW
def test_fused_adamw_equals_the_array_code_bit_for_bit(ctx: EmulatedContext, rng) -> None:
    models = []
    for _ in range(2):
        lin = Linear("lin", LinearConfig(9, 5, bias=True), device="CPU")
        lin.build(BuildContext((2, 9), RuntimeMode.TRAINING))
        models.append(lin)
    plain = AdamW(models[0], lr=3e-3, weight_decay=0.1)
    fused = AdamW(models[1], lr=3e-3, weight_decay=0.1)
    plain._fused = None  # the array code, the reference
    fused._fused = CudaAdamWOp(ctx, None, FP32)
    for step in range(3):
        for model in models:
            for (_, g), seed in zip(model.named_gradients(), range(10), strict=False):
                g[...] = f32(np.random.default_rng(step * 10 + seed), *g.shape)
        plain.step()
        fused.step()
    assert_same_optimizer_state(models, plain, fused)
    assert ctx.launches == ["adamw_step"] * 6


def test_launches_check_argument_types(ctx: EmulatedContext, rng) -> None:
    """The emulator rejects what a raw kernel would misread (and so guards the ops' calls)."""
    x = f32(rng, 2, 8)
    good = (x, x.copy(), x.copy(), np.empty(2, np.float32), np.int32(8), np.float32(1e-5))
    file = "rms_norm.cu"
    name = "rms_norm_forward<float>"
    names = (name, "rms_norm_forward<mila_bf16>")

    def launch(args: tuple, kernel_file: str = file, kernel: str = name) -> None:
        _kernels.launch(ctx, kernel_file, kernel, (2,), 32, args, name_expressions=names)

    launch(good)
    with pytest.raises(TypeError, match="int given int"):
        launch((*good[:4], 8, good[5]))
    with pytest.raises(TypeError, match="float64 array"):
        launch((x.astype(np.float64), *good[1:]))
    with pytest.raises(ValueError, match="not C-contiguous"):
        launch((x.T.copy().T, *good[1:]))
    with pytest.raises(ValueError, match="no kernel 'rms_norm_forward' in the kernel file"):
        launch(good, "swiglu.cu")
    with pytest.raises(TypeError, match=r"mila_bf16\* given a float32 array"):
        launch(good, kernel="rms_norm_forward<mila_bf16>")  # the storage type is checked too
    with pytest.raises(ValueError, match="must be among the launch's name_expressions"):
        _kernels.launch(ctx, file, name, (2,), 32, good)


FENCE_SOURCE = r"""
#define MILA_STRIDED
extern "C" __global__ void fence_read(const float* x, float* out, int n, int shift) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i + shift];
}
extern "C" __global__ void fence_write(const float* x, float* out, int n, int shift) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i + shift] = x[i];
}
extern "C" __global__ void fence_rows(
    MILA_STRIDED float* x, int rows, int width, long long stride, int extra) {
    int r = blockIdx.x, c = threadIdx.x;
    if (r < rows && c < width + extra) x[r * stride + c] = x[r * stride + c] + 1.0f;
}
"""


@pytest.fixture(scope="module")
def fence_library() -> KernelLibrary:
    return KernelLibrary([FENCE_SOURCE])


@pytest.mark.parametrize("shift", [-1, 1])
def test_the_emulator_poisons_reads_outside_an_array(fence_library: KernelLibrary, shift: int):
    """A kernel reading one element before or past its array reads poison (a NaN) instead of
    the neighbouring memory a GPU would hand it; within the array it reads the values."""
    ctx = EmulatedContext()
    block = np.arange(10, dtype=np.float32)
    x = block[1:9]  # real memory on either side: the GPU would read 0 or 9 unseen
    out = np.zeros(8, np.float32)
    fence_library.launch(ctx, "", "fence_read", (1,), 32, (x, out, np.int32(8), np.int32(shift)))
    edge = 0 if shift < 0 else 7
    assert np.isnan(out[edge])
    inside = np.delete(np.arange(8), edge)
    assert np.array_equal(out[inside], x[inside + shift])


@pytest.mark.parametrize("shift", [-1, 1])
def test_the_emulator_refuses_writes_outside_an_array(fence_library: KernelLibrary, shift: int):
    """A kernel writing one element before or past its output raises, and neither the output
    nor its neighbours change."""
    ctx = EmulatedContext()
    block = np.zeros(10, np.float32)
    out = block[1:9]
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(
        RuntimeError,
        match=r"wrote outside the elements of its writeable array argument\(s\) among out:",
    ):
        fence_library.launch(ctx, "", "fence_write", (1,), 32,
                             (x, out, np.int32(8), np.int32(shift)))  # fmt: skip
    assert not block.any()
    fence_library.launch(ctx, "", "fence_write", (1,), 32, (x, out, np.int32(8), np.int32(0)))
    assert np.array_equal(out, x) and block[0] == block[9] == 0


def test_the_emulator_keeps_a_const_array_sharing_memory_with_an_output_read_only(
    fence_library: KernelLibrary,
) -> None:
    """A const input and an output over one buffer (overlapping): the kernel's writes to the
    output land, and a write into the bytes that are the input's alone raises, the buffer as
    it was."""
    ctx = EmulatedContext()
    block = np.arange(12, dtype=np.float32)
    x, out = block[:8], block[4:]
    fence_library.launch(ctx, "", "fence_write", (1,), 32, (x, out, np.int32(4), np.int32(0)))
    assert np.array_equal(block, [0, 1, 2, 3, 0, 1, 2, 3, 8, 9, 10, 11])
    before = block.copy()
    with pytest.raises(RuntimeError, match="in a const array"):
        fence_library.launch(ctx, "", "fence_write", (1,), 32,
                             (x, out, np.int32(4), np.int32(-2)))  # fmt: skip
    assert np.array_equal(block, before)


def test_the_emulator_guards_the_gaps_of_a_strided_view(fence_library: KernelLibrary) -> None:
    """Rows of a wider buffer (Q's view of a fused QKV buffer): a kernel touching the columns
    between the view's rows raises and changes nothing; one that keeps to them writes only
    them, the other columns as they were."""
    ctx = EmulatedContext()
    qkv = np.arange(3 * 12, dtype=np.float32).reshape(3, 12)
    before = qkv.copy()
    q = qkv[:, :4]
    args = (q, np.int32(3), np.int32(4), np.int64(12))
    with pytest.raises(RuntimeError, match=r"wrote outside .* gaps of a strided view"):
        fence_library.launch(ctx, "", "fence_rows", (3,), 32, (*args, np.int32(1)))
    assert np.array_equal(qkv, before)
    fence_library.launch(ctx, "", "fence_rows", (3,), 32, (*args, np.int32(0)))
    assert np.array_equal(qkv[:, :4], before[:, :4] + 1)
    assert np.array_equal(qkv[:, 4:], before[:, 4:])


# --------------------------------------------------------------------------------- compiling
NVCC = shutil.which("nvcc")


def test_every_kernel_file_is_emulated_and_packaged() -> None:
    """Every ``.cu`` file beside the CUDA ops is in the emulator's library, and the package data
    of ``pyproject.toml`` takes it and the header, so an installed package has what
    ``_kernels.source`` reads."""
    import fnmatch
    import tomllib
    from pathlib import Path

    here = Path(_kernels.__file__).parent
    assert sorted(FILES) == sorted(path.name for path in here.glob("*.cu"))
    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mila_py"]
    for path in [*here.glob("*.cu"), here / _kernels.HEADER]:
        name = path.relative_to(root / "mila_py").as_posix()
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
        assert _kernels.source(path.name) == path.read_text()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_sources_compile_for_sm90(tmp_path) -> None:
    """Every kernel file, after the header as NVRTC sees it, compiles for Hopper (one nvcc
    run: each source in a namespace of its own, so none relies on another's helpers), every
    template instantiation the ops launch included, and no kernel spills registers."""
    qualified = [  # each instantiation in its source's namespace, its types too
        f"source{i}::" + re.sub(r"\b(mila_half|mila_bf16)\b", rf"source{i}::\1", name)
        for i, source in enumerate(SOURCES)
        for name in names_in(source)
    ]
    assert len(qualified) == len(NAME_EXPRESSIONS)
    path = tmp_path / "sources.cu"
    path.write_text(
        "\n".join(
            f"namespace source{i} {{\n{_kernels.source(_kernels.HEADER)}{source}\n}}"
            for i, source in enumerate(SOURCES)
        )
        # taking a template kernel's address instantiates it
        + "\nvoid* const mila_instances[] = {\n"
        + ",\n".join(f"    (void*)&{name}" for name in qualified)
        + "\n};\n"
    )
    command = [NVCC, "-std=c++17", "-arch=sm_90", "--resource-usage", "-c", str(path)]
    result = subprocess.run(
        [*command, "-o", str(tmp_path / "sources.o")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    report = result.stdout + result.stderr
    entries = re.findall(r"Compiling entry function '([^']+)'", report)
    assert len(entries) == len(NAME_EXPRESSIONS) + sum(
        source.count('extern "C" __global__') for source in SOURCES
    ), report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(entries), report
    assert all(stores == "0" and loads == "0" for stores, loads in spills), report


def _nvrtc() -> Any:
    """CuPy's NVRTC bindings when they load (no GPU needed), else None."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception:  # no CuPy, or no NVRTC library beside it
        return None
    return nvrtc


NVRTC = _nvrtc()


def _nvrtc_compile(source: str, names: Sequence[str]) -> Any:
    """The NVRTC program of ``source`` as :func:`_kernels.module` hands it to CuPy (header,
    options, name expressions), compiled for sm_90; the test fails on an error or a warning."""
    header = _kernels.source(_kernels.HEADER)
    program = NVRTC.createProgram(header + source, "kernels.cu", [], [])
    for name in names:
        NVRTC.addNameExpression(program, name)
    try:
        NVRTC.compileProgram(program, [*_kernels.NVRTC_OPTIONS, "-arch=sm_90"])
    except NVRTC.NVRTCError as exc:
        pytest.fail(f"{exc}\n{NVRTC.getProgramLog(program)}")
    assert NVRTC.getProgramLog(program).strip() == ""
    return program


@pytest.mark.skipif(NVRTC is None, reason="CuPy's NVRTC is not loadable")
@pytest.mark.parametrize("index", range(len(SOURCES)))
def test_cuda_sources_compile_with_nvrtc(index: int) -> None:
    """Each source compiles as :func:`_kernels.module` hands it to CuPy (header, options, the
    name expressions), with NVRTC and no warning, and every instantiation the ops launch gets a
    lowered name. NVRTC has no host headers, unlike nvcc; this needs no GPU, only CuPy and
    NVRTC (``pip install cupy-cuda13x nvidia-cuda-nvrtc``)."""
    source = SOURCES[index]
    names = names_in(source)
    program = _nvrtc_compile(source, names)
    lowered = [NVRTC.getLoweredName(program, name) for name in names]
    assert len(set(lowered)) == len(names)
    cubin = NVRTC.getCUBIN(program)
    kernels = re.findall(
        r'extern "C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)', source
    )
    assert names or kernels
    for symbol in [*kernels, *lowered]:
        assert symbol.encode() in cubin, symbol
