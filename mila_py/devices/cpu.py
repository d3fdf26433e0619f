"""CPU execution context: NumPy arrays in system memory; work runs synchronously."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from mila_py.devices.device import DeviceId, DeviceLike, DeviceType
from mila_py.devices.execution_context import (
    ExecutionContext,
    refuse_grad,
    torch_bits_view,
    torch_of,
)
from mila_py.devices.host_memory import host_available_memory

__all__ = ["CpuExecutionContext"]


class CpuExecutionContext(ExecutionContext):
    """Execution context for the CPU (NumPy)."""

    def __init__(self, device: DeviceLike | None = None) -> None:
        device = DeviceId.parse(device if device is not None else "CPU")
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

    def available_memory(self) -> int | None:
        """System memory this process can still take (``MemAvailable``, within its cgroup's
        limit; see :func:`~mila_py.devices.host_memory.host_available_memory`)."""
        return host_available_memory()

    def to_device(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)

    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy copy, as on the GPU: what a caller keeps does not follow the buffers a
        component reuses on its next call (its outputs, gradients)."""
        return np.array(array, copy=True)

    def as_device_array(self, array: Any) -> Any:
        """A NumPy view (no copy) of a CPU array of another library: anything with
        ``__dlpack__`` whose memory is on the CPU (a torch CPU tensor, JAX, ...), so that a
        component rotates or fills it in place. A torch ``bfloat16`` tensor becomes an
        ``ml_dtypes.bfloat16`` view (through an ``int16`` view of its bits: NumPy's DLPack
        import has no bfloat16). Anything else (a NumPy array, a GPU tensor, a list) is
        returned unchanged, so the caller's usual checks accept or refuse it as before.

        Raises:
            TypeError: a torch tensor that requires grad (pass ``t.detach()``).
            BufferError: what another producer raises when it cannot export.
        """
        if isinstance(array, np.ndarray) or not hasattr(array, "__dlpack__"):
            return array
        try:
            device_type, _ = array.__dlpack_device__()
        except Exception:
            return array
        if int(device_type) != _DLPACK_CPU:
            return array
        torch = torch_of(array)
        if torch is not None:
            refuse_grad(array)
        if torch is not None and array.dtype == torch.bfloat16:
            return np.from_dlpack(torch_bits_view(torch, array)).view(ml_dtypes.bfloat16)
        return np.from_dlpack(array)


#: DLPack's device type of host memory (``kDLCPU``)
_DLPACK_CPU = 1
