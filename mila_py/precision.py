"""Precisions and their NumPy / CuPy dtypes, with the per-device support table ops consult.

BF16 is ``ml_dtypes.bfloat16`` on both devices. Reduced precisions (FP16, BF16) store in 16
bits and compute in FP32 inside ops (:attr:`Precision.compute_dtype`): GEMM accumulation, norm
statistics, softmax and the loss, each result rounded once when it is stored.
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

    @property
    def is_reduced(self) -> bool:
        """FP16 or BF16: 16-bit storage whose arithmetic runs in FP32."""
        return self in (Precision.FP16, Precision.BF16)

    @property
    def compute_dtype(self) -> np.dtype:
        """The dtype ops compute in and gradients of parameters are kept in: float32 for the
        16-bit precisions and FP32, float64 for FP64."""
        return np.dtype(np.float64) if self is Precision.FP64 else np.dtype(np.float32)

    @classmethod
    def parse(cls, name: str | Precision) -> Precision:
        """A precision by name, case-insensitive: ``"bf16"``/``"bfloat16"``, ``"fp16"``/
        ``"float16"``/``"half"``, ``"fp32"``/``"float32"``, ``"fp64"``/``"float64"`` (a
        Precision is returned as it is).

        Raises:
            TypeError: ``name`` is not a str or a Precision.
            ValueError: an unknown name (the accepted ones are listed).
        """
        if isinstance(name, Precision):
            return name
        if not isinstance(name, str):
            raise TypeError(f"Precision.parse: expected a str, got {name!r}")
        found = _NAMES.get(name.strip().lower())
        if found is None:
            raise ValueError(
                f"Precision.parse: unknown precision {name!r}; expected one of "
                f"{', '.join(sorted(_NAMES))}"
            )
        return found

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

_NAMES: dict[str, Precision] = {
    "fp32": Precision.FP32,
    "float32": Precision.FP32,
    "fp64": Precision.FP64,
    "float64": Precision.FP64,
    "fp16": Precision.FP16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "bf16": Precision.BF16,
    "bfloat16": Precision.BF16,
}

DEVICE_PRECISIONS: dict[DeviceType, frozenset[Precision]] = {
    DeviceType.CPU: frozenset(Precision),
    DeviceType.CUDA: frozenset({Precision.FP32, Precision.FP16, Precision.BF16}),
}
