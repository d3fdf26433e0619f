"""RmsNorm: forward against HF's formula (NumPy float64 and torch), gradients, lifecycle, memory,
on every device (``device``: CPU, CUDA:0, emulated CUDA:0); the NumPy op's own float64 math
stays on the CPU, ``test_cuda_op_*`` check the CUDA op against the CPU op."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import (
    EMULATED,
    PRECISIONS_16,
    REDUCED_PARAMS,
    agree,
    array_module,
    close,
    context,
    cupy,
    dev,
    host,
    on,
    skip_bf16_without_arrays,
)
from layer_helpers import (
    ATOL32,
    INFERENCE,
    TRAINING,
    assert_gradients,
    assert_unchanged,
    built,
    check_16_bit_twin,
    distinct_nbytes,
    f32,
    owned_arrays,
    rel_err,
    snapshot,
    tolerances,
)

from mila_py import BuildContext, Precision, TrainingMode
from mila_py.components import RmsNorm, RmsNormConfig
from mila_py.devices import create_execution_context
from mila_py.ops.cpu.rms_norm import rms_norm_backward, rms_norm_forward
from mila_py.ops.cuda import rms_norm as cuda_rms_norm
from mila_py.ops.registry import create_op

B, T, D = 3, 5, 8
EPS = 1e-5
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(4321)


def make(mode=TRAINING, shape=(B, T, D), eps: float = EPS, device: str = "CPU", **kw) -> RmsNorm:
    return built(RmsNorm("norm", RmsNormConfig(D, eps), device=device), shape, mode, **kw)


def reference(x: np.ndarray, w: np.ndarray, eps: float = EPS) -> np.ndarray:
    """HF's RMSNorm in float64 (arrays on any device)."""
    x = host(x).astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * host(w)


def random_weight(norm: RmsNorm, rng: np.random.Generator, device: str = "CPU") -> None:
    norm.weight[...] = on(device, rng.uniform(0.5, 1.5, D).astype(np.float32))


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"dim": 0}, ValueError),
        ({"dim": 4.0}, TypeError),
        ({"dim": 4, "eps": 0.0}, ValueError),
        ({"dim": 4, "eps": -1e-6}, ValueError),
        ({"dim": 4, "eps": float("nan")}, ValueError),
        ({"dim": 4, "eps": "1e-5"}, TypeError),
    ],
)
def test_config_rejects_bad_values(kwargs, error) -> None:
    with pytest.raises(error, match="RmsNormConfig"):
        RmsNormConfig(**kwargs)


def test_construction_allocates_nothing_in_every_cpu_precision() -> None:
    norm = RmsNorm("norm", RmsNormConfig(D), device="CPU")
    assert not norm.is_built and norm.get_memory_stats().total_bytes == 0
    for precision in Precision:  # every one the CPU stores, 16-bit storage included
        norm = RmsNorm("norm", RmsNormConfig(D), device="CPU", precision=precision)
        assert norm.precision is precision and norm.get_memory_stats().total_bytes == 0


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("lead", [(B, T), (1, 1), (2, 3)])
def test_forward_matches_float64_reference(device, lead, rng) -> None:
    norm = make(device=device)
    random_weight(norm, rng, device)
    x = (rng.standard_normal((*lead, D)) * 3 + 0.5).astype(np.float32)
    y = norm.forward(on(device, x))
    assert y.shape == x.shape and y.dtype == np.float32
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(y, owned_arrays(norm)["s:norm.output"])
    np.testing.assert_allclose(host(y), reference(x, norm.weight), **tolerances(device))


def test_forward_matches_torch_llama_rms_norm(device, rng) -> None:
    torch = pytest.importorskip("torch")
    norm = make(device=device)
    random_weight(norm, rng, device)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    # transformers' LlamaRMSNorm.forward, written out
    h = torch.from_numpy(x).to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    expected = torch.from_numpy(host(norm.weight).copy()) * h
    tol = {"rtol": 1e-6, "atol": 1e-6} if device == "CPU" else tolerances(device)
    np.testing.assert_allclose(host(norm.forward(on(device, x))), expected.numpy(), **tol)


def test_weight_initialized_to_ones_and_large_or_tiny_rows(device, rng) -> None:
    norm = make(device=device)
    np.testing.assert_array_equal(host(norm.weight), np.ones(D, np.float32))
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    x[0] *= 1e15  # squares near the float32 limit stay finite
    x[1] *= 1e-3
    tol = {"rtol": 1e-5, "atol": 1e-6} if device == "CPU" else tolerances(device)
    np.testing.assert_allclose(host(norm.forward(on(device, x))), reference(x, norm.weight), **tol)
    assert not host(make(mode=INFERENCE, device=device).weight).any()  # expects loaded weights


