"""SwiGLU: forward against down(silu(gate x) * up x) (NumPy float64 and torch), gradients through
the three Linear children, lifecycle, memory, on every device (``device``: CPU, CUDA:0, emulated
CUDA:0); ``test_cpu_*`` check the packed gate/up product only CPU builds have, ``test_cuda_op_*``
the CUDA op against the CPU op."""

from __future__ import annotations

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

from mila_py import BuildContext, Network, Precision, TrainingMode
from mila_py.components import Linear, SwiGLU, SwiGLUConfig
from mila_py.devices import create_execution_context
from mila_py.init import set_init_name
from mila_py.ops.cpu.linear import linear_backward, linear_forward
from mila_py.ops.cpu.swiglu import swiglu_backward, swiglu_forward
from mila_py.ops.registry import create_op
from mila_py.serialization import assign_parameters

B, T, D, H = 2, 4, 6, 10
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")
NAMES = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(777)


def make(mode=TRAINING, shape=(B, T, D), name: str = "mlp", device: str = "CPU", **kw) -> SwiGLU:
    return built(SwiGLU(name, SwiGLUConfig(D, H), device=device), shape, mode, **kw)


def weights(mlp: SwiGLU) -> dict[str, np.ndarray]:
    """Host copies of the parameters, by name (host arrays themselves on the CPU)."""
    return {name: host(p) for name, p in mlp.named_parameters()}


def reference(x: np.ndarray, w: dict[str, np.ndarray]) -> np.ndarray:
    x = host(x).astype(np.float64)
    g = x @ w["gate_proj.weight"].T.astype(np.float64)
    u = x @ w["up_proj.weight"].T.astype(np.float64)
    return (g / (1 + np.exp(-g)) * u) @ w["down_proj.weight"].T.astype(np.float64)


# ------------------------------------------------------------------------------- structure
def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="SwiGLUConfig"):
        SwiGLUConfig(4, 0)
    with pytest.raises(TypeError, match="SwiGLUConfig"):
        SwiGLUConfig("4", 8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bias"):
        SwiGLUConfig(4, 8, bias=1)  # type: ignore[arg-type]


def test_bias_puts_a_bias_on_each_projection() -> None:
    mlp = built(SwiGLU("mlp", SwiGLUConfig(D, H, bias=True), device="CPU"), (2, 3, D))
    names = [name for name, _ in mlp.named_parameters()]
    assert names == [f"{p}_proj.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias")]
    assert "bias=True" in repr(mlp)


def test_children_are_bias_free_linears_with_hf_names(device) -> None:
    mlp = SwiGLU("mlp", SwiGLUConfig(D, H), device=device)
    assert list(mlp.components) == ["gate_proj", "up_proj", "down_proj"]
    assert all(isinstance(c, Linear) and not c.config.bias for c in mlp)
    assert mlp.get_memory_stats().total_bytes == 0  # construction allocates nothing
    built(mlp, (B, T, D))
    shapes = {name: p.shape for name, p in mlp.named_parameters()}
    assert shapes == {NAMES[0]: (H, D), NAMES[1]: (H, D), NAMES[2]: (D, H)}


def test_children_are_seeded_by_their_path() -> None:
    w = weights(make())
    assert not np.array_equal(w[NAMES[0]], w[NAMES[1]])
    np.testing.assert_array_equal(weights(make())[NAMES[0]], w[NAMES[0]])
    assert not np.array_equal(weights(make(name="other"))[NAMES[0]], w[NAMES[0]])
    inner = SwiGLU("mlp", SwiGLUConfig(D, H), device="CPU")
    set_init_name(inner, "layers.1.mlp")  # what a parent holding many blocks does
    assert not np.array_equal(weights(built(inner, (B, T, D)))[NAMES[0]], w[NAMES[0]])


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("lead", [(B, T), (1, 1), (2, 3)])
def test_forward_matches_float64_reference(device, lead, rng) -> None:
    mlp = make(device=device)
    x = rng.standard_normal((*lead, D)).astype(np.float32) * 20  # pre-activations far from 0
    y = mlp.forward(on(device, x))
    assert y.shape == x.shape and y.dtype == np.float32
    np.testing.assert_allclose(host(y), reference(x, weights(mlp)), **tolerances(device))


