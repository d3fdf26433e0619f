"""Shared helpers of the layer tests: builds, snapshots, finite differences, tolerances."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py import BuildContext, Component, RuntimeMode

TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE

#: component (float32) against a float64 reference
RTOL32, ATOL32 = 2e-5, 2e-6
#: analytic float64 gradients against central differences
FD_RTOL = 1e-6
#: a float32 component on CUDA:0 against a float64 reference: a GPU's fused multiply-adds, fast
#: intrinsics (expf, rsqrtf) and its own summation orders cost a few more float32 roundings
GPU_RTOL32, GPU_ATOL32 = 1e-4, 1e-5


def tolerances(device: str) -> dict[str, float]:
    """``rtol`` / ``atol`` of a float32 component on ``device`` against a float64 reference."""
    if device == "CPU":
        return {"rtol": RTOL32, "atol": ATOL32}
    return {"rtol": GPU_RTOL32, "atol": GPU_ATOL32}


def to_host(x: Any) -> np.ndarray:
    """A host copy of ``x``: a NumPy or CuPy array (``.get()``), or a nested list."""
    get = getattr(x, "get", None)
    return np.array(get() if callable(get) else x, copy=True)


def built(
    component: Component,
    shape: tuple[int, ...],
    mode: RuntimeMode = TRAINING,
    *,
    initialize: bool | None = None,
) -> Any:
    """``component`` after ``build(BuildContext(shape, mode, initialize))``."""
    component.build(BuildContext(shape, mode, initialize_parameters=initialize))
    return component


def owned_arrays(component: Component) -> dict[str, np.ndarray]:
    """Every array the subtree registered, by ``kind:component.key`` (references, not copies)."""
    arrays: dict[str, np.ndarray] = {}
    for c in component._walk():
        tables = (
            ("p", c._parameters),
            ("g", c._gradients),
            ("gi", c.__dict__.get("_input_gradients", {})),
            ("s", c._state),
        )
        for kind, table in tables:
            for key, array in table.items():
                arrays[f"{kind}:{c.name}.{key}"] = array
    return arrays


def snapshot(component: Component, *inputs: Any) -> tuple[dict[str, np.ndarray], list[Any]]:
    """Host copies of the component's arrays and of ``inputs`` (on any device), for
    :func:`assert_unchanged`."""
    arrays = {k: to_host(v) for k, v in owned_arrays(component).items()}
    return arrays, [to_host(x) for x in inputs]


def assert_unchanged(
    component: Component, saved: tuple[dict[str, np.ndarray], list[Any]], *inputs: Any
) -> None:
    arrays, copies = saved
    now = owned_arrays(component)
    assert now.keys() == arrays.keys()
    for key, array in arrays.items():
        np.testing.assert_array_equal(to_host(now[key]), array, err_msg=key)
    for x, copy in zip(inputs, copies, strict=True):
        np.testing.assert_array_equal(to_host(x), copy)


def distinct_nbytes(arrays: list[np.ndarray]) -> int:
    """Bytes of the distinct arrays among ``arrays``."""
    unique = {id(a): a for a in arrays}
    return sum(int(a.nbytes) for a in unique.values())


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """``|actual - expected| / max(|actual|, |expected|)`` in the 2-norm (0 for two zeros)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.linalg.norm(actual), np.linalg.norm(expected))
    return 0.0 if scale == 0 else float(np.linalg.norm(actual - expected) / scale)


def numerical_gradient(
    objective: Callable[[], float], array: np.ndarray, eps: float = 1e-6
) -> np.ndarray:
    """Central differences of ``objective()`` with respect to every element of ``array``.

    ``array`` (float64) is perturbed in place and restored.
    """
    grad = np.zeros_like(array)
    for idx in np.ndindex(array.shape):
        old = array[idx]
        array[idx] = old + eps
        plus = objective()
        array[idx] = old - eps
        minus = objective()
        array[idx] = old
        grad[idx] = (plus - minus) / (2 * eps)
    return grad


def assert_gradients(
    objective: Callable[[], float], pairs: dict[str, tuple[np.ndarray, np.ndarray]]
) -> None:
    """For each ``name: (array, analytic gradient)``: analytic matches central differences."""
    for name, (array, analytic) in pairs.items():
        numeric = numerical_gradient(objective, array)
        err = rel_err(analytic, numeric)
        assert err < FD_RTOL, f"{name}: relative error {err:.2e} against finite differences"


