"""Linear: forward against x W^T + b (NumPy float64 and torch), gradients, lifecycle, memory,
on every device (``device``: CPU, CUDA:0, emulated CUDA:0); ``test_cpu_*`` check what only the
CPU has (NumPy's buffer identity and flags), ``test_cuda_op_*`` the CUDA op against the CPU op."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from cuda_arrays import (
    PRECISIONS_16,
    REDUCED_PARAMS,
    agree,
    close,
    cupy,
    dev,
    host,
    on,
    skip_bf16_without_arrays,
)
from layer_helpers import (
    ATOL32,
    INFERENCE,
    RTOL32,
    TRAINING,
    assert_gradients,
    assert_unchanged,
    built,
    check_16_bit_twin,
    distinct_nbytes,
    f32,
    owned_arrays,
    snapshot,
    tolerances,
)

from mila_py import BuildContext, Network, Precision, RuntimeMode, TrainingMode
from mila_py.components import Linear, LinearConfig
from mila_py.devices import create_execution_context
from mila_py.init import manual_seed
from mila_py.ops.cpu import _fused_linear
from mila_py.ops.cpu._fused_math import AVAILABLE as HAS_NUMBA
from mila_py.ops.cpu.linear import linear_backward, linear_forward
from mila_py.ops.registry import create_op

B, T, IN, OUT = 3, 5, 7, 4
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="needs Numba (the jit extra)")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def make(
    bias: bool = True,
    mode=TRAINING,
    shape=(B, T, IN),
    name: str = "proj",
    device: str = "CPU",
    **kw,
) -> Linear:
    return built(Linear(name, LinearConfig(IN, OUT, bias=bias), device=device), shape, mode, **kw)


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """``x W^T + b`` in float64 (arrays on any device)."""
    y = np.einsum("...i,oi->...o", host(x).astype(np.float64), host(w).astype(np.float64))
    return y if b is None else y + host(b)


def random_bias(lin: Linear, rng: np.random.Generator, device: str) -> None:
    lin.bias[...] = on(device, rng.standard_normal(OUT).astype(np.float32))


# ------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"in_features": 0, "out_features": 2}, ValueError),
        ({"in_features": 2, "out_features": -1}, ValueError),
        ({"in_features": 2.0, "out_features": 2}, TypeError),
        ({"in_features": True, "out_features": 2}, TypeError),
        ({"in_features": 2, "out_features": 2, "bias": 1}, TypeError),
    ],
)
def test_config_rejects_bad_values(kwargs, error) -> None:
    with pytest.raises(error, match="LinearConfig"):
        LinearConfig(**kwargs)


def test_config_is_frozen_and_needs_the_right_type() -> None:
    cfg = LinearConfig(2, 3)
    assert cfg.bias is False
    with pytest.raises(AttributeError):
        cfg.in_features = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="LinearConfig"):
        Linear("proj", {"in_features": 2, "out_features": 3})


def test_construction_allocates_nothing_in_every_cpu_precision() -> None:
    lin = Linear("proj", LinearConfig(IN, OUT), device="CPU")
    assert (
        not lin.is_built and lin.get_parameters() == [] and lin.get_memory_stats().total_bytes == 0
    )
    for precision in Precision:  # every one the CPU stores, 16-bit storage included
        lin = Linear("proj", LinearConfig(IN, OUT), device="CPU", precision=precision)
        assert lin.precision is precision and lin.get_memory_stats().total_bytes == 0


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(B, T), (1, T), (B, 1), (2, 3)])
def test_forward_matches_float64_reference(device, bias: bool, lead, rng) -> None:
    lin = make(bias, device=device)
    if bias:
        random_bias(lin, rng, device)
    x = rng.standard_normal((*lead, IN)).astype(np.float32)
    y = lin.forward(on(device, x))
    assert y.shape == (*lead, OUT) and y.dtype == np.float32
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(y, owned_arrays(lin)["s:proj.output"])
    want = reference(x, lin.weight, lin.bias)
    np.testing.assert_allclose(host(y), want, **tolerances(device))


def test_forward_matches_torch(device, rng) -> None:
    torch = pytest.importorskip("torch")
    lin = make(bias=True, device=device)
    random_bias(lin, rng, device)
    x = rng.standard_normal((B, T, IN)).astype(np.float32)
    expected = torch.nn.functional.linear(
        torch.from_numpy(x), torch.from_numpy(host(lin.weight)), torch.from_numpy(host(lin.bias))
    )
    y = host(lin.forward(on(device, x)))
    np.testing.assert_allclose(y, expected.numpy(), **tolerances(device))


def test_any_number_of_leading_dimensions(device, rng) -> None:
    lin = make(shape=(6, IN), device=device)
    x = rng.standard_normal((4, IN)).astype(np.float32)
    want = reference(x, lin.weight, lin.bias)
    np.testing.assert_allclose(host(lin.forward(on(device, x))), want, **tolerances(device))
    with pytest.raises(ValueError, match="must be"):
        lin.forward(on(device, np.zeros((1, 4, IN), np.float32)))


def test_non_contiguous_input(device, rng) -> None:
    lin = make(device=device)
    wide = rng.standard_normal((B, T, 2 * IN)).astype(np.float32)
    x = on(device, wide)[..., ::2]
    want = reference(wide[..., ::2], lin.weight, lin.bias)
    np.testing.assert_allclose(host(lin.forward(x)), want, **tolerances(device))


# ------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("bias", [True, False])
def test_backward_float64_matches_finite_differences(bias: bool, rng) -> None:
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((4, 5))
    b = rng.standard_normal(4) if bias else None
    r = rng.standard_normal((2, 3, 4))  # objective sum(y * r): dy = r

    def objective() -> float:
        y = np.empty((2, 3, 4))
        linear_forward(x, w, b, y)
        return float(np.sum(y * r))

    dw, dx = np.zeros_like(w), np.empty_like(x)
    db = np.zeros(4) if bias else None
    linear_backward(x, w, r, dw, db, dx)
    pairs = {"x": (x, dx), "weight": (w, dw)}
    if bias:
        pairs["bias"] = (b, db)
    assert_gradients(objective, pairs)


def test_component_backward_matches_float64_formula(device, rng) -> None:
    lin = make(bias=True, device=device)
    x = rng.standard_normal((2, 3, IN)).astype(np.float32)
    dy = rng.standard_normal((2, 3, OUT)).astype(np.float32)
    lin.forward(on(device, x))
    dx = lin.backward(on(device, dy))
    assert dx.shape == x.shape
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(dx, owned_arrays(lin)["s:proj.dinput"])
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    grads = {name: host(g) for name, g in lin.named_gradients()}
    tol = tolerances(device)
    np.testing.assert_allclose(host(dx), dy64 @ host(lin.weight), **tol)
    np.testing.assert_allclose(grads["weight"], np.einsum("bto,bti->oi", dy64, x64), **tol)
    np.testing.assert_allclose(grads["bias"], dy64.sum((0, 1)), **tol)


def test_gradients_accumulate_and_zero(device, rng) -> None:
    lin = make(bias=True, device=device)
    x = rng.standard_normal((B, T, IN)).astype(np.float32)
    dy = on(device, rng.standard_normal((B, T, OUT)).astype(np.float32))
    lin.forward(on(device, x))
    dx1 = host(lin.backward(dy)).copy()
    once = [host(g).copy() for g in lin.get_gradients()]
    dx2 = lin.backward(dy)
    for g, g1 in zip(lin.get_gradients(), once, strict=True):
        np.testing.assert_allclose(host(g), 2 * g1, rtol=1e-6)
    np.testing.assert_array_equal(host(dx2), dx1)  # dx is overwritten, not accumulated
    lin.zero_gradients()
    assert all(not host(g).any() for g in lin.get_gradients())


def test_eval_mode_runs_as_normal_mode(device, rng) -> None:
    """EVAL changes nothing a Linear computes: the same output, input gradient and parameter
    gradients as a NORMAL twin with the same weights."""
    lin, twin = make(device=device), make(device=device)
    for p, q in zip(lin.get_parameters(), twin.get_parameters(), strict=True):
        q[...] = p
    lin.set_training_mode(TrainingMode.EVAL)
    x = on(device, rng.standard_normal((B, T, IN)).astype(np.float32))
    np.testing.assert_array_equal(host(lin.forward(x)), host(twin.forward(x)))
    dy = on(device, rng.standard_normal((B, T, OUT)).astype(np.float32))
    np.testing.assert_array_equal(host(lin.backward(dy)), host(twin.backward(dy)))
    for g, h in zip(lin.get_gradients(), twin.get_gradients(), strict=True):
        np.testing.assert_array_equal(host(g), host(h))


# ------------------------------------------------------------------------------- lifecycle
def test_inference_build_has_no_gradients_and_backward_raises(device, rng) -> None:
    lin = make(mode=INFERENCE, device=device)
    assert lin.get_gradients() == []
    assert not host(lin.weight).any()  # inference builds expect loaded weights
    lin.forward(on(device, rng.standard_normal((B, T, IN)).astype(np.float32)))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        lin.backward(on(device, np.zeros((B, T, OUT), np.float32)))


def test_backward_before_forward_and_calls_before_build_raise(device) -> None:
    with pytest.raises(RuntimeError, match="forward"):
        make(device=device).backward(on(device, np.zeros((B, T, OUT), np.float32)))
    lin = Linear("proj", LinearConfig(IN, OUT), device=device)
    with pytest.raises(RuntimeError, match="built"):
        lin.forward(on(device, np.zeros((B, T, IN), np.float32)))


@pytest.mark.parametrize(
    ("x", "error"),
    [
        (np.zeros((B, T, IN), np.float64), TypeError),
        ([[[0.0] * IN]], TypeError),
        (np.zeros((B, T, IN + 1), np.float32), ValueError),
        (np.zeros((B + 1, T, IN), np.float32), ValueError),
        (np.zeros((B, T + 1, IN), np.float32), ValueError),
        (np.zeros((B * T, IN), np.float32), ValueError),
    ],
    ids=["float64", "list", "width", "batch", "tokens", "rank"],
)
def test_bad_forward_leaves_everything_unchanged(device, x, error, rng) -> None:
    lin = make(device=device)
    good = rng.standard_normal((B, T, IN)).astype(np.float32)
    ones = on(device, np.ones((B, T, OUT), np.float32))
    lin.forward(on(device, good))
    lin.backward(ones)
    x = x if isinstance(x, list) else on(device, x)
    saved = snapshot(lin, x)
    with pytest.raises(error):
        lin.forward(x)
    assert_unchanged(lin, saved, x)
    assert lin.backward(ones).shape == good.shape  # still the good x


@pytest.mark.parametrize(
    ("dy", "error", "message"),
    [
        (np.ones((B, T, OUT), np.float64), TypeError, "dtype float64"),
        (np.ones((B, T - 1, OUT), np.float32), ValueError, "shape of the last forward output"),
        (np.ones((B, T, IN)), TypeError, "dtype float64"),
    ],
    ids=["dtype", "shape", "width"],
)
def test_bad_backward_leaves_everything_unchanged(device, dy, error, message, rng) -> None:
    lin = make(device=device)
    lin.forward(on(device, rng.standard_normal((B, T, IN)).astype(np.float32)))
    lin.backward(on(device, np.ones((B, T, OUT), np.float32)))
    dy = on(device, dy)
    saved = snapshot(lin, dy)
    with pytest.raises(error, match=message):
        lin.backward(dy)
    assert_unchanged(lin, saved, dy)


def test_bad_build_shape_rolls_back_and_retry_succeeds(device) -> None:
    lin = Linear("proj", LinearConfig(IN, OUT), device=device)
    for shape in [(B, T, IN + 1), (IN,)]:
        with pytest.raises(ValueError, match="input_shape"):
            lin.build(BuildContext(shape, TRAINING))
        assert not lin.is_built and lin.get_memory_stats().total_bytes == 0
    built(lin, (B, T, IN))
    assert lin.is_built


# ------------------------------------------------------------------------------- memory, init
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_stats_count_every_owned_array_once(device, bias: bool, mode) -> None:
    lin = make(bias, mode, device=device)
    stats = lin.get_memory_stats()
    params = (OUT * IN + OUT * bias) * 4
    state = B * T * OUT * 4 + (B * T * IN * 4 if mode is TRAINING else 0)
    assert stats.parameter_bytes == params
    assert stats.gradient_bytes == (params if mode is TRAINING else 0)
    assert stats.state_bytes == state
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(lin).values()))


def test_initialization_is_seeded_normal_and_bias_zero(device) -> None:
    """The same draws on every device: a CUDA build's weights are the CPU build's."""
    big = built(Linear("big", LinearConfig(256, 128, bias=True), device=device), (1, 1, 256))
    weight = host(big.weight)
    assert abs(weight.std() - 0.02) < 0.001 and abs(weight.mean()) < 0.001
    assert not host(big.bias).any()
    w = host(make(name="a").weight).copy()  # the CPU's draws
    np.testing.assert_array_equal(host(make(name="a", device=device).weight), w)
    assert not np.array_equal(host(make(name="b", device=device).weight), w)  # another stream
    try:
        manual_seed(7)
        assert not np.array_equal(host(make(name="a", device=device).weight), w)
    finally:
        manual_seed(0)
    assert not host(make(initialize=False, device=device).weight).any()


def test_inside_a_network(device, rng) -> None:
    net = Network("net", device=device)
    lin = Linear("proj", LinearConfig(IN, OUT))
    net.add_component(lin)
    net.build(BuildContext((B, T, IN), TRAINING))
    x = rng.standard_normal((B, T, IN)).astype(np.float32)
    want = reference(x, lin.weight, None)
    np.testing.assert_allclose(host(lin.forward(on(device, x))), want, **tolerances(device))
    assert [n for n, _ in net.named_parameters()] == ["proj.weight"]


@pytest.mark.parametrize(("n_in", "n_out"), [(IN, OUT), (OUT, IN), (IN, IN)])
def test_inference_builds_store_a_widening_weight_transposed_with_the_same_values(
    device, n_in: int, n_out: int, rng
) -> None:
    """A CPU INFERENCE build keeps ``weight [out, in]`` of a layer with ``in <= out`` as a view
    of ``[in, out]`` rows (the faster decode GEMV for it), of a narrowing one as ``[out, in]``
    rows; CUDA builds keep ``[out, in]`` rows; initialization, loading and the forward result
    are those of a TRAINING build on every device."""
    transposed = device == "CPU" and n_in <= n_out

    def build(mode) -> Linear:  # type: ignore[no-untyped-def]
        lin = Linear("w", LinearConfig(n_in, n_out), device=device)
        return built(lin, (B, T, n_in), mode, initialize=True)

    train, serve = build(TRAINING), build(INFERENCE)
    assert serve.weight.shape == train.weight.shape == (n_out, n_in)
    assert train.weight.flags.c_contiguous
    assert serve.weight.T.flags.c_contiguous is transposed
    assert serve.weight.flags.c_contiguous is not transposed
    np.testing.assert_array_equal(host(serve.weight), host(train.weight))  # the same draws
    x = on(device, rng.standard_normal((B, T, n_in)).astype(np.float32))
    np.testing.assert_allclose(host(serve.forward(x)), host(train.forward(x)), rtol=1e-6, atol=1e-6)
    new = rng.standard_normal((n_out, n_in)).astype(np.float32)
    serve.weight[...] = on(device, new)  # loading writes through the view
    np.testing.assert_array_equal(host(serve.weight), new)
    assert serve.get_memory_stats().device_parameter_bytes == new.nbytes  # no bias


def test_cpu_call_shapes_in_any_order_reuse_correct_views_of_the_output_buffer(rng) -> None:
    """Views of the output buffer are kept per call shape (decode asks for the same one per
    token): shapes in any order, many more than are kept, and a replaced buffer all give the
    right result in the right memory (on the CPU, where NumPy tells which memory)."""
    lin = make(False)
    leads = [(1, 1), (B, T), (1, 3), (1, 1), (B, 1)] + [(1, t) for t in range(1, T + 1)] * 20
    for lead in leads:
        x = rng.standard_normal((*lead, IN)).astype(np.float32)
        y = lin.forward(x)
        assert y.shape == (*lead, OUT)
        assert np.shares_memory(y, lin._state["output"])
        np.testing.assert_allclose(y, reference(x, lin.weight, None), rtol=RTOL32, atol=ATOL32)
    assert len(lin._views) <= 64
    fresh = np.zeros_like(lin._state["output"])
    lin._state["output"] = fresh  # a buffer swapped under a kept view: the view is not reused
    y = lin.forward(np.ones((1, 1, IN), np.float32))
    assert np.shares_memory(y, fresh)


def test_cpu_a_caller_changing_its_output_view_changes_nothing_for_the_next_call(rng) -> None:
    """NumPy's view flags and in-place shape (a CuPy array has neither)."""
    lin = make(False)
    x = rng.standard_normal((B, T, IN)).astype(np.float32)
    y = lin.forward(x)
    y.flags.writeable = False  # a caller's own business
    y.shape = (B * T, OUT)
    again = lin.forward(x)
    assert again.shape == (B, T, OUT) and again.flags.writeable
    np.testing.assert_allclose(again, reference(x, lin.weight, None), rtol=RTOL32, atol=ATOL32)


