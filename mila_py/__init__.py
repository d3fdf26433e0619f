"""mila_py: Mila's component lifecycle for NumPy (CPU) and CuPy (NVIDIA GPUs).

The core names are imported here. The subpackages and modules above the core
(``mila_py.rope``, ``mila_py.ops``, ``mila_py.components``, ``mila_py.models``,
``mila_py.interop``, ``mila_py.optim``, ...) are attributes too, imported on first access:
``import mila_py`` then ``mila_py.models.Llama`` or ``mila_py.interop.hf`` works, while
``import mila_py`` stays light and the package's own modules (which import the core, never this
file's names) cannot form an import cycle through it.
"""

from __future__ import annotations

from mila_py._lazy import lazy_submodules
from mila_py.build_context import BuildContext, RuntimeMode, TrainingMode
from mila_py.component import Component
from mila_py.composite import CompositeComponent, Network
from mila_py.devices import DeviceId, DeviceType, available_devices
from mila_py.memory import MemoryStats
from mila_py.ops.registry import OpNotFoundError
from mila_py.precision import Precision

# read by setuptools as the distribution's version ([tool.setuptools.dynamic] in pyproject.toml)
__version__ = "0.1.0"

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

__getattr__, __dir__ = lazy_submodules(__name__, __path__, lambda: globals())
