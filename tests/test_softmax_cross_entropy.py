"""SoftmaxCrossEntropy: loss against a float64 formula and torch, ignore_index, stability,
gradient against finite differences, lifecycle, memory, on every device (``device``: CPU, CUDA:0,
emulated CUDA:0); ``test_cpu_*`` check the NumPy op's own float64 and overflow-free math,
``test_cuda_op_*`` the CUDA op against the CPU op."""

from __future__ import annotations

import math

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
    INFERENCE,
    TRAINING,
    assert_gradients,
    assert_unchanged,
    built,
    distinct_nbytes,
    f32,
    owned_arrays,
    snapshot,
)

from mila_py import BuildContext, Precision, TrainingMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.devices import create_execution_context
from mila_py.ops.cpu.softmax_cross_entropy import (
    softmax_cross_entropy_backward,
    softmax_cross_entropy_forward,
)
from mila_py.ops.registry import create_op

B, T, V = 3, 4, 9
IGNORE = -100
#: the CPU ops a CUDA op is checked against
CPU = create_execution_context("CPU")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2718)


def make(
    mode=TRAINING, shape=(B, T, V), ignore_index: int = IGNORE, device: str = "CPU"
) -> SoftmaxCrossEntropy:
    cfg = SoftmaxCrossEntropyConfig(V, ignore_index)
    return built(SoftmaxCrossEntropy("loss", cfg, device=device), shape, mode)


def inputs(rng, lead=(B, T), scale: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
    logits = (rng.standard_normal((*lead, V)) * scale).astype(np.float32)
    targets = rng.integers(0, V, lead)
    return logits, targets


def reference(logits: np.ndarray, targets: np.ndarray, ignore: int = IGNORE) -> float:
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    t = targets.reshape(-1)
    keep = t != ignore
    log_probs = z - z.max(1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(1, keepdims=True))
    return float(-log_probs[keep, t[keep]].mean()) if keep.any() else math.nan


def reference_grad(logits: np.ndarray, targets: np.ndarray, ignore: int = IGNORE) -> np.ndarray:
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = targets != ignore
    onehot = np.eye(logits.shape[-1])[np.where(keep, targets, 0)]
    return (p - onehot) * keep[..., None] / max(1, keep.sum())


# ------------------------------------------------------------------------------- config
def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SoftmaxCrossEntropyConfig(0)
    with pytest.raises(TypeError, match="ignore_index"):
        SoftmaxCrossEntropyConfig(4, ignore_index=None)  # type: ignore[arg-type]
    assert SoftmaxCrossEntropyConfig(4).ignore_index == -100


def test_construction_allocates_nothing_in_every_cpu_precision() -> None:
    loss = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(V), device="CPU")
    assert not loss.is_built and loss.get_memory_stats().total_bytes == 0
    for precision in Precision:  # every one the CPU stores, 16-bit storage included
        loss = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(V), device="CPU", precision=precision
        )
        assert loss.precision is precision and loss.get_memory_stats().total_bytes == 0


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("lead", [(B, T), (1, 1), (2, 3)])
def test_loss_matches_float64_reference(device, lead, rng) -> None:
    loss = make(device=device)
    logits, targets = inputs(rng, lead)
    targets[0, 0] = IGNORE
    value = loss.forward(on(device, logits), on(device, targets))
    assert isinstance(value, float)
    if targets.size == 1:
        assert math.isnan(value)
    else:
        assert value == pytest.approx(reference(logits, targets), rel=1e-6)


