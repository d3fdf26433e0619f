"""The array module of the ``CUDA:0`` under test, for the tests that make device arrays of
their own: CuPy on a machine with a GPU, else the kernel emulator's NumPy stand-in
(``emulated_cupy.standin()``: NumPy under CuPy's names, its arrays the emulated device's).

At most one ``CUDA:0`` is present in a run (the emulated one skips where a GPU is), so the
module is chosen once, at import. A test reads it as ``from cuda_arrays import cupy``.
"""

from __future__ import annotations

from typing import Any

import emulated_cupy

from mila_py.devices.cuda import cuda_device_count

HAS_CUDA = cuda_device_count() > 0


def _array_module() -> Any:
    if HAS_CUDA:
        import cupy as real

        return real
    return emulated_cupy.standin()


cupy: Any = _array_module()
#: the emulated device's arrays (no GPU in this run)
EMULATED = emulated_cupy.is_emulated(cupy)