@pytest.mark.parametrize("magnitude", [3e17, 1e20, 1e-25])
def test_rows_whose_float32_squares_overflow_or_underflow(device, rng, magnitude: float) -> None:
    """The op sums the squares in float64 on every device (the CPU's NumPy function and fused
    kernel, the CUDA kernel in double): in float32 a row of 3e17 gave y = 0 (the sum overflowed)
    and one of 1e-25 came out 16% low (the squares vanished). ``eps`` is taken in float32, as
    torch's RMSNorm adds it to a float32 mean square: a ``1e-45`` is ``2^-149``, which outweighs
    those rows' mean square (a float64 ``1e-45`` would give outputs 18% larger)."""
    eps = 1e-45 if magnitude < 1 else 1e-5
    x = (f32(rng, 3, 64) * magnitude).astype(np.float32)
    w = np.ones(64, np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + float(np.float32(eps)))
    op = create_op("RmsNormOp", context(device), RmsNormConfig(64, eps=eps), Precision.FP32)
    xp = array_module(device)
    y, r = xp.empty((3, 64), xp.float32), xp.empty(3, xp.float32)
    op.forward(on(device, x), on(device, w), y, r)
    np.testing.assert_allclose(host(y), want, rtol=1e-5)
    if device == "CPU":  # the NumPy function too (the op runs the fused kernel where it can)
        y, r = np.empty_like(x), np.empty(3, np.float32)
        rms_norm_forward(x, w, eps, y, r)
        np.testing.assert_allclose(y, want, rtol=1e-5)


def test_backward_float64_matches_finite_differences(rng) -> None:
    x = rng.standard_normal((2, 3, 6)) + 0.3
    w = rng.uniform(0.5, 1.5, 6)
    r = rng.standard_normal((2, 3, 6))
    eps = 1e-2  # a large eps makes its contribution to the derivative visible

    def objective() -> float:
        y, rstd = np.empty_like(x), np.empty(x.shape[:-1])
        rms_norm_forward(x, w, eps, y, rstd)
        return float(np.sum(y * r))

    y, rstd = np.empty_like(x), np.empty(x.shape[:-1])
    rms_norm_forward(x, w, eps, y, rstd)
    np.testing.assert_allclose(y, reference(x, w, eps), rtol=1e-14)
    dw, dx = np.zeros_like(w), np.empty_like(x)
    rms_norm_backward(x, w, rstd, r, dw, dx)
    assert_gradients(objective, {"x": (x, dx), "weight": (w, dw)})


def test_component_gradients_match_float64_backward(device, rng) -> None:
    norm = make(device=device)
    random_weight(norm, rng, device)
    x = rng.standard_normal((2, 4, D)).astype(np.float32)
    dy = rng.standard_normal((2, 4, D)).astype(np.float32)
    norm.forward(on(device, x))
    dx = norm.backward(on(device, dy))
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(dx, owned_arrays(norm)["s:norm.dinput"])
    x64, w64 = x.astype(np.float64), host(norm.weight).astype(np.float64)
    rstd, dw64, dx64 = np.empty((2, 4)), np.zeros(D), np.empty_like(x64)
    rms_norm_forward(x64, w64, EPS, np.empty_like(x64), rstd)
    rms_norm_backward(x64, w64, rstd, dy.astype(np.float64), dw64, dx64)
    np.testing.assert_allclose(host(dx), dx64, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(norm.get_gradients()[0]), dw64, rtol=1e-4, atol=1e-5)


def test_gradients_accumulate_and_zero(device, rng) -> None:
    norm = make(device=device)
    x = on(device, rng.standard_normal((B, T, D)).astype(np.float32))
    dy = on(device, rng.standard_normal((B, T, D)).astype(np.float32))
    norm.forward(x)
    dx1 = host(norm.backward(dy)).copy()
    once = host(norm.get_gradients()[0]).copy()
    np.testing.assert_array_equal(host(norm.backward(dy)), dx1)
    np.testing.assert_allclose(host(norm.get_gradients()[0]), 2 * once, rtol=1e-6)
    norm.zero_gradients()
    assert not host(norm.get_gradients()[0]).any()