def test_forward_matches_torch(device, rng) -> None:
    torch = pytest.importorskip("torch")
    mlp = make(device=device)
    x = rng.standard_normal((B, T, D)).astype(np.float32) * 20
    w = {k: torch.from_numpy(v.copy()) for k, v in weights(mlp).items()}
    xt = torch.from_numpy(x)
    F = torch.nn.functional
    expected = F.linear(F.silu(F.linear(xt, w[NAMES[0]])) * F.linear(xt, w[NAMES[1]]), w[NAMES[2]])
    tol = {"rtol": 1e-5, "atol": 1e-6} if device == "CPU" else tolerances(device)
    np.testing.assert_allclose(host(mlp.forward(on(device, x))), expected.numpy(), **tol)


def test_activation_is_finite_for_extreme_gates() -> None:
    g = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], np.float32)
    h = np.empty_like(g)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        swiglu_forward(g, np.ones_like(g), h)
    np.testing.assert_allclose(h, [0, -100 / (1 + np.exp(100.0)), 0, 100, 1e4], atol=1e-30)


# ------------------------------------------------------------------------------- backward
def test_backward_float64_matches_finite_differences(rng) -> None:
    """The block's math in float64: the two ops composed as the component composes them."""
    x = rng.standard_normal((2, 3, 4))
    wg, wu, wd = (rng.standard_normal(s) for s in [(5, 4), (5, 4), (4, 5)])
    r = rng.standard_normal((2, 3, 4))

    def forward() -> tuple[np.ndarray, ...]:
        g, u, h, y = np.empty((2, 3, 5)), np.empty((2, 3, 5)), np.empty((2, 3, 5)), np.empty_like(x)
        linear_forward(x, wg, None, g)
        linear_forward(x, wu, None, u)
        swiglu_forward(g, u, h)
        linear_forward(h, wd, None, y)
        return g, u, h, y

    def objective() -> float:
        return float(np.sum(forward()[3] * r))

    g, u, h, _ = forward()
    dwg, dwu, dwd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    dh, dg, du = np.empty_like(h), np.empty_like(h), np.empty_like(h)
    dx_g, dx_u = np.empty_like(x), np.empty_like(x)
    linear_backward(h, wd, r, dwd, None, dh)
    swiglu_backward(g, u, dh, dg, du)
    linear_backward(x, wg, dg, dwg, None, dx_g)
    linear_backward(x, wu, du, dwu, None, dx_u)
    pairs = {"x": (x, dx_g + dx_u), "gate": (wg, dwg), "up": (wu, dwu), "down": (wd, dwd)}
    assert_gradients(objective, pairs)
    # in place (dgate = dh), as the component calls it
    swiglu_backward(g, u, dh, dh, du)
    np.testing.assert_array_equal(dh, dg)


def test_activation_backward_float64_matches_finite_differences(rng) -> None:
    g = rng.standard_normal((3, 7)) * 4
    u = rng.standard_normal((3, 7))
    r = rng.standard_normal((3, 7))

    def objective() -> float:
        h = np.empty_like(g)
        swiglu_forward(g, u, h)
        return float(np.sum(h * r))

    dg, du = np.empty_like(g), np.empty_like(u)
    swiglu_backward(g, u, r, dg, du)
    assert_gradients(objective, {"gate": (g, dg), "up": (u, du)})


