"""Whether arrays share memory, for NumPy and CuPy arrays alike, from addresses and strides only.

Ops that write in place (``Rope`` rotates Q and K where they lie) must refuse inputs that
overlap: an element reached twice is rotated twice. NumPy's exact solver
(:func:`numpy.shares_memory`) answers for any two strided arrays; device arrays are described to
it by address, shape and strides (an ``__array_interface__`` that NumPy never dereferences), so
the answer costs microseconds on the host and nothing on the GPU, where ``cupy.shares_memory``
would sort every element's address.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

__all__ = ["arrays_overlap", "same_view", "self_overlaps"]


_Geometry = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _geometry(x: Any) -> _Geometry:
    """``(address, shape, strides, itemsize)`` of a NumPy or CuPy array, or of anything with a
    ``__cuda_array_interface__`` (strides None: C order)."""
    if isinstance(x, np.ndarray):  # (x.data is a memoryview, which bfloat16 cannot make)
        ptr = int(x.__array_interface__["data"][0])
    elif hasattr(getattr(x, "data", None), "ptr"):  # cupy.ndarray
        ptr = int(x.data.ptr)
    else:
        interface = x.__cuda_array_interface__
        shape = tuple(int(n) for n in interface["shape"])
        itemsize = np.dtype(interface["typestr"]).itemsize
        strides = interface.get("strides")
        if strides is None:  # C order
            steps, step = [], itemsize
            for n in reversed(shape):
                steps.append(step)
                step *= n
            strides = steps[::-1]
        return int(interface["data"][0]), shape, tuple(int(s) for s in strides), itemsize
    return ptr, tuple(x.shape), tuple(x.strides), int(x.dtype.itemsize)


def _bounds(geometry: _Geometry) -> tuple[int, int]:
    """Bytes ``[first, last + itemsize)`` an array can touch."""
    ptr, shape, strides, itemsize = geometry
    low = high = ptr
    for n, stride in zip(shape, strides, strict=False):  # equal lengths; strict costs time
        if n > 1:
            if stride < 0:
                low += stride * (n - 1)
            else:
                high += stride * (n - 1)
    return low, high + itemsize


def _address_view(geometry: _Geometry) -> np.ndarray:
    """A NumPy array with the same addresses (never read or written): input for the solver."""
    ptr, shape, strides, itemsize = geometry
    holder = types.SimpleNamespace(
        __array_interface__={
            "data": (ptr, True),
            "shape": shape,
            "strides": strides,
            "typestr": f"|V{itemsize}",
            "version": 3,
        }
    )
    return np.asarray(holder)


def arrays_overlap(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (on the same device) have an element address in common.

    Exact: views of one fused QKV buffer that take disjoint channels do not overlap, though
    their address ranges interleave.
    """
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.flags.owndata and b.flags.owndata:  # two allocations never overlap
            return a is b and a.size > 0
        return bool(np.shares_memory(a, b))
    ga, gb = _geometry(a), _geometry(b)
    if 0 in ga[1] or 0 in gb[1]:
        return False
    (a_low, a_high), (b_low, b_high) = _bounds(ga), _bounds(gb)
    if a_high <= b_low or b_high <= a_low:
        return False
    return _solve(ga, gb)


@functools.lru_cache(maxsize=256)
def _solve(ga: _Geometry, gb: _Geometry) -> bool:
    """NumPy's exact answer for two geometries; cached, as a decode loop passes the same views
    of its buffers at every step."""
    return bool(np.shares_memory(_address_view(ga), _address_view(gb)))


def same_view(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same elements in the same order (address, shape, strides
    and item size all equal): an op may then read and write them in place."""
    return _geometry(a) == _geometry(b)


def self_overlaps(x: Any) -> bool:
    """Whether two elements of ``x`` may share an address (a stride of 0, or strides that
    step inside another axis's extent, as ``as_strided`` and broadcast views can make).

    Sufficient test: axes sorted by ``|stride|`` must each step past everything the smaller
    axes span. Arrays NumPy or CuPy create (slices, transposes, reshapes) always pass.
    """
    flags = getattr(x, "flags", None)
    if flags is not None and (flags.c_contiguous or flags.f_contiguous):
        return False
    if hasattr(x, "strides"):  # NumPy, CuPy: no address needed (NumPy's costs ~2 us)
        shape, strides, itemsize = x.shape, x.strides, x.dtype.itemsize
    else:
        _, shape, strides, itemsize = _geometry(x)
    if 0 in shape:
        return False
    span = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False
