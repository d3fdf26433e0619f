"""A stand-in ``cupy`` module for the tests' own device arrays on the kernel emulator's ``CUDA:0``.

On a machine without a GPU, :func:`standin` is the array module of ``tests/cuda_arrays.py``
while the emulated ``CUDA:0`` runs the device-generic tests (``tests/kernel_emulator.py``: the
CUDA ops' own kernels compiled for the CPU, their device arrays NumPy arrays); ``sys.modules``
keeps whatever ``cupy`` there is. So a GPU test is checked for what it can be without a GPU (its
shapes, configs, helpers and assertions, the ops' host logic and kernels) before a GPU runs
it, so a wrong test shows up on any machine.

The stand-in is NumPy under CuPy's names, for what the GPU tests use on their own arrays:
creation (``asarray`` copies, as moving host data to a device does), ``asnumpy``, dtypes,
``matmul``, ``isnan``, ``asfortranarray``, ``lib.stride_tricks``, and a ``cuda.runtime`` whose
``deviceSynchronize`` returns at once (emulated launches finish before they return) and whose
``getDevice`` is 0 (the emulated ``CUDA:0``). What only
CuPy on a GPU has (NVRTC modules, the memory pool, streams, DLPack from torch, foreign device
arrays) is not there: tests of it carry ``@pytest.mark.real_gpu(reason)`` and are skipped on the
emulated ``CUDA:0``, with the reason. A run under emulation is no GPU run: the GPU check still runs them.

CUDA graphs are emulated as a GPU runs them (:class:`Stream`, :class:`Graph`, also the
streams of the kernel emulator's contexts): between ``stream.begin_capture()`` and
``stream.end_capture()`` nothing runs; the device's work is recorded instead, with its arrays
(their memory, not their values) and scalars, and ``graph.launch()`` runs exactly that again.
The device's work is what a GPU would capture: the emulated kernel launches, and NumPy's
functions and ufuncs on device arrays (:class:`DeviceArray`, the arrays of the emulated
contexts and of this stand-in) that write into given outputs (``matmul(..., out=)``,
``add(..., out=)``, ``copyto``, ``take(..., out=)``, an assignment into a view). So a step
that computes something on the host while it is captured (a position, a length, a branch)
replays what it computed then, and gives wrong results later, as on a GPU. And what a GPU
refuses during a capture, or what would break its graph, raises :class:`CaptureError` here
(and a matrix product, which CuPy computes with cuBLAS, raises ``NotImplementedError``, as
CuPy does during a capture):
reading a device value on the host (``.get()``, ``asnumpy``, ``float(x)``, ``int(x)``,
``.item()``, an element), synchronizing, allocating device memory (a ufunc or function
without ``out=``, a copy, fancy indexing, ``numpy.empty`` and the other constructors, an
emulated context's ``allocate``/``to_device``) and copying host data to the device.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import numpy as np

#: the stand-in's ``__version__``; ``is_emulated(cupy)`` tells a test which it got
VERSION = "emulated (tests/emulated_cupy.py)"

_SAME = (
    "matmul", "add", "multiply", "isnan", "where", "asfortranarray", "ascontiguousarray", "copyto",
    "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "bool_",
)  # fmt: skip
#: the constructors of device arrays: new device memory
_NEW = ("empty", "zeros", "ones", "full", "arange")


def _asarray(a: Any, dtype: Any = None) -> np.ndarray:
    """A new device array, as ``cupy.asarray`` of host data is (never a view of the caller's
    array)."""
    refuse("cupy.asarray copies host data to the device (and allocates)")
    return np.array(a, dtype=dtype, copy=True).view(DeviceArray)


def _asnumpy(a: Any) -> np.ndarray:
    refuse("cupy.asnumpy reads device memory back to the host")
    return np.array(a, copy=True)


#: what CuPy raises for a cuBLAS call (``cupy.matmul``, ``@``) while a stream captures: its
#: cuBLAS handle refuses to be set to a capturing stream
CUBLAS_REFUSED = "calling cuBLAS API during stream capture is currently unsupported"


class CaptureError(RuntimeError):
    """What a GPU refuses while a stream captures a graph, or what would break the graph."""


#: the stream that captures now, if any (one at a time, as the tests run)
_capturing: Stream | None = None


def capturing() -> Stream | None:
    """The stream capturing a graph now, or None."""
    return _capturing


def refuse(what: str) -> None:
    """Raise :class:`CaptureError` saying ``what`` happened, if a stream captures now."""
    if _capturing is not None:
        raise CaptureError(f"during a CUDA graph capture: {what}")


class Graph:
    """The device work recorded by a capture; :meth:`launch` runs it again, in order."""

    def __init__(self, calls: list[Callable[[], Any]]) -> None:
        self.calls = calls
        self.launches = 0

    def launch(self, stream: Any = None) -> None:
        refuse("a graph launched into a capture")
        self.launches += 1
        for call in self.calls:
            call()


class Stream:
    """A CUDA stream whose work runs at once, and which captures graphs (see the module
    docstring). ``captures`` counts the captures it began."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        self.ptr = 0 if null else id(self)
        self.captures = 0
        self._calls: list[Callable[[], Any]] | None = None
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def use(self) -> Stream:
        return self

    def synchronize(self) -> None:
        refuse("a stream synchronized (it waits for work that is only being recorded)")

    def is_capturing(self) -> bool:
        return self._calls is not None

    def begin_capture(self, mode: Any = None) -> None:
        global _capturing
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if _capturing is not None:
            raise CaptureError("a capture began while another one is under way")
        self._calls = []
        self.captures += 1
        self._saved = {name: getattr(np, name) for name in _CONSTRUCTORS}
        for name, original in self._saved.items():
            setattr(np, name, _guarded_constructor(name, original))
        _capturing = self

    def end_capture(self) -> Graph:
        global _capturing
        if _capturing is not self or self._calls is None:
            raise RuntimeError("end_capture on a stream that is not capturing")
        calls, self._calls = self._calls, None
        for name, original in self._saved.items():
            setattr(np, name, original)
        self._saved = {}
        _capturing = None
        return Graph(calls)

    def record(self, call: Callable[[], Any]) -> None:
        """Append ``call`` (device work) to the capture under way."""
        assert self._calls is not None, "record() outside a capture"
        self._calls.append(call)


