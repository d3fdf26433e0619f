"""The CUDA ops and a Llama in BF16 and FP16, on the kernel emulator's ``CUDA:0``.

Each CUDA op's 16-bit path (the kernel templates instantiated for ``mila_bf16`` and
``mila_half``, CuPy's 2-D products, attention's float32 copies) against the CPU op in the same
precision: both compute in float32 from the same 16-bit values and round each output once, so
they agree to within one rounding of the storage type (summation orders differ). Also: a
CuPy without bfloat16 arrays is refused BF16 layers, and a 16-bit Llama on the emulated GPU
matches the CPU one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kernel_emulator import COMPILER, EmulatedContext, KernelLibrary, emulated_context

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import (
    LinearConfig,
    Residual,
    ResidualConfig,
    RmsNormConfig,
    SoftmaxCrossEntropyConfig,
)
from mila_py.devices import create_execution_context
from mila_py.models import LlamaConfig
from mila_py.ops.cpu.attention import CpuAttentionOp
from mila_py.ops.cpu.linear import CpuLinearOp
from mila_py.ops.cpu.rms_norm import CpuRmsNormOp
from mila_py.ops.cpu.softmax_cross_entropy import CpuSoftmaxCrossEntropyOp
from mila_py.ops.cpu.swiglu import CpuSwiGLUOp
from mila_py.ops.cpu.token_embedding import CpuTokenEmbeddingOp
from mila_py.ops.cuda.attention import CudaAttentionOp
from mila_py.ops.cuda.linear import CudaLinearOp
from mila_py.ops.cuda.rms_norm import CudaRmsNormOp
from mila_py.ops.cuda.softmax_cross_entropy import CudaSoftmaxCrossEntropyOp
from mila_py.ops.cuda.swiglu import CudaSwiGLUOp
from mila_py.ops.cuda.token_embedding import CudaTokenEmbeddingOp
from mila_py.ops.operation import DecodePositions
from mila_py.ops.registry import OpNotFoundError

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

REDUCED = [Precision.BF16, Precision.FP16]
#: one rounding of the storage type, relative (the two sides may round apart by one unit)
ULP = {Precision.BF16: 2.0**-8, Precision.FP16: 2.0**-10}
#: a whole Llama on the emulated GPU against the CPU one, in the same precision
MODEL_TOL = {Precision.BF16: 2e-2, Precision.FP16: 3e-3}


@pytest.fixture
def ctx(library: KernelLibrary) -> Iterator[EmulatedContext]:
    with emulated_context(library) as context:
        yield context


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(99)


CPU = create_execution_context("CPU")


def values(rng: Any, precision: Precision, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (scale * rng.standard_normal(shape)).astype(precision.numpy_dtype)


def agree(actual: Any, expected: Any, precision: Precision, units: float = 2.0) -> None:
    """Equal to within ``units`` roundings of the storage type, relative to each element or to
    the array's scale (an element that cancels to near zero keeps the scale's error)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.dtype == e.dtype and a.shape == e.shape
    bound = units * ULP[precision] * (np.abs(e) + 0.05 * np.abs(e).max())
    worst = float(np.max(np.abs(a - e) - bound, initial=-1.0))
    assert worst <= 0, f"{precision}: differs by {np.abs(a - e).max():.3g} beyond the bound"


