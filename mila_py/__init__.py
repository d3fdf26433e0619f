"""mila_py: Mila's component lifecycle for NumPy (CPU) and CuPy (NVIDIA GPUs)."""

from __future__ import annotations

from mila_py.build_context import BuildContext, RuntimeMode, TrainingMode
from mila_py.component import Component
from mila_py.composite import CompositeComponent, Network
from mila_py.devices import DeviceId, DeviceType, available_devices
from mila_py.memory import MemoryStats
from mila_py.ops.registry import OpNotFoundError
from mila_py.precision import Precision

__all__ = [
    "BuildContext",
    "Component",
    "CompositeComponent",
    "DeviceId",
    "DeviceType",
    "MemoryStats",
    "Network",
    "OpNotFoundError",
    "Precision",
    "RuntimeMode",
    "TrainingMode",
    "available_devices",
]

__version__ = "0.1.0"