def test_cpu_a_packed_weight_of_the_wrong_shape_is_refused_and_the_build_rolls_back() -> None:
    """A NumPy packed weight, taken as is (NumPy tells the view)."""
    layer = Linear("proj", LinearConfig(3, 5), device="CPU")
    layer._packed_weight = np.zeros((3, 5), np.float32)  # [in, out]: the transpose
    with pytest.raises(ValueError, match=r"packed weight must be \[5, 3\], got \[3, 5\]"):
        layer.build(BuildContext((2, 3), RuntimeMode.INFERENCE))
    assert not layer.is_built and layer.get_memory_stats().total_bytes == 0
    view = np.zeros((3, 10), np.float32)[:, 5:].T  # a strided [out, in] view is taken as is
    layer._packed_weight = view
    layer.build(BuildContext((2, 3), RuntimeMode.INFERENCE, initialize_parameters=False))
    assert layer.weight is view


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_its_float64_twin(device, precision: Precision, rng) -> None:
    """A 16-bit Linear with a bias against the float64 CPU layer of the same values, forward
    and backward (see :func:`check_16_bit_twin`)."""
    skip_bf16_without_arrays(device, precision)
    check_16_bit_twin(
        lambda p, d: Linear("lin", LinearConfig(24, 40, bias=True), device=d, precision=p),
        (2, 3, 24),
        lambda rng, dtype: (rng.standard_normal((2, 3, 24)).astype(dtype),),
        device,
        precision,
        rng,
    )


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_a_16_bit_product_is_the_float32_product_rounded_once(device, precision, rng) -> None:
    """The prefill path: float32 products of the 16-bit values, rounded once on store (not a
    16-bit accumulation, nor a second rounding for the bias): bit for bit the NumPy float32
    product on the CPU, to a rounding of the float64 one elsewhere (another summation order)."""
    skip_bf16_without_arrays(device, precision)
    dtype = precision.numpy_dtype
    lin = built(
        Linear("lin", LinearConfig(64, 48, bias=True), device=device, precision=precision),
        (4, 64),
        INFERENCE,
        initialize=True,
    )
    bias = rng.standard_normal(48).astype(dtype)
    lin.bias[...] = on(device, bias)
    x = rng.standard_normal((4, 64)).astype(dtype)
    weight = host(lin.weight)
    y = lin.forward(on(device, x))
    if device == "CPU":
        wide = x.astype(np.float32) @ weight.astype(np.float32).T + bias.astype(np.float32)
        np.testing.assert_array_equal(y, wide.astype(dtype))
    else:
        exact = x.astype(np.float64) @ weight.astype(np.float64).T + bias.astype(np.float64)
        agree(y, exact, precision, units=1.0)