def test_loss_and_gradient_match_torch(device, rng) -> None:
    torch = pytest.importorskip("torch")
    loss = make(device=device)
    logits, targets = inputs(rng)
    targets[1, :2] = IGNORE
    z = torch.from_numpy(logits).requires_grad_()
    expected = torch.nn.functional.cross_entropy(
        z.reshape(-1, V), torch.from_numpy(targets).reshape(-1), ignore_index=IGNORE
    )
    expected.backward()
    value = loss.forward(on(device, logits), on(device, targets))
    assert value == pytest.approx(expected.item(), rel=1e-6)
    np.testing.assert_allclose(host(loss.backward()), z.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_cpu_large_logits_are_stable(rng) -> None:
    """NumPy raises on any overflow here (``test_cuda_op_of_large_logits_is_exact`` is the
    CUDA op's)."""
    loss = make()
    logits, targets = inputs(rng)
    logits += np.float32(1e4)  # exp would overflow without the max subtraction
    logits[0, 0, 3] = -1e4
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        value = loss.forward(logits, targets)
        grad = loss.backward()
    # as accurate as at small logits: the log-sum next to a large max is not rounded away
    assert value == pytest.approx(reference(logits, targets), rel=1e-7)
    want = reference_grad(logits, targets)
    np.testing.assert_allclose(grad, want, rtol=0, atol=1e-7 * np.abs(want).max())
    # three equal logits of 1e7: lse = 1e7 + log 3 is 1e7 + 1 in float32
    z, t, lse = np.full((1, 1, 3), 1e7, np.float32), np.array([[0]]), np.empty((1, 1), np.float32)
    got, _ = softmax_cross_entropy_forward(z, t, IGNORE, lse)
    assert got == pytest.approx(math.log(3), rel=1e-12)
    dz = np.empty_like(z)
    softmax_cross_entropy_backward(z, t, IGNORE, lse, dz, 1.0)
    np.testing.assert_allclose(dz[0, 0], [-2 / 3, 1 / 3, 1 / 3], rtol=1e-6)


def test_ignore_index_inside_the_vocabulary(device, rng) -> None:
    loss = make(ignore_index=0, device=device)
    logits, targets = inputs(rng)
    targets[:, 0] = 0
    value = loss.forward(on(device, logits), on(device, targets))
    assert value == pytest.approx(reference(logits, targets, 0), rel=1e-6)
    np.testing.assert_allclose(
        host(loss.backward()), reference_grad(logits, targets, 0), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("ignore", [IGNORE, -1])
def test_all_targets_ignored_gives_nan_loss_and_zero_gradient(device, ignore: int, rng) -> None:
    loss = make(ignore_index=ignore, device=device)
    logits, _ = inputs(rng)
    assert math.isnan(loss.forward(on(device, logits), on(device, np.full((B, T), ignore))))
    assert not host(loss.backward()).any()


# ------------------------------------------------------------------------------- backward
def test_backward_float64_matches_finite_differences(rng) -> None:
    logits = rng.standard_normal((2, 3, 5)) * 2
    targets = np.array([[4, IGNORE, 0], [2, 2, 1]])
    lse = np.empty((2, 3))

    def objective() -> float:
        return softmax_cross_entropy_forward(logits, targets, IGNORE, lse)[0]

    value, count = softmax_cross_entropy_forward(logits, targets, IGNORE, lse)
    assert count == 5 and value == pytest.approx(reference(logits, targets), rel=1e-14)
    dlogits = np.empty_like(logits)
    softmax_cross_entropy_backward(logits, targets, IGNORE, lse, dlogits, 1.0 / count)
    assert not dlogits[0, 1].any()  # the ignored row
    assert_gradients(objective, {"logits": (logits, dlogits)})


def test_component_gradient_matches_formula_and_scales(device, rng) -> None:
    loss = make(device=device)
    logits, targets_host = inputs(rng, (2, 3))
    targets_host[1, 2] = IGNORE
    targets = on(device, targets_host)
    loss.forward(on(device, logits), targets)
    expected = reference_grad(logits, targets_host)
    targets[...] = 0  # the caller may reuse its array: the component kept a copy
    grad = loss.backward()
    assert grad.shape == logits.shape
    if device == "CPU":  # NumPy can tell; a CuPy array's memory is not NumPy's
        assert np.shares_memory(grad, owned_arrays(loss)["s:loss.dinput"])
    np.testing.assert_allclose(host(grad), expected, rtol=1e-5, atol=1e-7)
    once = host(grad).copy()
    np.testing.assert_allclose(host(loss.backward(0.25)), 0.25 * once, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(host(loss.backward()), once, rtol=0, atol=0)  # idempotent
    assert loss.get_gradients() == []  # no parameters


def test_eval_mode_runs_as_normal_mode(device, rng) -> None:
    """EVAL changes nothing the loss computes: the same value and gradient as a NORMAL twin."""
    loss, twin = make(device=device), make(device=device)
    loss.set_training_mode(TrainingMode.EVAL)
    logits, targets = (on(device, a) for a in inputs(rng, (1, 2)))
    assert loss.forward(logits, targets) == twin.forward(logits, targets)
    np.testing.assert_array_equal(host(loss.backward()), host(twin.backward()))


# ------------------------------------------------------------------------------- lifecycle
def test_inference_build_has_no_gradient_buffer_and_backward_raises(device, rng) -> None:
    loss = make(mode=INFERENCE, device=device)
    logits, targets = inputs(rng)
    value = loss.forward(on(device, logits), on(device, targets))
    assert value == pytest.approx(reference(logits, targets), rel=1e-6)
    assert "s:loss.dinput" not in owned_arrays(loss)
    with pytest.raises(RuntimeError, match="INFERENCE"):
        loss.backward()


def test_backward_before_forward_raises(device) -> None:
    with pytest.raises(RuntimeError, match="forward"):
        make(device=device).backward()


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("target-too-big", ValueError, f"target {V} is out of range"),
        ("target-negative", ValueError, "target -1 is out of range"),
        ("float-targets", TypeError, "integers"),
        ("float64-logits", TypeError, "dtype"),
        ("shape-mismatch", ValueError, "leading shape"),
        ("too-long", ValueError, "exceeds the build shape"),
        ("width", ValueError, "must be"),
    ],
)
def test_bad_forward_leaves_everything_unchanged(device, case, error, match, rng) -> None:
    loss = make(device=device)
    loss.forward(*(on(device, a) for a in inputs(rng)))
    loss.backward()
    logits, targets = inputs(rng)
    if case == "target-too-big":
        targets[1, 1] = V
    elif case == "target-negative":
        targets[2, 3] = -1
    elif case == "float-targets":
        targets = targets.astype(np.float32)
    elif case == "float64-logits":
        logits = logits.astype(np.float64)
    elif case == "shape-mismatch":
        targets = targets[:, :2]
    elif case == "too-long":
        logits, targets = inputs(rng, (B, T + 1))
    elif case == "width":
        logits = np.zeros((B, T, V + 1), np.float32)
    logits, targets = on(device, logits), on(device, targets)
    saved = snapshot(loss, logits, targets)
    with pytest.raises(error, match=match):
        loss.forward(logits, targets)
    assert_unchanged(loss, saved, logits, targets)


@pytest.mark.parametrize(
    ("dloss", "error"), [("1", TypeError), (True, TypeError), (math.inf, ValueError)]
)
def test_bad_dloss_leaves_everything_unchanged(device, dloss, error, rng) -> None:
    loss = make(device=device)
    loss.forward(*(on(device, a) for a in inputs(rng)))
    saved = snapshot(loss)
    with pytest.raises(error, match="dloss"):
        loss.backward(dloss)
    assert_unchanged(loss, saved)


def test_bad_build_shape_rolls_back(device) -> None:
    loss = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(V), device=device)
    with pytest.raises(ValueError, match="input_shape"):
        loss.build(BuildContext((B, T, V - 1), TRAINING))
    assert not loss.is_built and loss.get_memory_stats().total_bytes == 0
    built(loss, (B, T, V))


