"""Precisions and their NumPy / CuPy dtypes, with the per-device support table ops consult.

BF16 is ``ml_dtypes.bfloat16`` on both devices. Reduced precisions compute in FP32 inside ops.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from mila_py.devices.device import DeviceId, DeviceType

__all__ = ["DEVICE_PRECISIONS", "Precision"]


class Precision(enum.Enum):
    """Storage precision of a component's tensors."""

    FP32 = "FP32"
    FP64 = "FP64"  # CPU only: exact references and finite-difference gradient checks
    FP16 = "FP16"
    BF16 = "BF16"

    @property
    def numpy_dtype(self) -> np.dtype:
        """The NumPy dtype (``ml_dtypes.bfloat16`` for BF16)."""
        return _NUMPY_DTYPES[self]

    @property
    def itemsize(self) -> int:
        return int(self.numpy_dtype.itemsize)

    def cupy_dtype(self) -> Any:
        """The dtype CuPy arrays of this precision carry (the same object as :attr:`numpy_dtype`).

        CuPy 14 accepts ``ml_dtypes.bfloat16``; raw kernels read it as ``__nv_bfloat16``.
        """
        return self.numpy_dtype

    def is_supported_on(self, device: DeviceType | DeviceId | str) -> bool:
        """Whether ``device`` (a DeviceType, a DeviceId, or a device string such as
        ``"CUDA:0"``) stores this precision."""
        if isinstance(device, DeviceId):
            device = device.device_type
        elif not isinstance(device, DeviceType):
            if not isinstance(device, str):
                raise TypeError(
                    f"is_supported_on: expected a DeviceType, DeviceId or str, got {device!r}"
                )
            device = DeviceId.parse(device).device_type
        return self in DEVICE_PRECISIONS[device]

    @classmethod
    def from_dtype(cls, dtype: Any) -> Precision:
        """The precision of a NumPy/CuPy dtype.

        Raises:
            TypeError: for dtypes mila_py does not store (ints, complex, float8, ...).
        """
        dt = np.dtype(dtype)
        for precision, candidate in _NUMPY_DTYPES.items():
            if dt == candidate:
                return precision
        raise TypeError(
            f"dtype {dt} is not a mila_py precision (float64, float32, float16, bfloat16)"
        )

    def __str__(self) -> str:
        return self.value


_NUMPY_DTYPES: dict[Precision, np.dtype] = {
    Precision.FP32: np.dtype(np.float32),
    Precision.FP64: np.dtype(np.float64),
    Precision.FP16: np.dtype(np.float16),
    Precision.BF16: np.dtype(ml_dtypes.bfloat16),
}

DEVICE_PRECISIONS: dict[DeviceType, frozenset[Precision]] = {
    DeviceType.CPU: frozenset(Precision),
    DeviceType.CUDA: frozenset({Precision.FP32, Precision.FP16, Precision.BF16}),
}