def test_cpu_16_bit_inference_weights_are_stored_as_rows() -> None:
    """16-bit CPU INFERENCE builds keep every weight ``[out, in]`` (the decode kernel streams
    rows); FP32 builds store widening layers transposed."""
    for precision, rows in ((Precision.FP32, False), (Precision.BF16, True)):
        lin = built(
            Linear("lin", LinearConfig(16, 48), device="CPU", precision=precision),
            (1, 16),
            INFERENCE,
        )
        assert lin.weight.flags.c_contiguous is rows


@needs_numba
@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16], ids=str)
def test_cpu_a_decode_product_reads_the_16_bit_weight_without_a_copy(precision, rng) -> None:
    """A decode plan's product of a few rows runs the Numba kernel on the 16-bit weight: its
    result is the float32 product rounded (to within one rounding of the summation order), and
    the call allocates far less than the weight (no widened copy). A weight of another layout
    takes the general path, to the same values."""
    n_in, n_out, dtype = 384, 512, precision.numpy_dtype
    weight = rng.standard_normal((n_out, n_in)).astype(dtype)
    bias = rng.standard_normal(n_out).astype(dtype)
    x = rng.standard_normal((2, n_in)).astype(dtype)
    out = np.zeros((2, n_out), dtype)
    lin = Linear("lin", LinearConfig(n_in, n_out, bias=True), device="CPU", precision=precision)
    assert _fused_linear.applies(x, weight, bias, out)
    step = lin.op.bind_forward(x, weight, bias, out)
    step()  # compiled before the measurement
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < weight.nbytes // 10
    exact = x.astype(np.float64) @ weight.astype(np.float64).T + bias.astype(np.float64)
    ulp = 2.0**-8 if precision is Precision.BF16 else 2.0**-11
    np.testing.assert_allclose(out.astype(np.float64), exact, rtol=1.01 * ulp, atol=1e-3)
    transposed = np.ascontiguousarray(weight.T).T  # [out, in] in Fortran order
    assert not _fused_linear.applies(x, transposed, bias, out)
    general = np.zeros_like(out)
    lin.op.bind_forward(x, transposed, bias, general)()
    np.testing.assert_allclose(general.astype(np.float64), exact, rtol=1.01 * ulp, atol=1e-3)


