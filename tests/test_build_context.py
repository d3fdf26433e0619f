"""mila_py.build_context: BuildContext, RuntimeMode, TrainingMode."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mila_py.build_context import BuildContext, RuntimeMode, TrainingMode

TRAIN = RuntimeMode.TRAINING
INFER = RuntimeMode.INFERENCE


def test_modes() -> None:
    assert [m.name for m in RuntimeMode] == ["INFERENCE", "TRAINING"]
    assert [m.name for m in TrainingMode] == ["NORMAL", "EVAL"]


def test_fields_and_defaults() -> None:
    bc = BuildContext((2, 16, 64), TRAIN)
    assert bc.input_shape == (2, 16, 64)
    assert bc.runtime_mode is TRAIN
    assert bc.prefill_size == 0


def test_shape_is_normalized_to_a_tuple_of_python_ints() -> None:
    bc = BuildContext([np.int64(2), 3], INFER)
    assert bc.input_shape == (2, 3)
    assert type(bc.input_shape) is tuple
    assert all(type(d) is int for d in bc.input_shape)
    hash(bc)  # a list input must not make the frozen value unhashable


def test_is_frozen() -> None:
    bc = BuildContext((1, 4), TRAIN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        bc.input_shape = (2, 4)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        bc.prefill_size = 3  # type: ignore[misc]
    assert bc.input_shape == (1, 4)
    assert bc.prefill_size == 0


def test_equality_and_hash() -> None:
    a = BuildContext((2, 8), TRAIN)
    b = BuildContext((2, 8), TRAIN, initialize_parameters=True)
    assert a == b
    assert hash(a) == hash(b)
    assert a != BuildContext((2, 8), INFER)
    assert a != BuildContext((2, 9), TRAIN)


def test_training_and_inference_predicates() -> None:
    train = BuildContext((1, 2), TRAIN)
    infer = BuildContext((1, 2), INFER)
    assert train.is_training and not train.is_inference
    assert infer.is_inference and not infer.is_training


def test_initialize_parameters_none_resolves_by_mode() -> None:
    train = BuildContext((1, 2), TRAIN)
    infer = BuildContext((1, 2), INFER)
    assert train.initialize_parameters is True
    assert train.should_initialize_parameters
    assert infer.initialize_parameters is False
    assert not infer.should_initialize_parameters


@pytest.mark.parametrize("mode", [TRAIN, INFER])
@pytest.mark.parametrize("flag", [True, False])
def test_explicit_initialize_parameters_wins(mode: RuntimeMode, flag: bool) -> None:
    bc = BuildContext((1, 2), mode, initialize_parameters=flag)
    assert bc.initialize_parameters is flag
    assert bc.should_initialize_parameters is flag


def test_with_shape_returns_a_modified_copy() -> None:
    bc = BuildContext((2, 16, 64), INFER, initialize_parameters=True, prefill_size=4)
    other = bc.with_shape((2, 1, 64))
    assert other is not bc
    assert other.input_shape == (2, 1, 64)
    assert (other.runtime_mode, other.initialize_parameters, other.prefill_size) == (
        INFER,
        True,
        4,
    )
    assert bc.input_shape == (2, 16, 64)
    assert bc.with_shape([3, 5]).input_shape == (3, 5)


def test_with_prefill_size_returns_a_modified_copy() -> None:
    bc = BuildContext((2, 16, 64), INFER)
    other = bc.with_prefill_size(8)
    assert other is not bc
    assert other.prefill_size == 8
    assert other.input_shape == bc.input_shape
    assert other.runtime_mode is INFER
    assert other.initialize_parameters is False
    assert bc.prefill_size == 0
    assert bc.with_prefill_size(0).prefill_size == 0


@pytest.mark.parametrize("shape", [(), [], (0,), (2, 0, 4), (-1, 4), (3, -2)])
def test_empty_or_non_positive_shapes_raise_value_error(shape) -> None:
    with pytest.raises(ValueError, match="input_shape"):
        BuildContext(shape, TRAIN)


@pytest.mark.parametrize("shape", [(), (0, 4), (4, -1)])
def test_with_shape_validates_too(shape) -> None:
    bc = BuildContext((1, 4), TRAIN)
    with pytest.raises(ValueError, match="input_shape"):
        bc.with_shape(shape)
    assert bc.input_shape == (1, 4)


@pytest.mark.parametrize("prefill", [-1, -100])
def test_negative_prefill_size_raises_value_error(prefill: int) -> None:
    with pytest.raises(ValueError, match="prefill_size"):
        BuildContext((1, 4), INFER, prefill_size=prefill)
    with pytest.raises(ValueError, match="prefill_size"):
        BuildContext((1, 4), INFER).with_prefill_size(prefill)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"input_shape": 5, "runtime_mode": TRAIN},
        {"input_shape": (2.0, 3), "runtime_mode": TRAIN},
        {"input_shape": (True, 3), "runtime_mode": TRAIN},
        {"input_shape": "abc", "runtime_mode": TRAIN},
        {"input_shape": {4, 2}, "runtime_mode": TRAIN},  # no order
        {"input_shape": {4: 1, 2: 1}, "runtime_mode": TRAIN},
        {"input_shape": (2, 3), "runtime_mode": "TRAINING"},
        {"input_shape": (2, 3), "runtime_mode": TrainingMode.NORMAL},
        {"input_shape": (2, 3), "runtime_mode": TRAIN, "prefill_size": 1.5},
        {"input_shape": (2, 3), "runtime_mode": TRAIN, "prefill_size": True},
        {"input_shape": (2, 3), "runtime_mode": INFER, "initialize_parameters": "no"},
        {"input_shape": (2, 3), "runtime_mode": INFER, "initialize_parameters": []},
        {"input_shape": (2, 3), "runtime_mode": INFER, "initialize_parameters": 1},
    ],
)
def test_wrong_types_raise_type_error(kwargs) -> None:
    with pytest.raises(TypeError):
        BuildContext(**kwargs)


@pytest.mark.parametrize("shape", [5, {1, 4}, None])
def test_with_shape_refuses_what_the_constructor_refuses(shape) -> None:
    bc = BuildContext((1, 4), TRAIN)
    with pytest.raises(TypeError, match="BuildContext: input_shape must be"):
        bc.with_shape(shape)
    assert bc.with_shape([2, 3]).input_shape == (2, 3)


def test_numpy_values_are_normalized() -> None:
    import numpy as np

    ctx = BuildContext(
        (np.int64(2), 3), INFER, initialize_parameters=np.bool_(True), prefill_size=np.int32(2)
    )
    assert ctx == BuildContext((2, 3), INFER, initialize_parameters=True, prefill_size=2)
    assert type(ctx.prefill_size) is int and ctx.initialize_parameters is True
    assert hash(ctx) == hash(BuildContext((2, 3), INFER, True, 2))