def test_eval_mode_runs_as_normal_mode(device, rng) -> None:
    """EVAL changes nothing RMSNorm computes: the same output and gradients as a NORMAL twin."""
    norm, twin = make(device=device), make(device=device)
    random_weight(norm, rng, device)
    twin.weight[...] = norm.weight
    norm.set_training_mode(TrainingMode.EVAL)
    x = on(device, rng.standard_normal((1, 2, D)).astype(np.float32))
    np.testing.assert_array_equal(host(norm.forward(x)), host(twin.forward(x)))
    dy = on(device, rng.standard_normal((1, 2, D)).astype(np.float32))
    np.testing.assert_array_equal(host(norm.backward(dy)), host(twin.backward(dy)))
    np.testing.assert_array_equal(host(norm.get_gradients()[0]), host(twin.get_gradients()[0]))


# ------------------------------------------------------------------------------- lifecycle
def test_inference_build_has_no_gradients_and_backward_raises(device, rng) -> None:
    norm = make(mode=INFERENCE, device=device)
    assert norm.get_gradients() == []
    norm.forward(on(device, rng.standard_normal((B, T, D)).astype(np.float32)))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        norm.backward(on(device, np.zeros((B, T, D), np.float32)))


def test_backward_before_forward_raises(device) -> None:
    with pytest.raises(RuntimeError, match="forward"):
        make(device=device).backward(on(device, np.zeros((B, T, D), np.float32)))


@pytest.mark.parametrize(
    ("x", "error"),
    [
        (np.ones((B, T, D), np.float16), TypeError),
        (np.ones((B, T, D - 1), np.float32), ValueError),
        (np.ones((B + 1, T, D), np.float32), ValueError),
        (np.ones((T, D), np.float32), ValueError),
    ],
    ids=["dtype", "width", "batch", "rank"],
)
def test_bad_forward_leaves_everything_unchanged(device, x, error, rng) -> None:
    norm = make(device=device)
    norm.forward(on(device, rng.standard_normal((B, T, D)).astype(np.float32)))
    norm.backward(on(device, np.ones((B, T, D), np.float32)))
    x = on(device, x)
    saved = snapshot(norm, x)
    with pytest.raises(error):
        norm.forward(x)
    assert_unchanged(norm, saved, x)


def test_own_output_as_input_is_refused(device, rng) -> None:
    norm = make(device=device)
    y = norm.forward(on(device, rng.standard_normal((B, T, D)).astype(np.float32)))
    saved = snapshot(norm)
    with pytest.raises(ValueError, match="overlaps"):
        norm.forward(y)
    assert_unchanged(norm, saved)
    want = reference(y, norm.weight)
    tol = {"atol": ATOL32} if device == "CPU" else tolerances(device)
    np.testing.assert_allclose(host(norm.forward(y.copy())), want, **tol)


def test_bad_backward_leaves_everything_unchanged(device, rng) -> None:
    norm = make(device=device)
    norm.forward(on(device, rng.standard_normal((1, 2, D)).astype(np.float32)))
    for dy_host in (np.ones((1, 3, D), np.float32), np.ones((1, 2, D), np.float64)):
        dy = on(device, dy_host)
        saved = snapshot(norm, dy)
        error, message = (TypeError, "dtype") if dy.dtype == np.float64 else (ValueError, "shape")
        with pytest.raises(error, match=message):
            norm.backward(dy)
        assert_unchanged(norm, saved, dy)


def test_bad_build_shape_rolls_back(device) -> None:
    norm = RmsNorm("norm", RmsNormConfig(D), device=device)
    with pytest.raises(ValueError, match="input_shape"):
        norm.build(BuildContext((B, T, D + 1), TRAINING))
    assert not norm.is_built and norm.get_memory_stats().total_bytes == 0
    built(norm, (B, T, D))


@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_stats_count_every_owned_array_once(device, mode) -> None:
    norm = make(mode, device=device)
    stats = norm.get_memory_stats()
    assert stats.parameter_bytes == D * 4
    assert stats.gradient_bytes == (D * 4 if mode is TRAINING else 0)
    # output [B, T, D] + rstd [B, T] (+ dinput [B, T, D])
    assert stats.state_bytes == (B * T * D + B * T + (B * T * D if mode is TRAINING else 0)) * 4
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(norm).values()))


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_its_float64_twin(device, precision: Precision, rng) -> None:
    """A 16-bit RmsNorm against the float64 CPU layer of the same values, forward and
    backward (see :func:`check_16_bit_twin`)."""
    skip_bf16_without_arrays(device, precision)
    check_16_bit_twin(
        lambda p, d: RmsNorm("norm", RmsNormConfig(24), device=d, precision=p),
        (2, 3, 24),
        lambda rng, dtype: ((3 * rng.standard_normal((2, 3, 24))).astype(dtype),),
        device,
        precision,
        rng,
    )


