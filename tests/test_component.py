"""mila_py.component: the Component lifecycle, hooks, training mode, parameters and memory."""

from __future__ import annotations

import numpy as np
import pytest

from mila_py import (
    BuildContext,
    Component,
    DeviceId,
    MemoryStats,
    Precision,
    RuntimeMode,
    TrainingMode,
)
from mila_py.devices import CpuExecutionContext, ExecutionContext, create_execution_context
from mila_py.devices.device import DeviceType
from mila_py.ops.operation import Operation
from mila_py.ops.registry import create_op, register_op

TRAIN = RuntimeMode.TRAINING
INFER = RuntimeMode.INFERENCE


def train_ctx(*shape: int) -> BuildContext:
    return BuildContext(shape or (2, 4), TRAIN)


def infer_ctx(*shape: int) -> BuildContext:
    return BuildContext(shape or (2, 4), INFER)


# ---------------------------------------------------------------------------- test components
class Linear(Component):
    """y = x W^T + b: a weight (out, in) and a bias (out,), initialized to 0.5 / 0.25."""

    def __init__(
        self,
        name: str,
        in_features: int = 4,
        out_features: int = 3,
        *,
        device=None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"{name}: features must be positive")
        self.in_features = in_features
        self.out_features = out_features

    def _on_building(self, build_context: BuildContext) -> None:
        if build_context.input_shape[-1] != self.in_features:
            raise ValueError(
                f"{self.name}: input has {build_context.input_shape[-1]} features, "
                f"expected {self.in_features}"
            )
        weight = self._add_parameter(
            "weight", self._allocate((self.out_features, self.in_features))
        )
        bias = self._add_parameter("bias", self._allocate((self.out_features,)))
        if build_context.should_initialize_parameters:
            weight.fill(0.5)
            bias.fill(0.25)


class FailingLeaf(Linear):
    """Allocates parameters and state, then raises while ``fail`` is set."""

    def __init__(self, name: str, *, fail: bool = True, **kwargs) -> None:
        super().__init__(name, **kwargs)
        self.fail = fail
        self.attempts: list[BuildContext] = []  # a list: a rollback restores attributes, not it

    def _on_building(self, build_context: BuildContext) -> None:
        self.attempts.append(build_context)
        super()._on_building(build_context)
        self._add_state("cache", self._allocate((64,)))
        self.half_built_marker = True
        if self.fail:
            raise RuntimeError(f"{self.name}: simulated failure after allocating")


class Recorder(Component):
    """Records every hook call; can be told to fail a hook."""

    def __init__(self, name: str, *, fail_context_times: int = 0, fail_mode=None, **kwargs):
        super().__init__(name, **kwargs)
        self.calls: list[tuple] = []
        # Kept in a dict: a rollback restores attributes, not the contents of this dict.
        self.failures_left = {"context": fail_context_times}
        self.fail_mode = fail_mode

    def _on_execution_context_set(self) -> None:
        self.calls.append(("context", self.execution_context))
        self.context_marker = True
        if self.failures_left["context"] > 0:
            self.failures_left["context"] -= 1
            raise RuntimeError(f"{self.name}: simulated context failure")

    def _on_building(self, build_context: BuildContext) -> None:
        self.calls.append(("build", build_context))

    def _on_training_mode_changing(self, mode: TrainingMode) -> None:
        self.calls.append(("mode", mode, self.training_mode))
        if mode is self.fail_mode:
            raise RuntimeError(f"{self.name}: simulated mode failure")


@register_op("TestOnlyOp_component_table", DeviceType.CPU, precisions=[Precision.FP32])
class _TableOp(Operation):
    """An op that owns a state table (allocated at build)."""

    def build(self, build_context: BuildContext) -> None:
        super().build(build_context)
        self.table = self.context.allocate((8, 2), np.float32)

    def state_arrays(self) -> list:
        table = self.__dict__.get("table")
        return [] if table is None else [table]


class WithOp(Component):
    """A leaf that creates its op when the context arrives and builds it with itself."""

    def _on_execution_context_set(self) -> None:
        self.op = create_op("TestOnlyOp_component_table", self.execution_context, None, FP32)

    def _on_building(self, build_context: BuildContext) -> None:
        self._add_parameter("scale", self._allocate((4,)))
        self.op.build(build_context)


FP32 = Precision.FP32


