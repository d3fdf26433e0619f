"""Fused Numba kernels of the row-wise layers against the NumPy reference functions."""

from __future__ import annotations

import numpy as np
import pytest

from mila_py import BuildContext, RuntimeMode
from mila_py.components import RmsNorm, RmsNormConfig, SwiGLU, SwiGLUConfig
from mila_py.ops.cpu import _fused_layers, _fused_math
from mila_py.ops.cpu.rms_norm import CpuRmsNormOp, rms_norm_backward, rms_norm_forward
from mila_py.ops.cpu.swiglu import swiglu_backward, swiglu_forward

pytestmark = pytest.mark.skipif(not _fused_layers.AVAILABLE, reason="Numba is not installed")

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-6, np.float64: 1e-14}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384), (7, 33), (64, 256)])
def test_rms_norm_rows_equals_the_numpy_forward(dtype, shape) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, size=(shape[0], 1))).astype(dtype)
    w = rng.standard_normal(shape[1]).astype(dtype)
    ref, ref_r = np.empty_like(x), np.empty(shape[0], dtype)
    rms_norm_forward(x, w, 1e-5, ref, ref_r)
    got, got_r = np.full_like(x, np.nan), np.full(shape[0], np.nan, dtype)
    _fused_layers.rms_norm_rows(x, w, 1e-5, got, got_r, _fused_math.storage(dtype))
    np.testing.assert_allclose(got_r, ref_r, rtol=TOL[dtype])
    np.testing.assert_allclose(got, ref, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(ref).max())
    # and against the formula in float64
    x64 = x.astype(np.float64)
    r64 = 1 / np.sqrt((x64 * x64).mean(axis=1) + 1e-5)
    np.testing.assert_allclose(got_r, r64, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_rows_equals_the_numpy_forward_including_saturation(dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((9, 130)) * 8).astype(dtype)
    g[0, :4] = [-1000.0, 1000.0, 0.0, -0.0]  # exp overflows for -1000: silu -> -0, not NaN
    u = rng.standard_normal((9, 130)).astype(dtype)
    ref = np.empty_like(g)
    swiglu_forward(g, u, ref)
    got = np.full_like(g, np.nan)
    _fused_layers.swiglu_rows(g, u, got, dtype(1.0), _fused_math.storage(dtype))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_packed_rows_reads_gate_then_up_from_each_row(dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    both = (rng.standard_normal((7, 2 * 130)) * 8).astype(dtype)
    both[0, :2] = [-1000.0, 1000.0]
    ref = np.empty((7, 130), dtype)
    swiglu_forward(both[:, :130], both[:, 130:], ref)
    got = np.full_like(ref, np.nan)
    _fused_layers.swiglu_packed_rows(both, got, dtype(1.0), _fused_math.storage(dtype))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_the_packed_swiglu_step_agrees_on_both_backends(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed INFERENCE SwiGLU's bound step for several rows (gate and up strided halves of
    one buffer) equals the component call, with and without the fused kernels."""
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", backend)
    mlp = SwiGLU("mlp", SwiGLUConfig(48, 64), device="CPU")
    mlp.build(BuildContext((4, 3, 48), RuntimeMode.INFERENCE))
    assert mlp._packed_weight() is not None
    x = np.random.default_rng(6).standard_normal((4, 1, 48)).astype(np.float32)
    steps, y = mlp._bind_forward(x)
    for step in steps:
        step()
    np.testing.assert_allclose(y, mlp.forward(x), rtol=1e-6, atol=1e-6)


def test_float32_exp_is_within_an_ulp_of_the_exact_value() -> None:
    x = np.linspace(-110.0, 90.0, 2_000_001, dtype=np.float32).reshape(1, -1)
    x = np.concatenate(
        [x, np.float32(20) * np.random.default_rng(4).standard_normal(x.shape, np.float32)]
    )
    got = np.full_like(x, np.nan)
    _fused_math.exp_rows(x, got)
    exact = np.exp(x.astype(np.float64))
    tiny, big = np.finfo(np.float32).tiny, float(np.finfo(np.float32).max)
    normal = (exact >= tiny) & (exact <= big)
    spacing = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert (np.abs(got[normal] - exact[normal]) / spacing).max() < 1.05
    low = exact < tiny  # subnormal results: within one unit of the smallest subnormal
    rounded = exact[low].astype(np.float32)
    assert np.abs(got[low].view(np.int32).astype(np.int64) - rounded.view(np.int32)).max() <= 1
    assert (got[exact > big] == np.inf).all()
    special = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 88.73, -104.5]], np.float32)
    out = np.empty_like(special)
    _fused_math.exp_rows(special, out)
    assert np.isnan(out[0, 0])
    assert out[0, 1:].tolist() == [np.inf, 0.0, 1.0, 1.0, np.inf, 0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_rows_equals_the_numpy_backward_in_place(dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    g = (rng.standard_normal((11, 130)) * 8).astype(dtype)
    g[0, :6] = [-1000.0, 1000.0, 0.0, -0.0, -90.0, 90.0]  # exp overflows both ways
    u = rng.standard_normal((11, 130)).astype(dtype)
    dh = rng.standard_normal((11, 130)).astype(dtype)
    ref_dg, ref_du = np.empty_like(g), np.empty_like(g)
    swiglu_backward(g, u, dh, ref_dg, ref_du)
    got_dg, got_du = dh.copy(), np.full_like(g, np.nan)
    _fused_layers.swiglu_backward_rows(g, u, got_dg, got_du)  # dh becomes dgate
    assert np.isfinite(got_dg).all() and np.isfinite(got_du).all()
    np.testing.assert_allclose(got_du, ref_du, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])
    np.testing.assert_allclose(got_dg, ref_dg, rtol=4 * TOL[dtype], atol=4 * TOL[dtype])
    # and against the derivative in float64: d/dg silu(g) = s (1 + g (1 - s))
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        s = 1 / (1 + np.exp(-g64))
    dsilu = s * (1 + g64 * (1 - s))
    np.testing.assert_allclose(got_dg, dh * u * dsilu, rtol=8 * TOL[dtype], atol=8 * TOL[dtype])


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_components_agree_on_both_backends(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", backend)
    assert _fused_layers.enabled(np.float32) is (backend == "auto")
    assert not _fused_layers.enabled(np.float16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 48)).astype(np.float32)
    norm = RmsNorm("norm", RmsNormConfig(48), device="CPU")
    norm.build(BuildContext((2, 5, 48), RuntimeMode.TRAINING))
    y = norm.forward(x[:, 1:4])  # a non-contiguous input
    x64 = x[:, 1:4].astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * norm.weight
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6)
    mlp = SwiGLU("mlp", SwiGLUConfig(48, 64), device="CPU")
    mlp.build(BuildContext((2, 5, 48), RuntimeMode.TRAINING))
    p = {name.split(".")[0]: w.astype(np.float64) for name, w in mlp.named_parameters()}
    gate, up = x64 @ p["gate_proj"].T, x64 @ p["up_proj"].T
    ref = (gate / (1 + np.exp(-gate)) * up) @ p["down_proj"].T
    np.testing.assert_allclose(mlp.forward(x[:, 1:4]), ref, rtol=1e-5, atol=1e-5)


def test_every_cached_numba_kernel_has_a_cache_file_of_its_own() -> None:
    """Numba names a cache file after the Python function and keys entries by signature alone.

    Two cached dispatchers of one function (say parallel=True and parallel=False) would load each
    other's machine code from disk: the parallel RoPE kernel once ran serially that way.
    """
    from numba.core.caching import NullCache
    from numba.core.registry import CPUDispatcher

    from mila_py.ops.cpu import _fused_attention, _rope_fused, adamw

    paths: dict[str, str] = {}
    dispatchers: list[CPUDispatcher] = []
    for module in (_rope_fused, _fused_layers, _fused_math, _fused_attention, adamw):
        for name, obj in vars(module).items():
            if isinstance(obj, CPUDispatcher) and not isinstance(obj._cache, NullCache):
                if any(seen is obj for seen in dispatchers):
                    continue  # one dispatcher imported into another module
                dispatchers.append(obj)
                path = obj._cache._cache_file._index_path
                assert path not in paths, (
                    f"{module.__name__}.{name} shares {path} with {paths[path]}"
                )
                paths[path] = f"{module.__name__}.{name}"
    assert len(paths) >= 4  # the RoPE kernels and the row-wise layers really were looked at


def test_swiglu_backward_into_a_buffer_that_overlaps_an_input_takes_the_numpy_path() -> None:
    from mila_py.ops.cpu.swiglu import CpuSwiGLUOp

    rng = np.random.default_rng(9)
    g, u, dh = (rng.standard_normal((4, 24)).astype(np.float32) for _ in range(3))
    ref_dg, ref_du = np.empty_like(g), np.empty_like(g)
    swiglu_backward(g, u, dh, ref_dg, ref_du)
    op = CpuSwiGLUOp(None, None, None)  # type: ignore[arg-type]
    up = u.copy()
    du = np.empty_like(g)
    op.backward(g, up, dh, up, du)  # dgate overwrites up, which the kernel would still read
    np.testing.assert_allclose(up, ref_dg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(du, ref_du, rtol=1e-5, atol=1e-6)


def test_parallel_tasks_all_finish_before_an_error_is_raised() -> None:
    import time

    from mila_py.ops.cpu.rope import _in_parallel

    done: list[int] = []

    def task(i: int) -> None:
        if i == 0:
            raise RuntimeError("task 0 failed")
        time.sleep(0.05)
        done.append(i)

    with pytest.raises(RuntimeError, match="task 0 failed"):
        _in_parallel(task, range(4))
    assert sorted(done) == [1, 2, 3]  # nobody still writes after the call returned


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_max_and_sum_of_every_length_and_position(dtype) -> None:  # type: ignore[no-untyped-def]
    """The eight-lane row maximum (and the row sum) against NumPy, for lengths around the lane
    count and the maximum at every position, -inf entries included (masked scores)."""
    rng = np.random.default_rng(9)
    for n in range(1, 27):
        for where in range(n):
            x = rng.standard_normal(n).astype(dtype)
            x[where] = 7.0
            if n > 2:
                x[(where + 1) % n] = -np.inf
            assert _fused_math.k_row_max(x) == x.max()
        x = rng.standard_normal(n).astype(dtype)
        np.testing.assert_allclose(_fused_math.k_row_sum(x), x.sum(), rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (5, 384), (33, 10)])
def test_rms_norm_backward_rows_equals_the_numpy_backward(dtype, shape) -> None:  # type: ignore[no-untyped-def]
    """dx and the accumulated dw of the fused backward against the NumPy reference, also with
    dx written over dy (in place), as the op allows."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    w = rng.standard_normal(shape[1]).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    rstd = np.empty(shape[0], np.float64 if dtype == np.float64 else np.float32)
    rms_norm_forward(x, w, 1e-5, np.empty_like(x), rstd)
    start = rng.standard_normal(shape[1]).astype(dtype)
    ref_dw, ref_dx = start.copy(), np.empty_like(x)
    rms_norm_backward(x, w, rstd, dy, ref_dw, ref_dx)
    tol = 10 * TOL[dtype]
    for in_place in (False, True):
        dw = start.copy()
        grad = dy.copy()
        dx = grad if in_place else np.full_like(x, np.nan)
        _fused_layers.rms_norm_backward_rows(x, w, rstd, grad, dw, dx)
        np.testing.assert_allclose(dx, ref_dx, rtol=tol, atol=tol)
        np.testing.assert_allclose(dw, ref_dw, rtol=tol, atol=tol * shape[0])


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_the_rms_norm_backward_of_overlapping_buffers(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dx one row ahead of dy in one buffer, or over x: rows written early would be read later
    (by the row-by-row kernel, and across the NumPy reference's row blocks), so the op copies the
    input first; dx given as dy itself, or as another view of the same elements, runs in place.
    1200 rows of 64 span several of the reference's blocks."""
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", backend)
    rng = np.random.default_rng(12)
    n, dim = 1200, 64
    x = rng.standard_normal((n, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    dy = rng.standard_normal((n, dim)).astype(np.float32)
    rstd = np.empty(n, np.float32)
    rms_norm_forward(x, w, 1e-5, np.empty_like(x), rstd)
    ref_dw, ref_dx = np.zeros(dim, np.float32), np.empty_like(x)
    rms_norm_backward(x, w, rstd, dy, ref_dw, ref_dx)
    op = CpuRmsNormOp(None, RmsNormConfig(dim), None)  # type: ignore[arg-type]

    def check(got_dx: np.ndarray, dw: np.ndarray) -> None:
        np.testing.assert_allclose(got_dx, ref_dx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-4)

    buf = np.concatenate([dy, np.zeros((1, dim), np.float32)])
    dw = np.zeros(dim, np.float32)
    op.backward(x, w, rstd, buf[:n], dw, buf[1:])  # dx one row ahead of dy
    check(buf[1:], dw)
    same = dy.copy()
    dw = np.zeros(dim, np.float32)
    op.backward(x, w, rstd, same, dw, same[...])  # the same elements, another view object
    check(same, dw)
    over_x = x.copy()
    dw = np.zeros(dim, np.float32)
    op.backward(over_x, w, rstd, dy, dw, over_x)  # dx over x
    check(over_x, dw)


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_row_ops_with_an_output_one_row_ahead_of_an_input(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output overlapping an input one row further on (3000 rows of 64, several NumPy row
    blocks): the ops copy the input apart first, so no row is read after it was overwritten.
    The exact in-place pairs (SwiGLU's dgate as dh) still run in place."""
    from mila_py.ops.cpu.swiglu import CpuSwiGLUOp, swiglu_forward

    monkeypatch.setenv("MILA_PY_CPU_BACKEND", backend)
    rng = np.random.default_rng(21)
    n, h = 3000, 64
    g, u, dh = (rng.standard_normal((n, h)).astype(np.float32) for _ in range(3))
    w = rng.standard_normal(h).astype(np.float32)

    def shifted(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(input, output)``: ``a``'s values, and the view one row ahead in one buffer."""
        buf = np.concatenate([a, np.zeros((1, a.shape[1]), a.dtype)])
        return buf[:n], buf[1:]

    swiglu = CpuSwiGLUOp(None, None, None)  # type: ignore[arg-type]
    ref = np.empty_like(g)
    swiglu_forward(g, u, ref)
    gate, out = shifted(g)
    swiglu.forward(gate, u, out)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)

    ref_dg, ref_du = np.empty_like(g), np.empty_like(g)
    swiglu_backward(g, u, dh, ref_dg, ref_du)
    gate, dgate = shifted(g)
    du = np.empty_like(g)
    swiglu.backward(gate, u, dh, dgate, du)
    np.testing.assert_allclose(dgate, ref_dg, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(du, ref_du, rtol=1e-5, atol=1e-6)
    grad, dgate = shifted(dh)
    du = np.empty_like(g)
    swiglu.backward(g, u, grad, dgate, du)
    np.testing.assert_allclose(dgate, ref_dg, rtol=1e-5, atol=1e-6)
    own = dh.copy()
    du = np.empty_like(g)
    swiglu.backward(g, u, own, own[...], du)  # dgate over dh's own elements: in place
    np.testing.assert_allclose(own, ref_dg, rtol=1e-5, atol=1e-6)

    norm = CpuRmsNormOp(None, RmsNormConfig(h), None)  # type: ignore[arg-type]
    ref_y, rstd = np.empty_like(g), np.empty(n, np.float32)
    rms_norm_forward(g, w, 1e-5, ref_y, rstd)
    x, y = shifted(g)
    norm.forward(x, w, y, np.empty(n, np.float32))
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5)