# ------------------------------------------------------------------ CUDA op against the CPU op


@pytest.mark.parametrize(("n_rows", "dim"), [(1, 5), (7, 40), (37, 300), (300, 1000)])
def test_cuda_op_forward_and_backward_match_the_cpu_op(
    cuda_ctx, rng, n_rows: int, dim: int
) -> None:
    """Rows of a wider buffer (every other row: not contiguous) in; the weight gradient
    accumulates into the given one (column sums of ``n_rows`` terms, in another order)."""
    op = create_op("RmsNormOp", cuda_ctx, RmsNormConfig(dim, 1e-5), Precision.FP32)
    big, w = f32(rng, n_rows, 2, dim, scale=3.0), f32(rng, dim) + 1
    x = big[:, 0]
    gx = dev(big)[:, 0]
    y, r = cupy.empty((n_rows, dim), cupy.float32), cupy.empty(n_rows, cupy.float32)
    op.forward(gx, dev(w), y, r)
    y_ref, r_ref = np.empty((n_rows, dim), np.float32), np.empty(n_rows, np.float32)
    rms_norm_forward(x, w, 1e-5, y_ref, r_ref)
    close(y, y_ref)
    close(r, r_ref)
    dy, dw0 = f32(rng, n_rows, dim), f32(rng, dim)
    dw, dx = dev(dw0), cupy.empty((n_rows, dim), cupy.float32)
    op.backward(gx, dev(w), r, dev(dy), dw, dx)
    dx_ref = np.empty_like(y_ref)
    rms_norm_backward(x, w, r_ref, dy, dw0, dx_ref)
    close(dx, dx_ref, atol=1e-5)
    assert rel_err(host(dw), dw0) < 1e-5
    if EMULATED:
        assert cuda_ctx.launches == [
            "rms_norm_forward<float>",
            "rms_norm_backward_dx<float>",
            "rms_norm_backward_dw<float>",
        ]


def test_cuda_weight_gradient_chunks_cover_every_row() -> None:
    for n_rows in (1, 7, 8, 9, 4095, 4096, 4097, 100_000):
        per, chunks = cuda_rms_norm.dweight_chunks(n_rows)
        assert per * chunks >= n_rows > per * (chunks - 1)
        assert chunks <= 512


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_in_16_bits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """``rms_norm_*<mila_bf16 | mila_half>`` against the CPU op in the same precision: the
    16-bit output and input gradient to a rounding, rstd and the weight gradient in float32."""
    p, dtype, dim = precision, precision.numpy_dtype, 300
    cfg = RmsNormConfig(dim, eps=1e-5)
    gpu, cpu = create_op("RmsNormOp", cuda_ctx, cfg, p), create_op("RmsNormOp", CPU, cfg, p)
    x, w = f32(rng, 7, dim, scale=3.0).astype(dtype), (f32(rng, dim) + 1).astype(dtype)
    gx, gw = dev(x), dev(w)
    y, y_ref = cupy.empty((7, dim), dtype), np.empty((7, dim), dtype)
    r, r_ref = cupy.empty(7, cupy.float32), np.empty(7, np.float32)
    gpu.forward(gx, gw, y, r)
    cpu.forward(x, w, y_ref, r_ref)
    agree(y, y_ref, p)
    close(r, r_ref, rtol=1e-6, atol=0.0)
    dy = f32(rng, 7, dim).astype(dtype)
    dw, dw_ref = cupy.zeros(dim, cupy.float32), np.zeros(dim, np.float32)
    dx, dx_ref = cupy.empty((7, dim), dtype), np.empty((7, dim), dtype)
    gpu.backward(gx, gw, r, dev(dy), dw, dx)
    cpu.backward(x, w, r_ref, dy, dw_ref, dx_ref)
    agree(dx, dx_ref, p)
    close(dw, dw_ref, rtol=1e-5, atol=1e-5)
    if EMULATED:
        tag = "mila_bf16" if p is Precision.BF16 else "mila_half"
        assert cuda_ctx.launches[0] == f"rms_norm_forward<{tag}>"