def test_component_backward_matches_float64_ops(device, rng) -> None:
    mlp = make(device=device)
    x = rng.standard_normal((2, 3, D)).astype(np.float32)
    dy = rng.standard_normal((2, 3, D)).astype(np.float32)
    mlp.forward(on(device, x))
    dx = mlp.backward(on(device, dy))
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(dx, owned_arrays(mlp)["s:mlp.dinput"])
    w = {k: v.astype(np.float64) for k, v in weights(mlp).items()}
    x64 = x.astype(np.float64)
    g, u = x64 @ w[NAMES[0]].T, x64 @ w[NAMES[1]].T
    s = 1 / (1 + np.exp(-g))
    dh = dy.astype(np.float64) @ w[NAMES[2]]
    dg, du = dh * u * s * (1 + g * (1 - s)), dh * g * s
    expected = {
        NAMES[0]: np.einsum("bth,btd->hd", dg, x64),
        NAMES[1]: np.einsum("bth,btd->hd", du, x64),
        NAMES[2]: np.einsum("btd,bth->dh", dy.astype(np.float64), g * s * u),
    }
    grads = {name: host(g) for name, g in mlp.named_gradients()}
    for name, value in expected.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    want = dg @ w[NAMES[0]] + du @ w[NAMES[1]]
    np.testing.assert_allclose(host(dx), want, rtol=1e-4, atol=1e-6)


def test_gradients_accumulate_and_zero(device, rng) -> None:
    mlp = make(device=device)
    x = on(device, rng.standard_normal((B, T, D)).astype(np.float32))
    dy = on(device, rng.standard_normal((B, T, D)).astype(np.float32))
    mlp.forward(x)
    dx1 = host(mlp.backward(dy)).copy()
    once = [host(g).copy() for g in mlp.get_gradients()]
    np.testing.assert_array_equal(host(mlp.backward(dy)), dx1)  # repeated backward is exact
    for g, g1 in zip(mlp.get_gradients(), once, strict=True):
        np.testing.assert_allclose(host(g), 2 * g1, rtol=1e-6)
    mlp.zero_gradients()
    assert not any(host(g).any() for g in mlp.get_gradients())


def test_eval_mode_propagates_and_still_runs(device, rng) -> None:
    mlp = make(device=device)
    mlp.set_training_mode(TrainingMode.EVAL)
    assert all(c.training_mode is TrainingMode.EVAL for c in mlp)
    twin = make(device=device)
    for p, q in zip(mlp.get_parameters(), twin.get_parameters(), strict=True):
        q[...] = p
    x = on(device, rng.standard_normal((1, 2, D)).astype(np.float32))
    np.testing.assert_array_equal(host(mlp.forward(x)), host(twin.forward(x)))  # as NORMAL
    dy = on(device, rng.standard_normal((1, 2, D)).astype(np.float32))
    np.testing.assert_array_equal(host(mlp.backward(dy)), host(twin.backward(dy)))
    for g, h in zip(mlp.get_gradients(), twin.get_gradients(), strict=True):
        np.testing.assert_array_equal(host(g), host(h))


# ------------------------------------------------------------------------------- lifecycle
def test_inference_build_has_no_gradients_and_backward_raises(device, rng) -> None:
    mlp = make(mode=INFERENCE, device=device)
    assert mlp.get_gradients() == []
    mlp.forward(on(device, rng.standard_normal((B, T, D)).astype(np.float32)))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        mlp.backward(on(device, np.zeros((B, T, D), np.float32)))


def test_backward_before_forward_raises(device) -> None:
    with pytest.raises(RuntimeError, match="forward"):
        make(device=device).backward(on(device, np.zeros((B, T, D), np.float32)))


@pytest.mark.parametrize(
    ("x", "error"),
    [
        (np.ones((B, T, D), np.float64), TypeError),
        (np.ones((B, T, D + 1), np.float32), ValueError),
        (np.ones((B, T + 1, D), np.float32), ValueError),
    ],
    ids=["dtype", "width", "tokens"],
)
def test_bad_forward_leaves_everything_unchanged(device, x, error, rng) -> None:
    mlp = make(device=device)
    mlp.forward(on(device, rng.standard_normal((B, T, D)).astype(np.float32)))
    mlp.backward(on(device, np.ones((B, T, D), np.float32)))
    x = on(device, x)
    saved = snapshot(mlp, x)
    with pytest.raises(error):
        mlp.forward(x)
    assert_unchanged(mlp, saved, x)