#: NumPy's constructors: each allocates (those that may return their argument, when they do
#: not copy it, are allowed)
_CONSTRUCTORS = (
    "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like",
    "arange", "array", "asarray", "ascontiguousarray", "asfortranarray", "concatenate",
    "stack", "copy", "where",
)  # fmt: skip
_VIEWS_ALLOWED = ("asarray", "ascontiguousarray", "asfortranarray")


def _guarded_constructor(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if name in _VIEWS_ALLOWED and args and isinstance(args[0], np.ndarray):
            result = original(*args, **kwargs)
            if _shares(result, args[0]):
                return result
        raise CaptureError(f"during a CUDA graph capture: numpy.{name} allocates an array")

    return guarded


def _plain(x: Any) -> Any:
    """``x`` as a plain NumPy view when it is a device array (replays bypass the checks)."""
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


def _plain_all(values: Any) -> Any:
    if isinstance(values, tuple):
        return tuple(_plain(v) for v in values)
    if isinstance(values, list):
        return [_plain(v) for v in values]
    return _plain(values)


def _host_array(x: Any) -> bool:
    """True for an array of host memory: a NumPy array that is no device array."""
    return isinstance(x, np.ndarray) and not isinstance(x, DeviceArray)


def _fancy(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray | list) for k in keys)