def _sizes(component: Component) -> list[int]:
    return [int(p.size) for p in component.get_parameters()]


# ---------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    "name",
    ["a", "Z", "a" * 128, "layer0", "block.0.attn", "q_proj", "up-proj", "A1._-z", "x" + "9" * 127],
)
def test_valid_names(name: str) -> None:
    assert Component(name).name == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "a" * 129,
        "1layer",
        "_private",
        ".dot",
        "-dash",
        "has space",
        "slash/name",
        "colon:name",
        "tab\tname",
        "trailing\n",
        "\nleading",
        "ünïcode",
        "emoji😀",
    ],
)
def test_invalid_names_raise_value_error(name: str) -> None:
    with pytest.raises(ValueError, match="name"):
        Component(name)


@pytest.mark.parametrize("name", [None, 7, b"bytes"])
def test_non_string_names_raise_type_error(name) -> None:
    with pytest.raises(TypeError):
        Component(name)


def test_precision_must_be_a_precision() -> None:
    with pytest.raises(TypeError, match="precision"):
        Component("c", precision="FP32")  # type: ignore[arg-type]
    assert Component("c", precision=Precision.BF16).precision is Precision.BF16


def test_malformed_device_raises_value_error() -> None:
    with pytest.raises(ValueError):
        Linear("lin", device="tpu:0")


# ---------------------------------------------------------------------------- construction
def test_construction_without_device_allocates_nothing_and_has_no_context() -> None:
    lin = Linear("lin")
    assert not lin.has_execution_context
    assert not lin.is_built
    assert lin.training_mode is None
    assert not lin.is_training_mode
    assert lin.get_parameters() == []
    assert lin.get_gradients() == []
    assert lin.parameter_count() == 0
    assert lin.get_memory_stats() == MemoryStats()
    with pytest.raises(RuntimeError, match="no execution context"):
        _ = lin.execution_context
    with pytest.raises(RuntimeError, match="lin"):
        _ = lin.device_id
    with pytest.raises(RuntimeError, match="not built"):
        _ = lin.build_context
    with pytest.raises(RuntimeError):
        _ = lin.runtime_mode


def test_standalone_construction_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    allocations: list[tuple] = []
    original = CpuExecutionContext.allocate

    def counting(self, shape, dtype, *, zero=True):
        allocations.append(tuple(shape))
        return original(self, shape, dtype, zero=zero)

    monkeypatch.setattr(CpuExecutionContext, "allocate", counting)
    lin = Linear("lin", 4, 3, device="CPU")
    assert allocations == []
    assert lin.get_memory_stats().total_bytes == 0
    lin.build(train_ctx(2, 4))
    # weight, its gradient, bias, its gradient (the memory check before them sized the build
    # through buffers of one element)
    real = [shape for shape in allocations if shape != (1,)]
    assert sorted(real) == sorted([(3, 4), (3, 4), (3,), (3,)])


def test_standalone_leaf_owns_its_context(device: str) -> None:
    lin = Linear("lin", device=device)
    assert lin.has_execution_context
    assert isinstance(lin.execution_context, ExecutionContext)
    assert lin.device_id == DeviceId.parse(device)
    assert lin._owns_context
    assert not Linear("other")._owns_context


def test_standalone_cuda_without_cupy_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(RuntimeError, match=r"pip install -e \"\.\[cuda12\]\""):
        Linear("lin", device="CUDA:0")


# ---------------------------------------------------------------------------- execution context
def test_context_can_be_set_once() -> None:
    rec = Recorder("rec")
    first = create_execution_context("CPU")
    rec.set_execution_context(first)
    assert rec.execution_context is first
    assert rec.calls == [("context", first)]
    with pytest.raises(RuntimeError, match=r"rec.*only once"):
        rec.set_execution_context(create_execution_context("CPU"))
    assert rec.execution_context is first
    assert rec.calls == [("context", first)]


def test_standalone_context_cannot_be_replaced() -> None:
    lin = Linear("lin", device="CPU")
    ctx = lin.execution_context
    with pytest.raises(RuntimeError):
        lin.set_execution_context(create_execution_context("CPU"))
    assert lin.execution_context is ctx


def test_set_execution_context_needs_a_context() -> None:
    rec = Recorder("rec")
    with pytest.raises(TypeError):
        rec.set_execution_context("CPU")  # type: ignore[arg-type]
    assert not rec.has_execution_context
    assert rec.calls == []