def assert_same_optimizer_state(models: list[Any], plain: Any, fused: Any) -> None:
    """Two models updated by two AdamW instances hold bit-identical parameters and moments."""
    for (name, a), (_, b) in zip(
        models[0].named_parameters(), models[1].named_parameters(), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for m0, m1 in zip(plain._m + plain._v, fused._m + fused._v, strict=True):
        np.testing.assert_array_equal(m0, m1)


def move_optional_parameters(
    model: Component, rng: np.random.Generator, bias: float = 1.0, norm: float = 0.5
) -> None:
    """Biases (built as zeros) and norm weights (built as ones) get random values of scale
    ``bias`` / ``norm``, so that a test sees what they do."""
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p[...] = bias * rng.standard_normal(p.shape)
        if name.endswith("norm.weight"):
            p += norm * rng.standard_normal(p.shape)


#: builds whose memory a CUDA Llama and a CPU one compare (emulated and on a GPU)
MEMORY_BUILDS = [
    BuildContext((2, 16), TRAINING),
    BuildContext((1, 64), INFERENCE, prefill_size=8),
    BuildContext((3, 32), INFERENCE),
]


def cpu_stats_of_a_cuda_build(stats: Any, model: Any) -> Any:
    """The memory stats a CPU build of the built CUDA Llama ``model`` has, from the CUDA
    build's ``stats``: the same bytes plus, on INFERENCE builds, the CPU decode kernel's
    attention scores (``n_heads * context`` values of the compute dtype), which the CUDA kernel
    keeps on chip, and (without MLP biases) the packed gate/up product ``[B, 2 hidden_dim]``,
    which CUDA builds do not pack (one buffer: the layers share their activations)."""
    extra = 0
    cfg, item = model.config, model.precision.numpy_dtype.itemsize
    if model.build_context.is_inference:
        extra = cfg.n_heads * model.context_length * model.precision.compute_dtype.itemsize
        if not cfg.mlp_bias:
            n_b = model.build_context.input_shape[0]
            extra += n_b * 2 * cfg.hidden_dim * item
    return dataclasses.replace(stats, device_state_bytes=stats.device_state_bytes + extra)


def f32(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    """Standard normal float32 values of ``shape``, times ``scale``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


#: relative error (2-norm) of a 16-bit layer against its float64 twin on the same (16-bit)
#: values: the output's own rounding (2^-9 for BF16, 2^-12 for FP16) and 16-bit intermediates
TWIN_TOL = {"BF16": 1e-2, "FP16": 1e-3}


def check_16_bit_twin(
    make: Callable[[Any, str], Component],
    shape: tuple[int, ...],
    inputs: Callable[[np.random.Generator, np.dtype], tuple[np.ndarray, ...]],
    device: str,
    precision: Any,
    rng: np.random.Generator,
    stages: float = 1.0,
) -> None:
    """Forward and backward of a 16-bit TRAINING build on ``device`` against the float64 CPU
    build holding the same values: the output and input gradients in 16 bits (or float32), the
    parameter gradients float32, all within :data:`TWIN_TOL`; ``dy`` is given in the 16-bit
    dtype, then in float32 (taken as it is).

    Args:
        make: ``make(precision, device)`` -> the unbuilt component.
        shape: the build's input shape.
        inputs: ``inputs(rng, dtype)`` -> the forward's host arguments (floats in ``dtype``).
        device: where the 16-bit component runs.
        precision: BF16 or FP16.
        rng: draws the parameters (moved off their initial zeros and ones) and ``dy``.
        stages: the tolerance's multiple, for a layer that stores more 16-bit intermediates
            than one (each costs a rounding).
    """
    from cuda_arrays import host, on

    from mila_py import Precision

    dtype, tol = precision.numpy_dtype, stages * TWIN_TOL[str(precision)]
    layer = built(make(precision, device), shape, TRAINING)
    reference = built(make(Precision.FP64, "CPU"), shape, TRAINING)
    for p, q in zip(layer.get_parameters(), reference.get_parameters(), strict=True):
        moved = host(p).astype(np.float32) + 0.3 * rng.standard_normal(p.shape)
        values = moved.astype(dtype)
        p[...] = on(device, values)
        q[...] = values.astype(np.float64)
    args = inputs(rng, dtype)
    y = layer.forward(*(on(device, a) for a in args))
    wide = (a if np.issubdtype(a.dtype, np.integer) else a.astype(np.float64) for a in args)
    y_ref = reference.forward(*wide)
    assert y.dtype == dtype
    assert rel_err(host(y), y_ref) < tol
    dy = rng.standard_normal(y.shape)
    for given in (dy.astype(dtype), dy.astype(np.float32)):
        layer.zero_gradients()
        reference.zero_gradients()
        dx = layer.backward(on(device, given))
        dx_ref = reference.backward(given.astype(np.float64))
        for g in layer.get_gradients():
            assert g.dtype == np.float32
        if dx is not None:
            pairs = zip(dx, dx_ref, strict=True) if isinstance(dx, tuple) else [(dx, dx_ref)]
            for ours, theirs in pairs:
                assert ours.dtype in (dtype, np.float32)
                assert rel_err(host(ours), theirs) < tol
        ref_grads = {n: g for n, _, g in reference.named_parameter_gradients()}
        for name, _, g in layer.named_parameter_gradients():
            assert rel_err(host(g), ref_grads[name]) < tol, name


def never_capture(monkeypatch: Any, model: Any) -> None:
    """Make ``model``'s decode steps run eagerly (as on a stream without graphs) for the test,
    while every other model's steps capture as usual: its decode plans get eager steps."""
    from mila_py.devices.graph import Step
    from mila_py.models.llama import decode_plan

    ctx, graphed = model.execution_context, decode_plan.capture

    def eager_here(context: Any, calls: Any) -> Step:
        return Step(context, calls, None) if context is ctx else graphed(context, calls)

    monkeypatch.setattr(decode_plan, "capture", eager_here)
