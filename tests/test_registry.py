"""mila_py.ops.registry and mila_py.ops.operation: registering, finding and creating ops."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from mila_py.build_context import BuildContext, RuntimeMode
from mila_py.devices import DeviceType, create_execution_context
from mila_py.ops import registry
from mila_py.ops.operation import Operation, PositionalPairedOp
from mila_py.ops.registry import (
    OpNotFoundError,
    RegisteredOp,
    create_op,
    find_op,
    is_supported,
    register_op,
    registered_ops,
)
from mila_py.precision import Precision

FP32, FP16, BF16 = Precision.FP32, Precision.FP16, Precision.BF16
CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Ops registered by a test disappear after it, so tests cannot see each other's ops."""
    registered_ops()  # load the package's own ops first, so they stay after the test
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


@pytest.fixture
def cpu_ctx():
    return create_execution_context("CPU")


def _register_fp_op(name: str, device_type: DeviceType = CPU, precisions=(FP32, FP16)):
    @register_op(name, device_type, precisions=precisions)
    class TestOnlyOp(Operation):
        pass

    return TestOnlyOp


def test_register_then_create(cpu_ctx) -> None:
    config = {"channels": 8}
    cls = _register_fp_op("TestOnlyOp_create")
    op = create_op("TestOnlyOp_create", cpu_ctx, config, FP16)
    assert type(op) is cls
    assert op.context is cpu_ctx
    assert op.config is config
    assert op.precision is FP16
    assert op.build_context is None
    assert find_op("TestOnlyOp_create", CPU, FP32) is cls


def test_register_op_returns_the_class_unchanged() -> None:
    class Plain(Operation):
        pass

    assert register_op("TestOnlyOp_decorator", CPU, [FP32])(Plain) is Plain


def test_is_supported() -> None:
    _register_fp_op("TestOnlyOp_supported")
    assert is_supported("TestOnlyOp_supported", CPU, FP32)
    assert is_supported("TestOnlyOp_supported", CPU, FP16)
    assert not is_supported("TestOnlyOp_supported", CPU, BF16)
    assert not is_supported("TestOnlyOp_supported", CUDA, FP32)
    assert not is_supported("TestOnlyOp_never_registered", CPU, FP32)


def test_registered_ops_lists_entries_sorted_by_name_then_device() -> None:
    cuda_cls = _register_fp_op("TestOnlyOp_listed", CUDA, [BF16])
    cpu_cls = _register_fp_op("TestOnlyOp_listed", CPU, [FP32])
    _register_fp_op("TestOnlyOp_aaa_first", CPU, [FP32])
    entries = registered_ops()
    assert all(isinstance(e, RegisteredOp) for e in entries)
    keys = [(e.name, e.device_type.value) for e in entries]
    assert keys == sorted(keys)
    listed = {(e.name, e.device_type): e for e in entries}
    cpu_entry = listed[("TestOnlyOp_listed", CPU)]
    cuda_entry = listed[("TestOnlyOp_listed", CUDA)]
    assert cpu_entry.cls is cpu_cls
    assert cpu_entry.precisions == frozenset({FP32})
    assert cuda_entry.cls is cuda_cls
    assert cuda_entry.precisions == frozenset({BF16})
    assert ("TestOnlyOp_aaa_first", CPU) in listed


def test_same_name_on_two_devices_are_separate_entries() -> None:
    cpu_cls = _register_fp_op("TestOnlyOp_two_devices", CPU, [FP32])
    cuda_cls = _register_fp_op("TestOnlyOp_two_devices", CUDA, [FP16])
    assert cpu_cls is not cuda_cls
    assert find_op("TestOnlyOp_two_devices", CPU, FP32) is cpu_cls
    assert find_op("TestOnlyOp_two_devices", CUDA, FP16) is cuda_cls
    assert not is_supported("TestOnlyOp_two_devices", CPU, FP16)


def test_unknown_op_error_names_op_device_precision_and_lists_the_registry(cpu_ctx) -> None:
    _register_fp_op("TestOnlyOp_known", CPU, [FP32, FP16])
    with pytest.raises(OpNotFoundError) as info:
        create_op("TestOnlyOp_missing", cpu_ctx, None, BF16)
    message = str(info.value)
    assert "TestOnlyOp_missing" in message
    assert "CPU" in message
    assert "BF16" in message
    assert "TestOnlyOp_known/CPU[FP16,FP32]" in message
    assert isinstance(info.value, LookupError)


def test_unsupported_precision_is_refused_at_creation(cpu_ctx) -> None:
    _register_fp_op("TestOnlyOp_fp32_only", CPU, [FP32])
    with pytest.raises(OpNotFoundError) as info:
        create_op("TestOnlyOp_fp32_only", cpu_ctx, None, FP16)
    message = str(info.value)
    assert "TestOnlyOp_fp32_only" in message
    assert "FP16" in message
    assert "TestOnlyOp_fp32_only/CPU[FP32]" in message


def test_op_registered_only_for_cuda_is_not_found_on_cpu(cpu_ctx) -> None:
    _register_fp_op("TestOnlyOp_cuda_only", CUDA, [FP32])
    with pytest.raises(OpNotFoundError, match=r"TestOnlyOp_cuda_only.*CPU.*FP32"):
        create_op("TestOnlyOp_cuda_only", cpu_ctx, None, FP32)
    with pytest.raises(OpNotFoundError, match="TestOnlyOp_cuda_only/CUDA"):
        find_op("TestOnlyOp_cuda_only", CPU, FP32)


