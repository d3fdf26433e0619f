"""The array module of the ``CUDA:0`` under test, for the tests that make device arrays of
their own: CuPy on a machine with a GPU, else the kernel emulator's NumPy stand-in
(``emulated_cupy.standin()``: NumPy under CuPy's names, its arrays the emulated device's).

At most one ``CUDA:0`` is present in a run (the emulated one skips where a GPU is), so the
module is chosen once, at import. A test reads it as ``from cuda_arrays import cupy``.
"""

from __future__ import annotations

from typing import Any

import emulated_cupy
import numpy as np

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


def dev(x: Any) -> Any:
    """A device copy of host array ``x``, ready when this returns."""
    out = cupy.asarray(x)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def host(x: Any) -> np.ndarray:
    """A host copy of ``x`` (a device array, or a host one) after the device finished."""
    if isinstance(x, np.ndarray) and not EMULATED:
        return x
    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(x)


def close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``actual`` (on the device or the host) equals ``expected`` to the tolerances."""
    np.testing.assert_allclose(host(actual), expected, rtol=rtol, atol=atol)