def test_bad_backward_leaves_everything_unchanged(device, rng) -> None:
    mlp = make(device=device)
    mlp.forward(on(device, rng.standard_normal((1, 2, D)).astype(np.float32)))
    for dy_host in (np.ones((1, 3, D), np.float32), np.ones((1, 2, D), np.float64)):
        dy = on(device, dy_host)
        saved = snapshot(mlp, dy)
        error, message = (TypeError, "dtype") if dy.dtype == np.float64 else (ValueError, "shape")
        with pytest.raises(error, match=message):
            mlp.backward(dy)
        assert_unchanged(mlp, saved, dy)


def test_bad_build_shape_rolls_back_the_children(device) -> None:
    mlp = SwiGLU("mlp", SwiGLUConfig(D, H), device=device)
    with pytest.raises(ValueError, match="input_shape"):
        mlp.build(BuildContext((B, T, H), TRAINING))
    assert not any(c.is_built for c in mlp._walk())
    assert mlp.get_memory_stats().total_bytes == 0
    built(mlp, (B, T, D))
    assert all(c.is_built for c in mlp._walk())


@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_stats_count_every_owned_array_once(device, mode) -> None:
    mlp = make(mode, device=device)
    stats = mlp.get_memory_stats()
    training = mode is TRAINING
    params = 3 * D * H * 4
    assert stats.parameter_bytes == params
    assert stats.gradient_bytes == (params if training else 0)
    n = B * T
    # children's outputs: gate, up [n, H], down [n, D]; the block's hidden [n, H]
    state = (2 * n * H + n * D) + n * H
    if training:  # children's dinputs: gate, up [n, D], down [n, H]; the block's dup, dinput
        state += (2 * n * D + n * H) + (n * H + n * D)
    elif device == "CPU":  # the packed gate/up product of a CPU decode step, [B, 2H]
        state += B * 2 * H
    assert stats.state_bytes == state * 4
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(mlp).values()))


def test_inside_a_network(device, rng) -> None:
    net = Network("net", device=device)
    net.add_component(SwiGLU("mlp", SwiGLUConfig(D, H)))
    net.build(BuildContext((B, T, D), TRAINING))
    mlp = net.find_component("mlp")
    assert isinstance(mlp, SwiGLU)
    assert net.find_component("mlp.down_proj").is_built
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    y = host(mlp.forward(on(device, x)))
    np.testing.assert_allclose(y, reference(x, weights(mlp)), **tolerances(device))
    assert [n for n, _ in net.named_parameters()] == [f"mlp.{n}" for n in NAMES]


def test_input_in_a_buffer_of_the_block_is_refused(device, rng) -> None:
    """The projections run unchecked inside the block, so the block refuses an ``x`` that lies
    in a buffer it writes: gate_proj's or up_proj's (overwritten while still needed) and
    down_proj's, its own output given back (kept for backward, then overwritten: the weight
    gradients came out wrong by orders of magnitude)."""
    mlp = make(device=device)
    x = on(device, rng.standard_normal((B, T, D)).astype(np.float32))
    mlp.forward(x)
    for proj in (mlp.gate_proj, mlp.up_proj):
        inside = proj._state["output"].reshape(-1)[: B * T * D].reshape(B, T, D)
        inside[...] = x
        saved = snapshot(mlp)
        with pytest.raises(ValueError, match=f"overlaps {proj.name}"):
            mlp.forward(inside)
        assert_unchanged(mlp, saved)
    y = mlp.forward(x)
    saved = snapshot(mlp)
    with pytest.raises(ValueError, match=r"overlaps down_proj\.output.*pass a copy"):
        mlp.forward(y)
    assert_unchanged(mlp, saved)
    want = reference(y, weights(mlp))
    np.testing.assert_allclose(host(mlp.forward(y.copy())), want, **tolerances(device))


