"""Residual: ``y = x + scale * f`` against float64, gradients by finite differences, checks that
leave everything untouched, memory, on every device (``device``: CPU, CUDA:0, emulated CUDA:0);
``test_cpu_*`` check what only the CPU has (FP64, NumPy's buffer identity), ``test_cuda_*`` the
CUDA component against the CPU one on ``CUDA:0``."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import (
    EMULATED,
    PRECISIONS_16,
    agree,
    dev,
    host,
    on,
    skip_bf16_without_arrays,
)
from layer_helpers import (
    INFERENCE,
    TRAINING,
    assert_gradients,
    assert_unchanged,
    built,
    check_16_bit_twin,
    distinct_nbytes,
    owned_arrays,
    snapshot,
)

from mila_py import Precision
from mila_py.components import Residual, ResidualConfig

B, T, D = 2, 5, 6


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(77)


def make(
    scale: float = 1.0, mode=TRAINING, precision=Precision.FP32, device: str = "CPU"
) -> Residual:
    return built(
        Residual("res", ResidualConfig(D, scale), device=device, precision=precision),
        (B, T, D),
        mode,
    )


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP64], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.5, -2.0])
def test_forward_matches_float64_and_calls_may_be_smaller(device, precision, scale, rng) -> None:
    """On every device in FP32 (FP64 is the CPU's alone); a smaller call than the build
    writes a view of the component's output buffer."""
    if precision is Precision.FP64 and device != "CPU":
        pytest.skip("FP64 is a CPU precision")
    res = make(scale, precision=precision, device=device)
    dtype = precision.numpy_dtype
    for shape in ((B, T, D), (1, 3, D)):
        x, f = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
        y = res.forward(on(device, x), on(device, f))
        assert y.shape == shape and y.dtype == dtype
        want = x.astype(np.float64) + scale * f.astype(np.float64)
        np.testing.assert_allclose(host(y), want, 1e-6)
        if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
            assert np.shares_memory(y, res._state["output"])


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_backward_matches_float64(device, scale, rng) -> None:
    """``dx = dy`` and ``df = scale * dy`` on every device."""
    res = make(scale, device=device)
    x, f, dy = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(3))
    res.forward(on(device, x), on(device, f))
    dx, df = res.backward(on(device, dy))
    np.testing.assert_array_equal(host(dx), dy)
    np.testing.assert_allclose(host(df), scale * dy.astype(np.float64), 1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_cpu_float64_gradients_match_finite_differences(scale, rng) -> None:
    res = make(scale, precision=Precision.FP64)
    x, f = rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))
    w = rng.standard_normal((B, T, D))

    def objective() -> float:
        return float((res.forward(x, f) * w).sum())

    objective()
    dx, df = res.backward(w.copy())
    dx, df = dx.copy(), df.copy()
    assert_gradients(objective, {"x": (x, dx), "f": (f, df)})
    if scale == 1:  # the gradient passes through: no arithmetic, no buffer
        dy = w.copy()
        res.forward(x, f)
        both = res.backward(dy)
        assert both[0] is dy and both[1] is dy
        assert "dbranch" not in res._state


def test_bad_input_is_refused_and_leaves_everything_untouched(device, rng) -> None:
    res = make(0.5, device=device)
    x_host, f_host = (
        rng.standard_normal((B, T, D)).astype(np.float32),
        rng.standard_normal((B, T, D)),
    )
    x, f, f32 = on(device, x_host), on(device, f_host), on(device, f_host.astype(np.float32))
    res.forward(x, f32)
    saved = snapshot(res, x)
    bad = [
        ((x, f), TypeError, "dtype"),  # f is float64
        ((x, f32[:, :2]), ValueError, "one shape"),
        ((x[..., :4], f32[..., :4]), ValueError, str(D)),
        ((on(device, np.zeros((B + 1, T, D), np.float32)),) * 2, ValueError, "exceeds"),
        ((x_host.tolist(), f), TypeError, "array"),
    ]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            res.forward(*args)
        assert_unchanged(res, saved, x)
    with pytest.raises(ValueError):
        res.backward(on(device, np.zeros((B, T + 1, D), np.float32)))
    with pytest.raises(RuntimeError, match="TRAINING"):
        make(mode=INFERENCE, device=device).backward(x)


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_is_the_output_and_the_scaled_gradient(device, scale, mode) -> None:
    res = make(scale, mode, device=device)
    stats = res.get_memory_stats()
    buffers = 2 if mode is TRAINING and scale != 1 else 1
    assert stats.state_bytes == buffers * B * T * D * 4
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(res).values()))
    if device == "CPU" or not EMULATED:  # the emulator's device arrays are NumPy's: "host"
        assert stats.host_total_bytes == 0
    assert res.parameter_count() == 0 and res.get_gradients() == []


def test_config_is_validated() -> None:
    for bad, error in ((0, ValueError), (2.0, TypeError)):
        with pytest.raises(error):
            ResidualConfig(bad)  # type: ignore[arg-type]
    for bad_scale, error in ((float("nan"), ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error):
            ResidualConfig(4, bad_scale)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_cuda_op_equals_cpu(cuda_device: str, scale, rng) -> None:
    """The CUDA component against the CPU one: bit for bit on the kernel emulator (the same
    array code on NumPy), to one float32 rounding on a GPU (whose compiler may fuse the
    multiply and the add into one FMA)."""
    gpu, cpu = make(scale, device=cuda_device), make(scale)
    assert type(gpu._op).__name__ == "CudaResidualOp"
    x, f, dy = (rng.standard_normal((B, T, D)).astype(np.float32) for _ in range(3))
    rtol, atol = (0.0, 0.0) if EMULATED else (2.0**-23, 1e-6)
    np.testing.assert_allclose(host(gpu.forward(dev(x), dev(f))), cpu.forward(x, f), rtol, atol)
    for a, b in zip(gpu.backward(dev(dy)), cpu.backward(dy), strict=True):
        np.testing.assert_allclose(host(a), b, rtol, atol)


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_float64(
    device: str, scale: float, precision: Precision, rng
) -> None:
    """16-bit inputs summed in float32 and rounded once (to a rounding of the float64 sum);
    forward and backward against the float64 CPU component (see :func:`check_16_bit_twin`)."""
    skip_bf16_without_arrays(device, precision)
    res = make(scale, precision=precision, device=device)
    x, f = (rng.standard_normal((B, T, D)).astype(precision.numpy_dtype) for _ in range(2))
    want = x.astype(np.float64) + scale * f.astype(np.float64)
    agree(res.forward(on(device, x), on(device, f)), want, precision, units=1.0)
    check_16_bit_twin(
        lambda p, d: Residual("res", ResidualConfig(24, scale), device=d, precision=p),
        (2, 3, 24),
        lambda rng, dtype: tuple(rng.standard_normal((2, 3, 24)).astype(dtype) for _ in "xf"),
        device,
        precision,
        rng,
    )
