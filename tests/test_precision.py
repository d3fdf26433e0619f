"""mila_py.precision: Precision <-> NumPy dtypes and the per-device support table."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mila_py.devices import DeviceType
from mila_py.precision import DEVICE_PRECISIONS, Precision

EXPECTED = {
    Precision.FP32: (np.float32, 4),
    Precision.FP64: (np.float64, 8),
    Precision.FP16: (np.float16, 2),
    Precision.BF16: (ml_dtypes.bfloat16, 2),
}


def test_members() -> None:
    assert [p.name for p in Precision] == ["FP32", "FP64", "FP16", "BF16"]
    assert [str(p) for p in Precision] == ["FP32", "FP64", "FP16", "BF16"]


@pytest.mark.parametrize("precision", list(Precision))
def test_numpy_dtype_and_itemsize(precision: Precision) -> None:
    scalar_type, itemsize = EXPECTED[precision]
    assert isinstance(precision.numpy_dtype, np.dtype)
    assert precision.numpy_dtype == np.dtype(scalar_type)
    assert precision.itemsize == itemsize
    assert np.zeros(3, dtype=precision.numpy_dtype).nbytes == 3 * itemsize


def test_bf16_is_ml_dtypes_bfloat16() -> None:
    assert Precision.BF16.numpy_dtype.type is ml_dtypes.bfloat16
    assert Precision.BF16.numpy_dtype != np.dtype(np.float16)
    # bfloat16 keeps float32's exponent range: 1e30 is finite there, inf in float16.
    big = np.array([1e30], dtype=np.float32)
    assert np.isfinite(big.astype(Precision.BF16.numpy_dtype).astype(np.float32)).all()
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.astype(np.float16)).any()


@pytest.mark.parametrize("precision", list(Precision))
def test_cupy_dtype_is_the_numpy_dtype(precision: Precision) -> None:
    assert precision.cupy_dtype() == precision.numpy_dtype


@pytest.mark.parametrize(
    ("dtype", "precision"),
    [
        (np.float32, Precision.FP32),
        ("float32", Precision.FP32),
        (np.dtype("float32"), Precision.FP32),
        (np.float16, Precision.FP16),
        ("float16", Precision.FP16),
        (ml_dtypes.bfloat16, Precision.BF16),
        (np.dtype(ml_dtypes.bfloat16), Precision.BF16),
    ],
)
def test_from_dtype(dtype, precision: Precision) -> None:
    assert Precision.from_dtype(dtype) is precision


@pytest.mark.parametrize("precision", list(Precision))
def test_from_dtype_round_trips_through_arrays(precision: Precision) -> None:
    array = np.ones((2, 2), dtype=precision.numpy_dtype)
    assert Precision.from_dtype(array.dtype) is precision


@pytest.mark.parametrize("dtype", [np.longdouble, np.int32, np.int8, np.bool_, np.complex64, "U4"])
def test_from_dtype_rejects_other_dtypes(dtype) -> None:
    with pytest.raises(TypeError, match="precision"):
        Precision.from_dtype(dtype)


def test_support_table_covers_every_device_type() -> None:
    assert set(DEVICE_PRECISIONS) == set(DeviceType)
    for device_type, supported in DEVICE_PRECISIONS.items():
        assert supported, f"{device_type} supports no precision"
        assert all(isinstance(p, Precision) for p in supported)
        for precision in Precision:
            assert precision.is_supported_on(device_type) == (precision in supported)


@pytest.mark.parametrize("device_type", list(DeviceType))
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16, Precision.BF16])
def test_the_design_precisions_are_supported_everywhere(
    device_type: DeviceType, precision: Precision
) -> None:
    # DESIGN.md section 3: FP32, FP16 and BF16 on both NumPy and CuPy.
    assert precision.is_supported_on(device_type)


def test_fp64_is_a_cpu_only_reference_precision() -> None:
    assert Precision.FP64.is_supported_on(DeviceType.CPU)
    assert not Precision.FP64.is_supported_on(DeviceType.CUDA)
    assert Precision.from_dtype(np.float64) is Precision.FP64


def test_is_supported_on_takes_device_strings() -> None:
    assert Precision.FP32.is_supported_on("CPU") is Precision.FP32.is_supported_on(DeviceType.CPU)
    assert Precision.BF16.is_supported_on("cuda:1") is Precision.BF16.is_supported_on(
        DeviceType.CUDA
    )
    with pytest.raises(ValueError):
        Precision.FP32.is_supported_on("tpu")
    with pytest.raises(TypeError):
        Precision.FP32.is_supported_on(None)  # type: ignore[arg-type]


def test_is_supported_on_takes_device_ids() -> None:
    from mila_py import DeviceId

    assert Precision.FP64.is_supported_on(DeviceId(DeviceType.CPU))
    assert not Precision.FP64.is_supported_on(DeviceId(DeviceType.CUDA, 1))


def test_parse_names_case_insensitively_and_refuses_the_unknown() -> None:
    for name, precision in (
        ("bf16", Precision.BF16),
        ("BFloat16", Precision.BF16),
        (" fp16 ", Precision.FP16),
        ("half", Precision.FP16),
        ("float32", Precision.FP32),
        ("FP64", Precision.FP64),
    ):
        assert Precision.parse(name) is precision
    assert Precision.parse(Precision.FP16) is Precision.FP16
    with pytest.raises(ValueError, match=r"'int8'.*bf16"):
        Precision.parse("int8")
    with pytest.raises(TypeError, match="expected a str"):
        Precision.parse(16)  # type: ignore[arg-type]


def test_reduced_precisions_compute_in_float32() -> None:
    """FP16 and BF16 are the 16-bit storage precisions; ops compute, and gradients of their
    parameters are kept, in float32 (float64 for FP64)."""
    assert {p for p in Precision if p.is_reduced} == {Precision.FP16, Precision.BF16}
    for precision in Precision:
        wide = np.float64 if precision is Precision.FP64 else np.float32
        assert precision.compute_dtype == np.dtype(wide)