def test_failing_context_hook_leaves_no_context_and_can_be_retried() -> None:
    rec = Recorder("rec", fail_context_times=1)
    ctx = create_execution_context("CPU")
    with pytest.raises(RuntimeError, match="simulated context failure"):
        rec.set_execution_context(ctx)
    assert not rec.has_execution_context
    assert "context_marker" not in rec.__dict__  # the hook's half-done work is undone
    with pytest.raises(RuntimeError):
        _ = rec.execution_context
    rec.set_execution_context(ctx)
    assert rec.execution_context is ctx
    assert rec.context_marker


def test_failing_context_hook_fails_standalone_construction() -> None:
    with pytest.raises(RuntimeError, match="simulated context failure"):
        Recorder("rec", fail_context_times=1, device="CPU")


def test_leaf_creates_its_op_when_the_context_arrives() -> None:
    leaf = WithOp("leaf")
    assert "op" not in leaf.__dict__
    leaf.set_execution_context(create_execution_context("CPU"))
    assert isinstance(leaf.op, _TableOp)
    assert leaf.op.context is leaf.execution_context


# ---------------------------------------------------------------------------- build
def test_build_without_context_raises_and_changes_nothing() -> None:
    lin = Linear("lin")
    with pytest.raises(RuntimeError, match=r"lin.*execution context"):
        lin.build(train_ctx())
    assert not lin.is_built
    assert lin.get_parameters() == []


def test_build_needs_a_build_context() -> None:
    lin = Linear("lin", device="CPU")
    with pytest.raises(TypeError, match="BuildContext"):
        lin.build((2, 4))  # type: ignore[arg-type]
    assert not lin.is_built


def test_build_allocates_parameters_and_gradients(device: str, host) -> None:
    lin = Linear("lin", 4, 3, device=device)
    bc = train_ctx(2, 5, 4)
    lin.build(bc)
    assert lin.is_built
    assert lin.build_context is bc
    assert lin.runtime_mode is TRAIN
    names = [name for name, _ in lin.named_parameters()]
    assert names == ["weight", "bias"]
    weight, bias = lin.get_parameters()
    assert weight.shape == (3, 4)
    assert bias.shape == (3,)
    assert weight.dtype == np.float32
    assert lin.execution_context.is_device_array(weight)
    np.testing.assert_array_equal(host(weight), np.full((3, 4), 0.5, np.float32))
    np.testing.assert_array_equal(host(bias), np.full((3,), 0.25, np.float32))
    grads = lin.get_gradients()
    assert [g.shape for g in grads] == [(3, 4), (3,)]
    assert all(not host(g).any() for g in grads)
    assert all(g is not p for g, p in zip(grads, lin.get_parameters(), strict=True))
    assert lin.parameter_count() == 3 * 4 + 3


def test_build_twice_raises_and_keeps_the_first_build() -> None:
    lin = Linear("lin", device="CPU")
    first = train_ctx()
    lin.build(first)
    params = lin.get_parameters()
    with pytest.raises(RuntimeError, match=r"lin.*already built"):
        lin.build(train_ctx())
    with pytest.raises(RuntimeError, match="already built"):
        lin.build(infer_ctx())
    assert lin.build_context is first
    assert all(a is b for a, b in zip(lin.get_parameters(), params, strict=True))


def test_rejected_build_context_leaves_the_component_unbuilt() -> None:
    lin = Linear("lin", 4, 3, device="CPU")
    with pytest.raises(ValueError, match="expected 4"):
        lin.build(train_ctx(2, 5))
    assert not lin.is_built
    lin.build(train_ctx(2, 4))
    assert lin.is_built