@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
def test_memory_stats_count_every_owned_array_once(device, mode) -> None:
    loss = make(mode, device=device)
    stats = loss.get_memory_stats()
    assert stats.parameter_bytes == 0 and stats.gradient_bytes == 0
    # lse [B, T] float32 (+ targets [B, T] int64, dinput [B, T, V] float32)
    training = mode is TRAINING
    assert stats.state_bytes == B * T * 4 + ((B * T * 8 + B * T * V * 4) if training else 0)
    assert stats.total_bytes == distinct_nbytes(list(owned_arrays(loss).values()))


@pytest.mark.parametrize("precision", PRECISIONS_16)
def test_the_loss_of_16_bit_logits_is_computed_in_float32(device, precision: Precision, rng):
    """The loss of 16-bit logits equals the float64 loss of the same values to float32
    accuracy (nothing is rounded to 16 bits before the loss); ``dlogits`` is 16-bit, rounded
    once from the exact gradient: bit for bit on the CPU (float32 then 16 bits), to a rounding
    elsewhere (another ``exp``, another summation order)."""
    skip_bf16_without_arrays(device, precision)
    shape, dtype = (2, 3, 50), precision.numpy_dtype
    cfg = SoftmaxCrossEntropyConfig(50)
    loss = built(SoftmaxCrossEntropy("ce", cfg, device=device, precision=precision), shape)
    logits = (4 * rng.standard_normal(shape)).astype(dtype)
    targets = rng.integers(0, 50, shape[:2])
    targets[0, 1] = -100
    value = loss.forward(on(device, logits), on(device, targets))
    assert float(value) == pytest.approx(reference(logits, targets, -100), rel=1e-6)
    d = loss.backward()
    assert d.dtype == dtype
    exact = reference_grad(logits, targets, -100)
    if device == "CPU":
        np.testing.assert_array_equal(d, exact.astype(np.float32).astype(dtype))
    else:
        agree(d, exact, precision, units=1.0)


# ------------------------------------------------------------------ CUDA op against the CPU op


