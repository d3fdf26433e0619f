"""The array module of the ``CUDA:0`` under test, for the tests that make device arrays of
their own: CuPy on a machine with a GPU, else the kernel emulator's NumPy stand-in
(``emulated_cupy.standin()``: NumPy under CuPy's names, its arrays the emulated device's).

At most one ``CUDA:0`` is present in a run (the emulated one skips where a GPU is), so the
module is chosen once, at import. A test reads it as ``from cuda_arrays import cupy``.

Arrays move to and from the device through their bits for BF16, so no case depends on CuPy
compiling bfloat16 kernels of its own; the CUDA ops' BF16 path needs CuPy's bfloat16 arrays
(CuPy >= 14), and ``REDUCED_PARAMS`` skips BF16 with that reason where this CuPy lacks them.
"""

from __future__ import annotations

from typing import Any

import emulated_cupy
import ml_dtypes
import numpy as np
import pytest

from mila_py import Precision
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
BF16_DTYPE = np.dtype(ml_dtypes.bfloat16)


def _cupy_has_bfloat16() -> bool:
    try:
        cupy.empty((0,), dtype=BF16_DTYPE)
    except Exception:
        return False
    return True


#: this CuPy makes arrays of ml_dtypes.bfloat16 (CuPy >= 14; the emulator's stand-in does)
CUPY_BF16 = _cupy_has_bfloat16()
NO_BF16_REASON = "this CuPy has no bfloat16 arrays (CuPy >= 14 has): the CUDA ops refuse BF16"
#: BF16 (skipped with the reason where CuPy lacks bfloat16 arrays) and FP16
REDUCED_PARAMS = [
    pytest.param(
        Precision.BF16, id="BF16", marks=pytest.mark.skipif(not CUPY_BF16, reason=NO_BF16_REASON)
    ),
    pytest.param(Precision.FP16, id="FP16"),
]
#: one rounding of the 16-bit storage types, relative
ULP = {Precision.BF16: 2.0**-8, Precision.FP16: 2.0**-10}


def dev(x: Any) -> Any:
    """A device copy of host array ``x`` (BF16 moved as its bits), ready when this returns."""
    if np.asarray(x).dtype == BF16_DTYPE:
        out = cupy.asarray(np.ascontiguousarray(x).view(np.uint16)).view(BF16_DTYPE)
    else:
        out = cupy.asarray(x)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def host(x: Any) -> np.ndarray:
    """A host copy of ``x`` (a device array, or a host one) after the device finished (BF16
    moved as its bits)."""
    if isinstance(x, np.ndarray) and not EMULATED:
        return x
    cupy.cuda.runtime.deviceSynchronize()
    if x.dtype == BF16_DTYPE:
        return cupy.asnumpy(x.view(cupy.uint16)).view(BF16_DTYPE)
    return cupy.asnumpy(x)


def close(actual: Any, expected: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``actual`` (on the device or the host) equals ``expected`` to the tolerances."""
    np.testing.assert_allclose(host(actual), expected, rtol=rtol, atol=atol)


def agree(actual: Any, expected: Any, precision: Precision, units: float = 2.0) -> None:
    """``actual`` (on the device or the host) equals ``expected`` to within ``units``
    roundings of the 16-bit storage type, relative to each element or to the array's scale (an
    element that cancels to near zero keeps the scale's error): the CUDA op and the CPU op both
    compute in float32 from the same 16-bit values and round each output once, in their own
    summation orders."""
    a, e = np.asarray(host(actual), np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    bound = units * ULP[precision] * (np.abs(e) + 0.05 * np.abs(e).max(initial=0.0))
    worst = float(np.max(np.abs(a - e) - bound, initial=-1.0))
    assert worst <= 0, f"{precision}: differs by {np.abs(a - e).max():.3g} beyond the bound"


def on(device: str, x: Any) -> Any:
    """Host array ``x`` on ``device``: itself for ``"CPU"``, else a device copy (:func:`dev`)."""
    return x if device == "CPU" else dev(x)


def context(device: str) -> Any:
    """An execution context of ``device`` (an emulated one for the emulated ``CUDA:0``: the
    factory is looked up when called, as the emulator replaces it)."""
    from mila_py import devices

    return devices.create_execution_context(device)


def array_module(device: str) -> Any:
    """NumPy for ``"CPU"``, else the array module of the ``CUDA:0`` under test (:data:`cupy`)."""
    return np if device == "CPU" else cupy


#: BF16 and FP16 for a body over ``device``: it calls :func:`skip_bf16_without_arrays` first,
#: so that the CPU runs BF16 wherever CuPy lacks bfloat16 arrays
PRECISIONS_16 = [pytest.param(Precision.BF16, id="BF16"), pytest.param(Precision.FP16, id="FP16")]


def skip_bf16_without_arrays(device: str, precision: Precision) -> None:
    """Skip BF16 on a ``CUDA:0`` whose CuPy has no bfloat16 arrays (the CUDA ops refuse it)."""
    if device != "CPU" and precision is Precision.BF16 and not CUPY_BF16:
        pytest.skip(NO_BF16_REASON)