@pytest.mark.real_gpu("device memory statistics (the emulator keeps its arrays on the host)")
def test_failed_build_rolls_back_everything_and_can_be_retried(device: str) -> None:
    leaf = FailingLeaf("leaf", device=device)
    before = dict(leaf.__dict__)
    with pytest.raises(RuntimeError, match="simulated failure"):
        leaf.build(train_ctx(), check_memory=False)  # the hook runs once: no sizing pass
    assert len(leaf.attempts) == 1
    assert not leaf.is_built
    assert leaf.training_mode is None
    assert leaf.get_parameters() == []
    assert leaf.get_gradients() == []
    assert leaf.get_memory_stats() == MemoryStats()
    assert "half_built_marker" not in leaf.__dict__
    with pytest.raises(RuntimeError, match="not built"):
        _ = leaf.build_context
    assert leaf.__dict__ == before

    leaf.fail = False
    leaf.build(train_ctx(), check_memory=False)
    assert len(leaf.attempts) == 2
    assert leaf.is_built
    assert leaf.training_mode is TrainingMode.NORMAL
    # weight 3x4, bias 3 (+ the same again as gradients), cache 64, all float32
    stats = leaf.get_memory_stats()
    assert stats.device_parameter_bytes == (12 + 3) * 4
    assert stats.device_gradient_bytes == (12 + 3) * 4
    assert stats.device_state_bytes == 64 * 4


def test_failed_build_rolls_back_op_state() -> None:
    class FailingWithOp(WithOp):
        def _on_building(self, build_context: BuildContext) -> None:
            super()._on_building(build_context)
            raise RuntimeError("after op build")

    leaf = FailingWithOp("leaf", device="CPU")
    with pytest.raises(RuntimeError, match="after op build"):
        leaf.build(train_ctx())
    assert leaf.op.build_context is None
    assert "table" not in leaf.op.__dict__
    assert leaf.get_memory_stats() == MemoryStats()


def test_a_subclass_overriding_build_is_refused_at_class_creation() -> None:
    with pytest.raises(TypeError, match=r"Bad.*build.*_on_building"):

        class Bad(Component):
            def build(self, build_context: BuildContext) -> None:
                pass


def test_a_subclass_overriding_set_execution_context_is_refused() -> None:
    with pytest.raises(TypeError, match="set_execution_context"):

        class Bad(Component):
            def set_execution_context(self, context) -> None:
                pass


def test_overriding_build_deeper_in_the_hierarchy_is_refused_too() -> None:
    with pytest.raises(TypeError, match="build"):

        class Bad(Linear):
            def build(self, build_context: BuildContext) -> None:
                pass


# ---------------------------------------------------------------------------- modes
def test_training_builds_start_normal() -> None:
    lin = Linear("lin", device="CPU")
    lin.build(train_ctx())
    assert lin.training_mode is TrainingMode.NORMAL
    assert lin.is_training_mode


def test_inference_builds_report_eval_and_refuse_mode_changes() -> None:
    rec = Recorder("rec", device="CPU")
    rec.build(infer_ctx())
    assert rec.training_mode is TrainingMode.EVAL
    assert not rec.is_training_mode
    for mode in TrainingMode:
        with pytest.raises(RuntimeError, match=r"rec.*INFERENCE"):
            rec.set_training_mode(mode)
    with pytest.raises(RuntimeError):
        rec.train()
    assert rec.training_mode is TrainingMode.EVAL
    assert [c for c in rec.calls if c[0] == "mode"] == []


def test_set_training_mode_before_build_raises() -> None:
    rec = Recorder("rec", device="CPU")
    with pytest.raises(RuntimeError, match=r"rec.*built"):
        rec.set_training_mode(TrainingMode.EVAL)
    assert rec.training_mode is None


def test_set_training_mode_needs_a_training_mode() -> None:
    rec = Recorder("rec", device="CPU")
    rec.build(train_ctx())
    with pytest.raises(TypeError):
        rec.set_training_mode("EVAL")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        rec.set_training_mode(RuntimeMode.INFERENCE)  # type: ignore[arg-type]
    assert rec.training_mode is TrainingMode.NORMAL


def test_mode_switch_calls_the_hook_and_the_same_mode_is_a_no_op() -> None:
    rec = Recorder("rec", device="CPU")
    rec.build(train_ctx())
    rec.set_training_mode(TrainingMode.NORMAL)
    assert [c for c in rec.calls if c[0] == "mode"] == []
    rec.set_training_mode(TrainingMode.EVAL)
    assert rec.training_mode is TrainingMode.EVAL
    # The hook runs before the change: it still sees the old mode.
    assert rec.calls[-1] == ("mode", TrainingMode.EVAL, TrainingMode.NORMAL)
    rec.eval()
    assert len([c for c in rec.calls if c[0] == "mode"]) == 1
    rec.train()
    assert rec.training_mode is TrainingMode.NORMAL
    assert rec.calls[-1] == ("mode", TrainingMode.NORMAL, TrainingMode.EVAL)