@pytest.mark.parametrize("vocab", [5, 300, 1031, 32000])
def test_cuda_op_matches_the_cpu_op(cuda_ctx, rng, vocab: int) -> None:
    op = create_op(
        "SoftmaxCrossEntropyOp", cuda_ctx, SoftmaxCrossEntropyConfig(vocab), Precision.FP32
    )
    logits = f32(rng, 2, 5, vocab, scale=5.0)
    targets = rng.integers(0, vocab, size=(2, 5))
    targets[0, 1] = targets[1, 4] = -100
    lse = cupy.empty((2, 5), cupy.float32)
    loss, count = op.forward(dev(logits), dev(targets), lse)
    lse_ref = np.empty((2, 5), np.float32)
    loss_ref, count_ref = softmax_cross_entropy_forward(logits, targets, -100, lse_ref)
    assert count == count_ref == 8
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    close(lse, lse_ref)
    d = cupy.empty(logits.shape, cupy.float32)
    op.backward(dev(logits), dev(targets), lse, d, 0.37 / count)
    d_ref = np.empty_like(logits)
    softmax_cross_entropy_backward(logits, targets, -100, lse_ref, d_ref, 0.37 / count)
    close(d, d_ref, atol=1e-8)
    assert not host(d)[0, 1].any() and not host(d)[1, 4].any()  # ignored rows: zero


@pytest.mark.parametrize("shift", [1e4, 1e7])
def test_cuda_op_of_large_logits_is_exact(cuda_ctx, rng, shift: float) -> None:
    """Max and log-sum apart in float64, and a backward that renormalizes each row (as the CPU
    op): logits around 1e4 lost ~2e-5 of the loss; three equal logits of 1e7 gave 1.0 for
    log 3."""
    vocab = 3 if shift == 1e7 else 50
    op = create_op(
        "SoftmaxCrossEntropyOp", cuda_ctx, SoftmaxCrossEntropyConfig(vocab), Precision.FP32
    )
    logits = np.full((1, 4, vocab), shift, np.float32)
    if shift == 1e4:
        logits += f32(rng, 1, 4, vocab, scale=3.0)
    targets = rng.integers(0, vocab, size=(1, 4))
    z = logits.astype(np.float64).reshape(4, vocab)
    m = z.max(axis=1, keepdims=True)
    log_sum = np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    want = float(np.mean((m - z[np.arange(4), targets[0]][:, None]) + log_sum))
    lse = cupy.empty((1, 4), cupy.float32)
    loss, count = op.forward(dev(logits), dev(targets), lse)
    assert count == 4 and loss == pytest.approx(want, rel=1e-6, abs=1e-6)
    d = cupy.empty(logits.shape, cupy.float32)
    op.backward(dev(logits), dev(targets), lse, d, 1.0 / count)
    p = np.exp(z - m - log_sum)
    p[np.arange(4), targets[0]] -= 1.0
    np.testing.assert_allclose(host(d).reshape(4, vocab), p / count, rtol=0, atol=2e-7)


@pytest.mark.parametrize("precision", REDUCED_PARAMS)
def test_cuda_op_of_16_bit_logits_matches_the_cpu_op(cuda_ctx, rng, precision: Precision) -> None:
    """The loss and log-sum-exp of 16-bit logits in float32, the 16-bit gradient to a
    rounding, zero at an ignored target."""
    p, dtype, vocab = precision, precision.numpy_dtype, 300
    cfg = SoftmaxCrossEntropyConfig(vocab)
    gpu = create_op("SoftmaxCrossEntropyOp", cuda_ctx, cfg, p)
    cpu = create_op("SoftmaxCrossEntropyOp", CPU, cfg, p)
    logits = f32(rng, 2, 5, vocab, scale=5.0).astype(dtype)
    targets = rng.integers(0, vocab, (2, 5))
    targets[1, 2] = -100
    gl, gt = dev(logits), dev(targets)
    lse, lse_ref = cupy.empty((2, 5), cupy.float32), np.empty((2, 5), np.float32)
    loss, count = gpu.forward(gl, gt, lse)
    loss_ref, count_ref = cpu.forward(logits, targets, lse_ref)
    assert count == count_ref == 9
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)
    close(lse, lse_ref, rtol=1e-6, atol=0.0)
    d, d_ref = cupy.empty((2, 5, vocab), dtype), np.empty((2, 5, vocab), dtype)
    gpu.backward(gl, gt, lse, d, 0.1)
    cpu.backward(logits, targets, lse_ref, d_ref, 0.1)
    agree(d, d_ref, p)
    assert not host(d)[1, 2].astype(np.float32).any()