@pytest.mark.parametrize("precision", REDUCED)
def test_linear_in_16_bits_matches_cpu(ctx: EmulatedContext, rng, precision: Precision) -> None:
    p = precision
    x = values(rng, p, 3, 5, 24)
    w = values(rng, p, 24, 16).T  # [out, in], the transposed INFERENCE storage
    b = values(rng, p, 16)
    cfg = LinearConfig(24, 16, bias=True)
    gpu, cpu = CudaLinearOp(ctx, cfg, p), CpuLinearOp(CPU, cfg, p)
    out, ref = (np.empty((3, 5, 16), p.numpy_dtype) for _ in range(2))
    gpu.forward(x, w, b, out)
    cpu.forward(x, w, b, ref)
    agree(out, ref, p)
    # dy in the storage type, then in float32 (taken as it is)
    for dy in (values(rng, p, 3, 5, 16), values(rng, Precision.FP32, 3, 5, 16)):
        dw, dw_ref = (np.zeros((16, 24), np.float32) for _ in range(2))
        db, db_ref = (np.zeros(16, np.float32) for _ in range(2))
        dx, dx_ref = (np.empty((3, 5, 24), p.numpy_dtype) for _ in range(2))
        gpu.backward(x, w, dy, dw, db, dx)
        cpu.backward(x, w, dy, dw_ref, db_ref, dx_ref)
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-5)
        agree(dx, dx_ref, p)


@pytest.mark.parametrize("precision", REDUCED)
def test_rms_norm_in_16_bits_matches_cpu(ctx: EmulatedContext, rng, precision: Precision) -> None:
    p, dim = precision, 300
    cfg = RmsNormConfig(dim, eps=1e-5)
    gpu, cpu = CudaRmsNormOp(ctx, cfg, p), CpuRmsNormOp(CPU, cfg, p)
    x = values(rng, p, 7, dim, scale=3.0)
    w = (rng.standard_normal(dim) + 1).astype(p.numpy_dtype)
    y, y_ref = (np.empty((7, dim), p.numpy_dtype) for _ in range(2))
    r, r_ref = (np.empty(7, np.float32) for _ in range(2))
    gpu.forward(x, w, y, r)
    cpu.forward(x, w, y_ref, r_ref)
    agree(y, y_ref, p)
    np.testing.assert_allclose(r, r_ref, rtol=1e-6)
    dy = values(rng, p, 7, dim)
    dw, dw_ref = (np.zeros(dim, np.float32) for _ in range(2))
    dx, dx_ref = (np.empty((7, dim), p.numpy_dtype) for _ in range(2))
    gpu.backward(x, w, r, dy, dw, dx)
    cpu.backward(x, w, r_ref, dy, dw_ref, dx_ref)
    agree(dx, dx_ref, p)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    assert (
        ctx.launches[0]
        == f"rms_norm_forward<{'mila_bf16' if p is Precision.BF16 else 'mila_half'}>"
    )


@pytest.mark.parametrize("precision", REDUCED)
def test_swiglu_in_16_bits_matches_cpu(ctx: EmulatedContext, rng, precision: Precision) -> None:
    p = precision
    gpu, cpu = CudaSwiGLUOp(ctx, None, p), CpuSwiGLUOp(CPU, None, p)
    g, u = values(rng, p, 3, 4, 50, scale=4.0), values(rng, p, 3, 4, 50)
    h, h_ref = (np.empty_like(g) for _ in range(2))
    gpu.forward(g, u, h)
    cpu.forward(g, u, h_ref)
    agree(h, h_ref, p)
    dh = values(rng, p, 3, 4, 50)
    du, du_ref = (np.empty_like(g) for _ in range(2))
    dg, dg_ref = dh.copy(), dh.copy()  # dgate is dh itself, as the component calls it
    gpu.backward(g, u, dg, dg, du)
    cpu.backward(g, u, dg_ref, dg_ref, du_ref)
    agree(dg, dg_ref, p)
    agree(du, du_ref, p)


@pytest.mark.parametrize("precision", REDUCED)
def test_token_embedding_in_16_bits_matches_cpu(
    ctx: EmulatedContext, rng, precision: Precision
) -> None:
    """The lookup copies the 16-bit rows; the gradient sums them into float32."""
    p = precision
    gpu, cpu = CudaTokenEmbeddingOp(ctx, None, p), CpuTokenEmbeddingOp(CPU, None, p)
    weight = values(rng, p, 11, 64)
    tokens = np.array([[3, 3, 0, 10], [3, 7, 7, 0]])
    out, ref = (np.empty((2, 4, 64), p.numpy_dtype) for _ in range(2))
    gpu.forward(tokens, weight, out)
    cpu.forward(tokens, weight, ref)
    np.testing.assert_array_equal(out, ref)
    dy = values(rng, p, 2, 4, 64)
    dw, dw_ref = (np.zeros((11, 64), np.float32) for _ in range(2))
    gpu.backward(tokens, dy, dw)
    cpu.backward(tokens, dy, dw_ref)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", REDUCED)