# ------------------------------------------------------------------ CUDA op against the CPU op


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_cuda_op_forward_and_backward_match_the_cpu_op(
    cuda_ctx, rng, bias: bool, transposed: bool
) -> None:
    n_in, n_out = 48, 40
    op = create_op("LinearOp", cuda_ctx, LinearConfig(n_in, n_out, bias=bias), Precision.FP32)
    big = f32(rng, 3, 9, n_in)
    x, gx = big[:2, :7], dev(big)[:2, :7]  # batch slices: not contiguous
    if transposed:  # the INFERENCE layout: an [out, in] view of [in, out] storage
        storage = f32(rng, n_in, n_out)
        w, gw = storage.T, dev(storage).T
    else:
        w = f32(rng, n_out, n_in)
        gw = dev(w)
    b = f32(rng, n_out) if bias else None
    out = cupy.empty((2, 7, n_out), cupy.float32)
    op.forward(gx, gw, None if b is None else dev(b), out)
    ref = np.empty((2, 7, n_out), np.float32)
    linear_forward(x, w, b, ref)
    close(out, ref)
    dy = f32(rng, 2, 7, n_out)
    dw0, db0 = f32(rng, n_out, n_in), f32(rng, n_out)
    dw, db = dev(dw0), dev(db0) if bias else None
    dx = cupy.empty((2, 7, n_in), cupy.float32)
    op.backward(gx, gw, dev(dy), dw, db, dx)
    dx_ref = np.empty((2, 7, n_in), np.float32)
    db_ref = db0.copy() if bias else None
    linear_backward(x, w, dy, dw0, db_ref, dx_ref)
    close(dw, dw0)
    close(dx, dx_ref)
    if bias:
        close(db, db_ref)


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out storage"])
@pytest.mark.parametrize("m", [1, 5, 300])
def test_cuda_bound_forward_equals_the_forward(cuda_ctx, rng, m: int, transposed: bool) -> None:
    """The bound forward (a decode plan's product, run with the context active: ``linear.cu``'s
    ``linear_rows`` up to 16 rows over ``[out, in]`` rows, ``cupy.matmul`` past them or for the
    other layout) against the op's forward and the float64 product, with and without a bias
    (their summation orders differ: float32 roundings apart)."""
    n_in, n_out = 96, 40
    op = create_op("LinearOp", cuda_ctx, LinearConfig(n_in, n_out, bias=False), Precision.FP32)
    x = f32(rng, m, 1, n_in)
    w_in_out = f32(rng, n_in, n_out)
    w = w_in_out.T  # [out, in]
    gx, gw = dev(x), (dev(w_in_out).T if transposed else dev(np.ascontiguousarray(w)))
    want = cupy.empty((m, 1, n_out), cupy.float32)
    op.forward(gx, gw, None, want)
    close(want, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    for bias in (None, f32(rng, n_out)):
        out = cupy.full((m, 1, n_out), np.nan, cupy.float32)
        with cuda_ctx.activate():
            op.bind_forward(gx, gw, None if bias is None else dev(bias), out)()
        reference = x.astype(np.float64) @ w.T + (0 if bias is None else bias)
        close(out, reference, rtol=1e-5, atol=1e-5)
        close(out, host(want) + (0 if bias is None else bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_in_16_bits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """CuPy's 2-D products over the 16-bit values against the CPU op in the same precision,
    an ``[out, in]`` view of ``[in, out]`` storage as INFERENCE keeps it; ``dy`` in the storage
    type, then in float32 (taken as it is); the weight and bias gradients in float32."""
    p, dtype = precision, precision.numpy_dtype
    cfg = LinearConfig(24, 16, bias=True)
    gpu, cpu = create_op("LinearOp", cuda_ctx, cfg, p), create_op("LinearOp", CPU, cfg, p)
    x, storage, b = f32(rng, 3, 5, 24).astype(dtype), f32(rng, 24, 16), f32(rng, 16)
    w, b = storage.astype(dtype).T, b.astype(dtype)
    gx, gw, gb = dev(x), dev(storage.astype(dtype)).T, dev(b)
    out, ref = cupy.empty((3, 5, 16), dtype), np.empty((3, 5, 16), dtype)
    gpu.forward(gx, gw, gb, out)
    cpu.forward(x, w, b, ref)
    agree(out, ref, p)
    for dy in (f32(rng, 3, 5, 16).astype(dtype), f32(rng, 3, 5, 16)):
        dw, dw_ref = cupy.zeros((16, 24), cupy.float32), np.zeros((16, 24), np.float32)
        db, db_ref = cupy.zeros(16, cupy.float32), np.zeros(16, np.float32)
        dx, dx_ref = cupy.empty((3, 5, 24), dtype), np.empty((3, 5, 24), dtype)
        gpu.backward(gx, gw, dev(dy), dw, db, dx)
        cpu.backward(x, w, dy, dw_ref, db_ref, dx_ref)
        close(dw, dw_ref, rtol=1e-5, atol=1e-5)
        close(db, db_ref, rtol=1e-5, atol=1e-5)
        agree(dx, dx_ref, p)