def test_failing_mode_hook_leaves_the_mode_unchanged() -> None:
    rec = Recorder("rec", device="CPU", fail_mode=TrainingMode.EVAL)
    rec.build(train_ctx())
    with pytest.raises(RuntimeError, match="simulated mode failure"):
        rec.eval()
    assert rec.training_mode is TrainingMode.NORMAL


# ---------------------------------------------------------------------------- parameters, gradients
def test_inference_builds_have_parameters_but_no_gradients(device: str, host) -> None:
    lin = Linear("lin", 4, 3, device=device)
    lin.build(infer_ctx())
    assert _sizes(lin) == [12, 3]
    assert lin.get_gradients() == []
    assert list(lin.named_gradients()) == []
    # INFERENCE builds expect loaded weights: nothing is initialized.
    assert not host(lin.get_parameters()[0]).any()
    stats = lin.get_memory_stats()
    assert stats.device_gradient_bytes == 0
    assert stats.device_parameter_bytes == 15 * 4


def test_parameters_keep_registration_order_and_gradients_follow_them() -> None:
    class Ordered(Component):
        def _on_building(self, build_context: BuildContext) -> None:
            self._add_parameter("zeta", self._allocate((2,)))
            self._add_parameter("alpha", self._allocate((3,)))
            self._add_parameter("frozen", self._allocate((4,)), with_gradient=False)
            self._add_gradient("input_grad", self._allocate((5,)))
            self._add_parameter("mid", self._allocate((6,)))

    comp = Ordered("ordered", device="CPU")
    comp.build(train_ctx())
    assert [n for n, _ in comp.named_parameters()] == ["zeta", "alpha", "frozen", "mid"]
    assert [g.shape for g in comp.get_gradients()] == [(2,), (3,), (6,)]  # aligned with params
    assert comp.get_memory_stats().device_gradient_bytes == (2 + 3 + 6 + 5) * 4
    assert comp.parameter_count() == 2 + 3 + 4 + 6


def test_zero_gradients() -> None:
    lin = Linear("lin", device="CPU")
    lin.build(train_ctx())
    for g in lin.get_gradients():
        g.fill(7.0)
    lin.zero_gradients()
    assert all(not g.any() for g in lin.get_gradients())
    assert all(p.any() for p in lin.get_parameters())


@pytest.mark.parametrize("precision", list(Precision))
def test_parameters_use_the_component_precision(precision: Precision) -> None:
    """Parameters in the component's precision; their gradients in its compute dtype (FP32
    for 16-bit parameters, the parameter's own dtype otherwise), counted by dtype too."""
    lin = Linear("lin", 4, 3, device="CPU", precision=precision)
    lin.build(train_ctx())
    assert all(p.dtype == precision.numpy_dtype for p in lin.get_parameters())
    wide = np.float32 if precision in (Precision.FP16, Precision.BF16) else precision.numpy_dtype
    assert all(g.dtype == wide for g in lin.get_gradients())
    itemsize = np.dtype(precision.numpy_dtype).itemsize
    stats = lin.get_memory_stats()
    assert stats.device_parameter_bytes == 15 * itemsize
    assert stats.device_gradient_bytes == 15 * np.dtype(wide).itemsize
    by_dtype = {str(precision): 15 * itemsize}
    by_dtype[str(Precision.from_dtype(wide))] = by_dtype.get(str(Precision.from_dtype(wide)), 0)
    by_dtype[str(Precision.from_dtype(wide))] += 15 * np.dtype(wide).itemsize
    assert stats.by_dtype == by_dtype


def test_add_parameter_outside_build_raises() -> None:
    comp = Component("c", device="CPU")
    with pytest.raises(RuntimeError, match="not built"):
        comp._add_parameter("w", np.zeros(3, np.float32))


# ---------------------------------------------------------------------------- memory
def test_memory_stats_count_op_state() -> None:
    leaf = WithOp("leaf", device="CPU")
    leaf.build(infer_ctx())
    stats = leaf.get_memory_stats()
    assert stats.device_parameter_bytes == 4 * 4
    assert stats.device_state_bytes == 8 * 2 * 4
    assert stats.host_total_bytes == 0


