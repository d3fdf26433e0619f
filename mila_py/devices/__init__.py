"""Devices and execution contexts."""

from __future__ import annotations

from mila_py.devices.cpu import CpuExecutionContext
from mila_py.devices.cuda import CudaExecutionContext, cuda_device_count
from mila_py.devices.device import DeviceId, DeviceLike, DeviceType
from mila_py.devices.execution_context import ExecutionContext

__all__ = [
    "CpuExecutionContext",
    "CudaExecutionContext",
    "DeviceId",
    "DeviceLike",
    "DeviceType",
    "ExecutionContext",
    "available_devices",
    "create_execution_context",
]


def available_devices() -> list[DeviceId]:
    """Devices usable in this process: always CPU:0, plus every GPU CuPy sees."""
    return [DeviceId(DeviceType.CPU, 0)] + [
        DeviceId(DeviceType.CUDA, i) for i in range(cuda_device_count())
    ]


def create_execution_context(device: DeviceLike) -> ExecutionContext:
    """Create the execution context for ``device`` (``"CPU"``, ``"CUDA:0"``, a DeviceId).

    Raises:
        ValueError: malformed device string.
        RuntimeError: a CUDA device without CuPy or without that GPU (the message says how to fix it).
    """
    device_id = DeviceId.parse(device)
    if device_id.device_type is DeviceType.CPU:
        return CpuExecutionContext(device_id)
    return CudaExecutionContext(device_id)