# ------------------------------------------------------------------------------- packing
def _run(steps: list) -> None:
    for step in steps:
        step()


@pytest.mark.parametrize("dims", [(D, H), (9, 4)])  # widening [dim, 2H] rows; narrowing [2H, dim]
def test_cpu_inference_builds_pack_gate_and_up_into_one_product(rng, dims) -> None:
    """gate_proj's and up_proj's weights are the halves of one buffer; a bound forward of at
    most B rows runs one product for both, and equals the component call and the reference,
    also after new weights are assigned in place (as load and from_pretrained do)."""
    dim, hidden = dims
    mlp = built(SwiGLU("mlp", SwiGLUConfig(dim, hidden), device="CPU"), (B, T, dim), INFERENCE)
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert gate.shape == up.shape == (hidden, dim)
    assert gate.base is not None and gate.base is up.base and gate.base.size == 2 * hidden * dim
    packed = mlp._packed_weight()
    assert packed is not None
    np.testing.assert_array_equal(packed, np.concatenate([gate, up]))
    assert mlp.gate_proj._packed_weight is None and mlp.up_proj._packed_weight is None
    x = np.zeros((B, 1, dim), np.float32)
    steps, y = mlp._bind_forward(x)
    assert len(steps) == 3  # gate and up, the activation, down
    for _ in range(2):
        new = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in weights(mlp).items()}
        assign_parameters(mlp, new, "test")
        x[...] = rng.standard_normal(x.shape)
        _run(steps)
        want = reference(x, weights(mlp))
        np.testing.assert_allclose(y, want, rtol=RTOL32, atol=ATOL32)
        np.testing.assert_array_equal(y, mlp.forward(x.copy()))
    # more rows than the packed buffer holds: the two products of an unpacked build
    wide = rng.standard_normal((B, 2, dim)).astype(np.float32)
    steps, y = mlp._bind_forward(wide)
    assert len(steps) == 4
    _run(steps)
    np.testing.assert_allclose(y, reference(wide, weights(mlp)), rtol=RTOL32, atol=ATOL32)


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_training_builds_and_biases_do_not_pack(rng, bias: bool) -> None:
    for mode in (TRAINING, INFERENCE):
        if mode is INFERENCE and not bias:
            continue
        mlp = built(SwiGLU("mlp", SwiGLUConfig(D, H, bias=bias), device="CPU"), (B, T, D), mode)
        assert mlp._packed_weight() is None
        assert "gate_up" not in mlp._state
        x = rng.standard_normal((B, 1, D)).astype(np.float32)
        steps, y = mlp._bind_forward(x)
        assert len(steps) == 4
        _run(steps)
        np.testing.assert_allclose(y, mlp.forward(x), rtol=1e-6, atol=1e-6)


def test_cpu_a_failed_packed_build_leaves_no_packed_view() -> None:
    mlp2 = SwiGLU("mlp", SwiGLUConfig(D, H), device="CPU")

    def refuse(build_context: BuildContext) -> None:
        raise RuntimeError("up_proj refuses")

    mlp2.up_proj._on_building = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="refuses"):
        mlp2.build(BuildContext((B, T, D), INFERENCE))
    assert mlp2.gate_proj._packed_weight is None and mlp2.up_proj._packed_weight is None
    assert not mlp2.is_built and mlp2.get_memory_stats().total_bytes == 0


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_component_in_16_bits_matches_its_float64_twin(device, precision: Precision, rng) -> None:
    """A 16-bit SwiGLU against the float64 CPU layer of the same values, forward and
    backward (see :func:`check_16_bit_twin`)."""
    skip_bf16_without_arrays(device, precision)
    check_16_bit_twin(
        lambda p, d: SwiGLU("mlp", SwiGLUConfig(24, 40), device=d, precision=p),
        (2, 3, 24),
        lambda rng, dtype: (rng.standard_normal((2, 3, 24)).astype(dtype),),
        device,
        precision,
        rng,
    )