def test_softmax_cross_entropy_of_16_bit_logits_matches_cpu(
    ctx: EmulatedContext, rng, precision: Precision
) -> None:
    p, vocab = precision, 300
    cfg = SoftmaxCrossEntropyConfig(vocab)
    gpu, cpu = CudaSoftmaxCrossEntropyOp(ctx, cfg, p), CpuSoftmaxCrossEntropyOp(CPU, cfg, p)
    logits = values(rng, p, 2, 5, vocab, scale=5.0)
    targets = rng.integers(0, vocab, (2, 5))
    targets[1, 2] = -100
    lse, lse_ref = (np.empty((2, 5), np.float32) for _ in range(2))
    loss, count = gpu.forward(logits, targets, lse)
    loss_ref, count_ref = cpu.forward(logits, targets, lse_ref)
    assert count == count_ref == 9
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
    d, d_ref = (np.empty((2, 5, vocab), p.numpy_dtype) for _ in range(2))
    gpu.backward(logits, targets, lse, d, 0.1)
    cpu.backward(logits, targets, lse_ref, d_ref, 0.1)
    agree(d, d_ref, p)
    assert not d[1, 2].astype(np.float32).any()


def _qkv(rng: Any, p: Precision, n_b: int, n_t: int, hq: int, hk: int, d: int) -> Any:
    qkv = values(rng, p, n_b, n_t, (hq + 2 * hk) * d)
    return qkv, qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d], qkv[..., (hq + hk) * d :]


def _split(buf: Any, hq: int, hk: int, d: int) -> tuple[Any, Any, Any]:
    return buf[..., : hq * d], buf[..., hq * d : (hq + hk) * d], buf[..., (hq + hk) * d :]


