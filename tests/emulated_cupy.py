"""A stand-in ``cupy`` module for running ``tests/cuda`` on the kernel emulator.

``python -m pytest tests/cuda --emulate-gpu`` (on a machine without a GPU) puts
:func:`standin` in ``sys.modules["cupy"]`` and runs the GPU test files against an emulated
``CUDA:0`` (``tests/kernel_emulator.py``: the CUDA ops' own kernels compiled for the CPU, their
device arrays NumPy arrays). So a GPU test is checked for what it can be without a GPU (its
shapes, configs, helpers and assertions, the ops' host logic and kernels) before a GPU runs
it, so a wrong test shows up on any machine.

The stand-in is NumPy under CuPy's names, for what the GPU tests use on their own arrays:
creation (``asarray`` copies, as moving host data to a device does), ``asnumpy``, dtypes,
``matmul``, ``isnan``, ``asfortranarray``, ``lib.stride_tricks``, and a ``cuda.runtime`` whose
``deviceSynchronize`` returns at once (emulated launches finish before they return) and whose
``getDevice`` is 0 (the emulated ``CUDA:0``). What only
CuPy on a GPU has (NVRTC modules, the memory pool, streams, DLPack from torch, foreign device
arrays) is not there: tests of it carry ``@pytest.mark.real_gpu(reason)`` and are skipped under
emulation, with the reason. A run under emulation is no GPU run: the GPU check still runs them.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

#: the stand-in's ``__version__``; ``is_emulated(cupy)`` tells a test which it got
VERSION = "emulated (tests/emulated_cupy.py)"

_SAME = (
    "empty", "zeros", "ones", "full", "arange", "matmul", "isnan", "asfortranarray",
    "ascontiguousarray", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64", "bool_",
)  # fmt: skip


def _asarray(a: Any, dtype: Any = None) -> np.ndarray:
    """A new array, as ``cupy.asarray`` of host data is (never a view of the caller's array)."""
    return np.array(a, dtype=dtype, copy=True)


def _asnumpy(a: Any) -> np.ndarray:
    return np.array(a, copy=True)


def standin() -> types.ModuleType:
    """A fresh stand-in module (see the module docstring)."""
    cupy = types.ModuleType("cupy")
    cupy.__version__ = VERSION  # type: ignore[attr-defined]
    cupy.ndarray = np.ndarray  # type: ignore[attr-defined]
    for name in _SAME:
        setattr(cupy, name, getattr(np, name))
    cupy.asarray = _asarray  # type: ignore[attr-defined]
    cupy.asnumpy = _asnumpy  # type: ignore[attr-defined]
    cupy.lib = types.SimpleNamespace(stride_tricks=np.lib.stride_tricks)  # type: ignore[attr-defined]
    runtime = types.SimpleNamespace(deviceSynchronize=lambda: None, getDevice=lambda: 0)
    cupy.cuda = types.SimpleNamespace(runtime=runtime)  # type: ignore[attr-defined]
    return cupy


def is_emulated(cupy: Any) -> bool:
    """True for the stand-in, False for CuPy."""
    return getattr(cupy, "__version__", None) == VERSION