def test_cpu_16_bit_inference_builds_pack_gate_and_up_as_rows() -> None:
    """A 16-bit CPU INFERENCE build keeps its packed gate/up weight ``[out, in]`` (the decode
    kernel streams rows); an FP32 one stores it transposed (the product widens)."""
    for precision, rows in ((Precision.FP32, False), (Precision.BF16, True)):
        mlp = built(
            SwiGLU("mlp", SwiGLUConfig(16, 24), device="CPU", precision=precision),
            (1, 16),
            INFERENCE,
        )
        packed = mlp._packed_weight()
        assert packed is not None and packed.flags.c_contiguous is rows


# ------------------------------------------------------------------ CUDA op against the CPU op


def test_cuda_op_with_an_in_place_backward_matches_the_cpu_op(cuda_ctx, rng) -> None:
    """Gates where exp overflows give the limits, no NaN; the backward matches with separate
    gradients and with ``dgate`` the upstream gradient itself, as the component calls it."""
    op = create_op("SwiGLUOp", cuda_ctx, None, Precision.FP32)
    g, u, dh = f32(rng, 2, 7, 96, scale=4.0), f32(rng, 2, 7, 96), f32(rng, 2, 7, 96)
    g[0, 0, :4] = [-100.0, 100.0, -1e4, 1e4]
    h = cupy.empty(g.shape, cupy.float32)
    op.forward(dev(g), dev(u), h)
    h_ref = np.empty_like(g)
    swiglu_forward(g, u, h_ref)
    close(h, h_ref)
    dg_ref, du_ref = np.empty_like(g), np.empty_like(g)
    with np.errstate(over="ignore"):
        swiglu_backward(g, u, dh, dg_ref, du_ref)
    dgate, dup = cupy.empty(g.shape, cupy.float32), cupy.empty(g.shape, cupy.float32)
    op.backward(dev(g), dev(u), dev(dh), dgate, dup)
    close(dgate, dg_ref)
    close(dup, du_ref)
    dgate, dup = dev(dh), cupy.empty(g.shape, cupy.float32)
    op.backward(dev(g), dev(u), dgate, dgate, dup)  # in place, as the component calls it
    close(dgate, dg_ref)
    close(dup, du_ref)
    assert np.isfinite(host(h)).all() and np.isfinite(host(dgate)).all()


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_in_16_bits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """``swiglu_*<mila_bf16 | mila_half>`` against the CPU op in the same precision, the
    backward in place (``dgate`` the upstream gradient itself, as the component calls it)."""
    p, dtype = precision, precision.numpy_dtype
    gpu, cpu = create_op("SwiGLUOp", cuda_ctx, None, p), create_op("SwiGLUOp", CPU, None, p)
    g, u = f32(rng, 3, 4, 50, scale=4.0).astype(dtype), f32(rng, 3, 4, 50).astype(dtype)
    gg, gu = dev(g), dev(u)
    h, h_ref = cupy.empty(g.shape, dtype), np.empty_like(g)
    gpu.forward(gg, gu, h)
    cpu.forward(g, u, h_ref)
    agree(h, h_ref, p)
    dh = f32(rng, 3, 4, 50).astype(dtype)
    dg, dg_ref = dev(dh), dh.copy()
    du, du_ref = cupy.empty(g.shape, dtype), np.empty_like(g)
    gpu.backward(gg, gu, dg, dg, du)
    cpu.backward(g, u, dg_ref, dg_ref, du_ref)
    agree(dg, dg_ref, p)
    agree(du, du_ref, p)