@pytest.mark.parametrize("precision", REDUCED)
def test_attention_in_16_bits_matches_cpu(ctx: EmulatedContext, rng, precision: Precision) -> None:
    """Training forward (float32 probabilities) and backward, and a prefill chunk at an
    offset into a 16-bit cache."""
    p, hq, hk, d, n_b, n_t, scale = precision, 4, 2, 8, 2, 9, 0.41
    qkv, q, k, v = _qkv(rng, p, n_b, n_t, hq, hk, d)
    gpu, cpu = CudaAttentionOp(ctx, None, p), CpuAttentionOp(CPU, None, p)
    probs, probs_ref = (np.empty((n_b, hk, hq // hk, n_t, n_t), np.float32) for _ in range(2))
    out, out_ref = (np.empty((n_b, n_t, hq * d), p.numpy_dtype) for _ in range(2))
    gpu.forward(q, k, v, hq, hk, scale, out=out, probs=probs)
    cpu.forward(q, k, v, hq, hk, scale, out=out_ref, probs=probs_ref)
    np.testing.assert_allclose(probs, probs_ref, rtol=1e-5, atol=1e-6)
    agree(out, out_ref, p)
    dout = values(rng, p, n_b, n_t, hq * d)
    dqkv, dqkv_ref = np.zeros_like(qkv), np.zeros_like(qkv)
    gpu.backward(dout, q, k, v, probs_ref, hq, hk, scale, *_split(dqkv, hq, hk, d), out=out_ref)
    cpu.backward(dout, q, k, v, probs_ref, hq, hk, scale, *_split(dqkv_ref, hq, hk, d), out=out_ref)
    agree(dqkv, dqkv_ref, p)
    cache = values(rng, p, n_b, 20, 2 * hk * d)
    keys, vals = cache[:, :12, : hk * d], cache[:, :12, hk * d :]
    part = q[:, :3]
    chunk, chunk_ref = (np.empty((n_b, 3, hq * d), p.numpy_dtype) for _ in range(2))
    gpu.prefill(part, keys, vals, hq, hk, scale, chunk, 9)
    cpu.prefill(part, keys, vals, hq, hk, scale, chunk_ref, 9)
    agree(chunk, chunk_ref, p)


@pytest.mark.parametrize("precision", REDUCED)
def test_decode_kernels_in_16_bits_match_cpu(
    ctx: EmulatedContext, rng, precision: Precision
) -> None:
    """``kv_cache_write<T>`` and ``attention_decode<T>`` (the 16-bit cache read as it is)
    against the CPU op's decode plan on the same 16-bit values, uniform and ragged."""
    p, hq, hk, d, n_b, t_max, scale = precision, 6, 2, 16, 3, 40, 0.37
    _, q, k_new, v_new = _qkv(rng, p, n_b, 1, hq, hk, d)
    caches = {side: [values(rng, p, n_b, t_max, hk * d) for _ in range(2)] for side in "gc"}
    caches["c"] = [c.copy() for c in caches["g"]]
    outs = {side: np.zeros((n_b, 1, hq * d), p.numpy_dtype) for side in "gc"}
    steps = {}
    cells = {}
    for side, op, device in (
        ("g", CudaAttentionOp(ctx, None, p), ctx),
        ("c", CpuAttentionOp(CPU, None, p), None),
    ):
        cells[side] = cell = DecodePositions(n_b, device)
        kc, vc = caches[side]
        write = op.bind_cache_write(k_new[:, 0], v_new[:, 0], kc, vc, cell)
        attend = op.bind_decode(q, kc, vc, hq, hk, scale, outs[side], cell)
        steps[side] = (write, attend)
    for positions in ([7, 7, 7], [3, 30, 12]):
        pos = np.array(positions)
        for side in "gc":
            cells[side].set(pos, int(pos.min()), int(pos.max()))
            for step in steps[side]:
                step()
        for g, c in zip(caches["g"], caches["c"], strict=True):
            np.testing.assert_array_equal(g, c)
        agree(outs["g"], outs["c"], p)
    tag = "mila_bf16" if p is Precision.BF16 else "mila_half"
    assert {f"attention_decode<{tag}>", f"kv_cache_write<{tag}>"} <= set(ctx.launches)


@pytest.mark.parametrize("precision", REDUCED)
def test_residual_in_16_bits_matches_cpu(cuda: None, rng, precision: Precision) -> None:
    p = precision
    for scale in (1.0, 0.3):
        outs = []
        for device in ("CUDA:0", "CPU"):
            res = Residual("res", ResidualConfig(24, scale=scale), device=device, precision=p)
            res.build(BuildContext((2, 3, 24), RuntimeMode.TRAINING))
            data = np.random.default_rng(3)
            outs.append(res.forward(values(data, p, 2, 3, 24), values(data, p, 2, 3, 24)).copy())
        agree(outs[0], outs[1], p, units=1.0)


def test_bf16_layers_need_cupy_bfloat16_arrays(ctx: EmulatedContext) -> None:
    """A CuPy that carries bfloat16 as uint16 bits cannot run the layers' products and sums in
    BF16: the op is refused when made, naming the precisions that work."""
    ctx.bfloat16_native = False
    for op in (CudaLinearOp, CudaRmsNormOp, CudaAttentionOp):
        with pytest.raises(OpNotFoundError, match="CuPy >= 14") as info:
            op(ctx, None, Precision.BF16)
        assert info.value.other_precisions == {Precision.FP32, Precision.FP16}
    CudaRmsNormOp(ctx, RmsNormConfig(4), Precision.FP16)  # FP16 needs no bfloat16 type


CFG = LlamaConfig(
    vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


def rel_err(actual: Any, expected: Any) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.linalg.norm(a), np.linalg.norm(e))
    return 0.0 if scale == 0 else float(np.linalg.norm(a - e) / scale)
