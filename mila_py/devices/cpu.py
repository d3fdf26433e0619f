"""CPU execution context: NumPy arrays in system memory; work runs synchronously."""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceId, DeviceType
from mila_py.devices.execution_context import ExecutionContext

__all__ = ["CpuExecutionContext"]


class CpuExecutionContext(ExecutionContext):
    """Execution context for the CPU (NumPy)."""

    def __init__(self, device: DeviceId | None = None) -> None:
        device = device or DeviceId(DeviceType.CPU, 0)
        if device.device_type is not DeviceType.CPU:
            raise ValueError(f"CpuExecutionContext needs a CPU device, got {device}")
        self.device_id = device
        self.xp = np

    def synchronize(self) -> None:
        """NumPy work is synchronous: nothing to wait for."""

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> np.ndarray:
        return np.zeros(shape, dtype=dtype) if zero else np.empty(shape, dtype=dtype)

    def is_device_array(self, array: Any) -> bool:
        return isinstance(array, np.ndarray)

    def to_device(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)