def test_registering_another_class_under_a_taken_key_raises() -> None:
    first = _register_fp_op("TestOnlyOp_taken", CPU, [FP32])

    class Other(Operation):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_op("TestOnlyOp_taken", CPU, [FP32])(Other)
    assert find_op("TestOnlyOp_taken", CPU, FP32) is first


def test_another_class_with_the_same_name_from_elsewhere_is_refused() -> None:
    first = _register_fp_op("TestOnlyOp_samename", CPU, [FP32])
    impostor = type(first.__name__, (Operation,), {"__qualname__": first.__qualname__})
    impostor.__module__ = "somewhere.else"
    with pytest.raises(ValueError, match="already registered"):
        register_op("TestOnlyOp_samename", CPU, [FP32])(impostor)
    assert find_op("TestOnlyOp_samename", CPU, FP32) is first


def test_re_registering_the_same_class_updates_its_precisions() -> None:
    cls = _register_fp_op("TestOnlyOp_again", CPU, [FP32])
    register_op("TestOnlyOp_again", CPU, [FP32, BF16])(cls)
    assert is_supported("TestOnlyOp_again", CPU, BF16)


@pytest.mark.parametrize(
    ("name", "device_type", "precisions", "error"),
    [
        ("TestOnlyOp_bad", CPU, [], ValueError),
        ("TestOnlyOp_bad", CPU, ["FP32"], ValueError),
        ("TestOnlyOp_bad", CPU, [FP32, "FP16"], ValueError),
        ("TestOnlyOp_bad", "CPU", [FP32], TypeError),
        ("", CPU, [FP32], ValueError),
        (None, CPU, [FP32], TypeError),
        ("TestOnlyOp_bad", DeviceType.CUDA, [FP32, Precision.FP64], ValueError),  # CPU only
    ],
)
def test_register_op_rejects_bad_arguments(name, device_type, precisions, error) -> None:
    before = registered_ops()
    with pytest.raises(error):
        register_op(name, device_type, precisions)
    assert registered_ops() == before


# ---------------------------------------------------------------------------- Operation base
def test_operation_base_state_and_build(cpu_ctx) -> None:
    class Cached(Operation):
        def build(self, build_context: BuildContext) -> None:
            super().build(build_context)
            self.table = self.context.allocate((5, 3), np.float32)
            self.scratch = self.context.allocate((7,), np.float16)

        def state_arrays(self):
            return [self.table, self.scratch]

    op = Cached(cpu_ctx, None, FP32)
    assert Operation(cpu_ctx, None, FP32).state_arrays() == []
    assert Operation(cpu_ctx, None, FP32).state_nbytes() == 0
    bc = BuildContext((1, 4), RuntimeMode.INFERENCE)
    op.build(bc)
    assert op.build_context is bc
    assert op.state_nbytes() == 5 * 3 * 4 + 7 * 2
    assert repr(op) == "Cached(CPU:0, FP32)"


# ---------------------------------------------------------------------------- PositionalPairedOp
def test_positional_paired_op_protocol(cpu_ctx) -> None:
    class Paired(Operation):
        def prefill(self, q, k, position_offset: int) -> None:
            pass

        def decode(self, q, k, position) -> None:
            pass

    class PrefillOnly(Operation):
        def prefill(self, q, k, position_offset: int) -> None:
            pass

    assert isinstance(Paired(cpu_ctx, None, FP32), PositionalPairedOp)
    assert not isinstance(PrefillOnly(cpu_ctx, None, FP32), PositionalPairedOp)
    assert not isinstance(Operation(cpu_ctx, None, FP32), PositionalPairedOp)


def test_ops_created_through_the_registry_keep_their_protocol(cpu_ctx) -> None:
    @register_op("TestOnlyOp_paired", CPU, [FP32])
    class Paired(Operation):
        def prefill(self, q, k, position_offset: int) -> None:
            self.last = ("prefill", position_offset)

        def decode(self, q, k, position) -> None:
            self.last = ("decode", position)

    op = create_op("TestOnlyOp_paired", cpu_ctx, None, FP32)
    assert isinstance(op, PositionalPairedOp)
    op.decode(None, None, 17)
    assert op.last == ("decode", 17)


def test_lookups_by_the_wrong_types_raise_type_error(cpu_ctx) -> None:
    """A string device or precision would find nothing and report a registered op as
    missing; a non-Operation would be registered and fail only when created."""
    _register_fp_op("TestOnlyOp_types")
    for device, precision in (("CPU", FP32), (CPU, "FP32"), (CPU, None)):
        with pytest.raises(TypeError, match="must be a"):
            find_op("TestOnlyOp_types", device, precision)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="must be a"):
            is_supported("TestOnlyOp_types", device, precision)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ExecutionContext"):
        create_op("TestOnlyOp_types", None, {}, FP32)  # type: ignore[arg-type]
    for not_an_op in (42, object, lambda ctx, cfg, p: None):
        with pytest.raises(TypeError, match="Operation subclasses"):
            register_op("TestOnlyOp_bad_class", CPU, [FP32])(not_an_op)  # type: ignore[type-var]
    assert not is_supported("TestOnlyOp_bad_class", CPU, FP32)