class DeviceArray(np.ndarray):
    """A NumPy array standing for device memory (see the module docstring): outside a capture
    it is a NumPy array; during one, its work is recorded or refused."""

    @staticmethod
    def library_call(what: str) -> None:
        """Where mila_py stands in for a CUDA library on these arrays (cuBLAS's 16-bit
        products): CuPy refuses its library calls while a stream captures, with
        NotImplementedError, and so does this."""
        if _capturing is not None:
            raise NotImplementedError(f"calling {what} during stream capture is unsupported")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        stream = _capturing
        out = kwargs.get("out")
        kwargs = {k: _plain_all(v) for k, v in kwargs.items()}
        if stream is None:
            result = getattr(ufunc, method)(*_plain_all(inputs), **kwargs)
            if out is not None:
                return out[0] if len(out) == 1 else out
            if isinstance(result, tuple):
                return tuple(_as_device(r) for r in result)
            return _as_device(result)
        if ufunc is np.matmul:
            raise NotImplementedError(CUBLAS_REFUSED)
        if out is None:
            raise CaptureError(
                f"during a CUDA graph capture: numpy.{ufunc.__name__}.{method} without out= "
                "allocates its result"
            )
        if any(_host_array(x) for x in (*inputs, *out)):
            raise CaptureError(
                f"during a CUDA graph capture: numpy.{ufunc.__name__} of a host array (a copy "
                "to the device, and an allocation)"
            )
        stream.record(functools.partial(getattr(ufunc, method), *_plain_all(inputs), **kwargs))
        return out[0] if len(out) == 1 else out

    def __array_function__(self, func: Any, kinds: Any, args: Any, kwargs: Any) -> Any:
        stream = _capturing
        if stream is None:
            return super().__array_function__(func, kinds, args, kwargs)
        arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
        if any(_host_array(a) for a in arrays):
            raise CaptureError(
                f"during a CUDA graph capture: numpy.{func.__name__} of a host array (a copy to "
                "the device, and an allocation)"
            )
        if func is np.copyto or kwargs.get("out") is not None:
            plain = {k: _plain(v) for k, v in kwargs.items()}
            stream.record(functools.partial(func, *_plain_all(tuple(args)), **plain))
            return kwargs.get("out")
        result = super().__array_function__(func, kinds, args, kwargs)
        if func in _METADATA:
            return result  # about the arrays, not their values
        if isinstance(result, np.ndarray) and any(_shares(result, a) for a in arrays):
            return result  # a view: no device work
        raise CaptureError(
            f"during a CUDA graph capture: numpy.{func.__name__} without out= allocates its "
            "result (or reads device memory on the host)"
        )

    def __getitem__(self, key: Any) -> Any:
        result = super().__getitem__(key)
        if _capturing is not None:
            if not isinstance(result, np.ndarray):
                refuse(f"an element of a device array read on the host (index {key!r})")
            if result.size and not _shares(result, self):
                refuse(f"indexing with arrays allocates a copy (index {key!r})")
        return result

    def __setitem__(self, key: Any, value: Any) -> None:
        stream = _capturing
        if stream is None:
            super().__setitem__(key, _plain(value))
            return
        if _fancy(key):
            refuse(f"an assignment at indices of an array ({key!r}): a copy of the indices")
        if _host_array(value) or isinstance(value, list | tuple):
            refuse("an assignment of host data: a copy to the device, and an allocation")
        target = super().__getitem__(key)
        stream.record(functools.partial(np.copyto, _plain(target), _plain(value)))

    def _refused(self, what: str) -> None:
        refuse(f"{what} of a device array")

    def __float__(self) -> float:
        self._refused("float()")
        return super().__float__()

    def __int__(self) -> int:
        self._refused("int()")
        return super().__int__()

    def __index__(self) -> int:
        self._refused("operator.index()")
        return super().__index__()

    def __bool__(self) -> bool:
        self._refused("bool()")
        return super().__bool__()

    def item(self, *args: Any) -> Any:
        self._refused(".item()")
        return super().item(*args)

    def tolist(self) -> Any:
        self._refused(".tolist()")
        return super().tolist()

    def get(self, stream: Any = None) -> np.ndarray:
        """CuPy's copy to the host."""
        self._refused(".get()")
        return np.array(self.view(np.ndarray), copy=True)

    def set(self, values: Any, stream: Any = None) -> None:
        """CuPy's copy from the host into this array."""
        refuse("ndarray.set copies host data to the device")
        np.copyto(self.view(np.ndarray), np.asarray(values))

    def copy(self, order: Any = "C") -> Any:
        self._refused("a copy")
        return super().copy(order)

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        self._refused(".astype() (a new array)")
        return super().astype(dtype, *args, **kwargs)

    def argmax(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("out") is None:
            self._refused(".argmax() without out= (a new array)")
        return super().argmax(*args, **kwargs)

    def reshape(self, *shape: Any, **kwargs: Any) -> Any:
        result = super().reshape(*shape, **kwargs)
        if _capturing is not None and result.size and not _shares(result, self):
            refuse("a reshape that copies (a new array)")
        return result


def _shares(a: np.ndarray, b: np.ndarray) -> bool:
    """True if the arrays' memory may overlap (checked on plain views: no dispatch)."""
    return bool(np.may_share_memory(_plain(a), _plain(b)))


#: functions about arrays that read no values (metadata), allowed during a capture
_METADATA = frozenset(
    {np.may_share_memory, np.shares_memory, np.ndim, np.shape, np.size, np.result_type}
)


def _as_device(result: Any) -> Any:
    return result.view(DeviceArray) if type(result) is np.ndarray else result


def standin() -> types.ModuleType:
    """A fresh stand-in module (see the module docstring)."""
    cupy = types.ModuleType("cupy")
    cupy.__version__ = VERSION  # type: ignore[attr-defined]
    cupy.ndarray = np.ndarray  # type: ignore[attr-defined]
    for name in _SAME:
        setattr(cupy, name, getattr(np, name))
    for name in _NEW:
        setattr(cupy, name, _new_device_array(getattr(np, name)))
    cupy.asarray = _asarray  # type: ignore[attr-defined]
    cupy.asnumpy = _asnumpy  # type: ignore[attr-defined]
    cupy.lib = types.SimpleNamespace(stride_tricks=np.lib.stride_tricks)  # type: ignore[attr-defined]
    runtime = types.SimpleNamespace(deviceSynchronize=_device_synchronize, getDevice=lambda: 0)
    graph = types.SimpleNamespace(Graph=Graph)
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=runtime, Stream=Stream, graph=graph
    )
    return cupy


def _new_device_array(constructor: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def new(*args: Any, **kwargs: Any) -> np.ndarray:
        refuse(f"cupy.{constructor.__name__} allocates device memory")
        return constructor(*args, **kwargs).view(DeviceArray)

    return new


def _device_synchronize() -> None:
    refuse("the device synchronized (it waits for work that is only being recorded)")


def is_emulated(cupy: Any) -> bool:
    """True for the stand-in, False for CuPy."""
    return getattr(cupy, "__version__", None) == VERSION