def test_shared_state_is_counted_once_within_a_component() -> None:
    class Sharing(Component):
        def _on_building(self, build_context: BuildContext) -> None:
            table = self._allocate((10,))
            self._add_state("cos", table)
            self._add_state("cos_alias", table)

    comp = Sharing("s", device="CPU")
    comp.build(infer_ctx())
    assert comp.get_memory_stats().device_state_bytes == 40


@pytest.mark.real_gpu("device memory statistics (the emulator keeps its arrays on the host)")
def test_host_buffers_of_device_components_are_host_memory(device: str) -> None:
    class Staging(Component):
        def _on_building(self, build_context: BuildContext) -> None:
            self._add_state("staging", np.zeros(16, np.float32))  # always a NumPy array
            self._add_state("scratch", self._allocate((8,)))

    comp = Staging("s", device=device)
    comp.build(infer_ctx())
    stats = comp.get_memory_stats()
    if DeviceId.parse(device).device_type is DeviceType.CPU:
        assert (stats.device_state_bytes, stats.host_state_bytes) == (96, 0)
    else:
        assert (stats.device_state_bytes, stats.host_state_bytes) == (32, 64)


# ---------------------------------------------------------------------------- repr
def test_repr_reports_name_params_device_and_state() -> None:
    lin = Linear("proj", 4, 3)
    text = repr(lin)
    assert text.startswith("Linear('proj'")
    assert "params=0" in text
    assert "unbuilt" in text
    assert "CPU" not in text
    lin = Linear("proj", 40, 30, device="CPU", precision=Precision.BF16)
    lin.build(train_ctx(1, 40))
    text = repr(lin)
    assert "params=1,230" in text
    assert "CPU:0" in text
    assert "BF16" in text
    assert "unbuilt" not in text and "built" in text
    assert "\n" not in text


@pytest.mark.parametrize("method", ["build", "set_execution_context"])
def test_final_methods_cannot_be_overridden_directly_or_through_a_mixin(method: str) -> None:
    def override(self, *args):
        return None

    with pytest.raises(TypeError, match=rf"overrides Component\.{method} \(in Direct\)"):
        type("Direct", (Component,), {method: override})
    mixin = type("Mixin", (), {method: override})
    with pytest.raises(TypeError, match=rf"overrides Component\.{method} \(in Mixin\)"):
        type("Mixed", (mixin, Component), {})
    # a mixin after Component in the MRO cannot shadow the final method: allowed
    assert issubclass(type("After", (Component, mixin), {}), Component)


def test_a_missing_op_names_the_precisions_its_device_has_or_says_there_is_none() -> None:
    from mila_py.ops.registry import OpNotFoundError

    @register_op("TestOnlyOp_fp32_layer", DeviceType.CPU, precisions=[Precision.FP32])
    class Fp32Only(Operation):
        pass

    class Narrow(Component):
        def _on_execution_context_set(self) -> None:
            self.op = create_op(
                "TestOnlyOp_fp32_layer", self.execution_context, None, self.precision
            )

        def _on_building(self, build_context: BuildContext) -> None:
            pass

    with pytest.raises(OpNotFoundError, match=r"a precision that device supports \(FP32\)"):
        Narrow("half", device="CPU", precision=Precision.FP16)

    class Unknown(Component):
        def _on_execution_context_set(self) -> None:
            self.op = create_op("NoSuchOp", self.execution_context, None, self.precision)

        def _on_building(self, build_context: BuildContext) -> None:
            pass

    with pytest.raises(OpNotFoundError, match="not registered for that device") as info:
        Unknown("unknown", device="CPU")
    assert "precision that device supports" not in str(info.value)


def test_a_gradient_on_an_inference_build_is_refused() -> None:
    class AsksForGradient(Component):
        def _on_building(self, build_context: BuildContext) -> None:
            self._add_parameter("w", self._allocate((2,)), with_gradient=True)

    leaf = AsksForGradient("leaf", device="CPU")
    with pytest.raises(ValueError, match="asks for a gradient on an INFERENCE build"):
        leaf.build(BuildContext((1, 2), RuntimeMode.INFERENCE))
    assert not leaf.is_built and leaf.get_parameters() == []
    leaf.build(BuildContext((1, 2), RuntimeMode.TRAINING))
    assert len(leaf.get_gradients()) == 1
