"""CUDA execution context: CuPy arrays on one GPU, all work on the context's own stream.

CuPy is imported only when a CUDA context is created, so the package imports on machines
without CuPy or without a GPU.

Arrays of other libraries (a torch CUDA tensor, anything with ``__cuda_array_interface__`` or
``__dlpack__``) are used without a copy through :meth:`CudaExecutionContext.as_device_array`;
:meth:`CudaExecutionContext.release_foreign` then orders the producer's later work after what
the context launched on them.
"""

from __future__ import annotations

from types import ModuleType
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

__all__ = ["CudaExecutionContext", "cuda_device_count", "import_cupy", "shared_context"]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: DLPack device types whose memory a CUDA kernel can address (kDLCUDA, kDLCUDAManaged)
_DLPACK_CUDA = (2, 13)

_INSTALL_HINT = (
    'install CuPy for your CUDA toolkit: `pip install -e ".[cuda12]"` or '
    '`pip install -e ".[cuda13]"` in the mila_py checkout (CuPy\'s cupy-cuda12x or '
    "cupy-cuda13x)"
)


def import_cupy() -> ModuleType:
    """Import CuPy, or raise RuntimeError saying how to install it."""
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            f"CUDA devices need CuPy, which is not installed: {_INSTALL_HINT}"
        ) from exc
    return cupy


def cuda_device_count() -> int:
    """Number of CUDA GPUs CuPy sees; 0 without CuPy, a driver or a GPU."""
    try:
        import cupy
    except ImportError:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


class CudaExecutionContext(ExecutionContext):
    """Execution context for one NVIDIA GPU through CuPy.

    The context selects its device and runs on a ``cupy.cuda.Stream``; everything a component
    launches runs on that stream (use :meth:`activate` as a context manager) and
    :meth:`synchronize` waits on it. Every context of one GPU shares that GPU's stream, so
    components with contexts of their own (a model and its standalone loss) run in the order
    they are called, as with PyTorch's per-device current stream. The stream is a *blocking*
    one: it is ordered both ways with the legacy default stream, on which CuPy and PyTorch run by
    default, so arrays a user fills and reads there need no extra synchronization. Work on other
    streams must be ordered by its owner (see :meth:`as_device_array` for arrays of other
    libraries).

    BF16 arrays are ``ml_dtypes.bfloat16`` where CuPy supports that dtype (CuPy >= 14); with an
    older CuPy they are carried as ``uint16`` arrays holding the same bits
    (:meth:`storage_dtype`).

    Raises:
        RuntimeError: if CuPy is missing (with the pip command to fix it) or the GPU does not exist.
    """

    def __init__(self, device: DeviceLike) -> None:
        device = DeviceId.parse(device)
        if device.device_type is not DeviceType.CUDA:
            raise ValueError(f"CudaExecutionContext needs a CUDA device, got {device}")
        cupy = import_cupy()
        count = cuda_device_count()
        if count == 0:
            raise RuntimeError(
                f"cannot create a context for {device}: CuPy is installed but sees no CUDA GPU "
                "(check the NVIDIA driver and CUDA_VISIBLE_DEVICES)"
            )
        if device.index >= count:
            raise RuntimeError(
                f"cannot create a context for {device}: CuPy sees {count} GPU(s), "
                f"indices 0..{count - 1}"
            )
        self.device_id = device
        self.xp = cupy
        self._cupy = cupy
        self.device = cupy.cuda.Device(device.index)
        self.stream = _device_stream(cupy, device.index)
        self.bfloat16_native = _cupy_has_bfloat16(cupy)
        self._foreign_streams: set[int] = set()
        self._foreign_unordered = False

    def activate(self) -> Any:
        """Context manager making this device and its stream current: ``with ctx.activate(): ...``."""
        return _Activation(self)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def storage_dtype(self, dtype: Any) -> np.dtype:
        """The dtype device arrays of ``dtype`` carry: ``uint16`` for bfloat16 on a CuPy without it."""
        dt = np.dtype(dtype)
        if dt == _BFLOAT16 and not self.bfloat16_native:
            return np.dtype(np.uint16)
        return dt

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
        with self.activate():
            array = self._cupy.empty(shape, dtype=self.storage_dtype(dtype))
            if zero and array.nbytes:
                # all-zero bits are 0.0 in every float format; a memset needs no dtype kernel
                array.data.memset_async(0, array.nbytes, self.stream)
        return array

    def is_device_array(self, array: Any) -> bool:
        return isinstance(array, self._cupy.ndarray) and array.device.id == self.device_id.index

    def available_memory(self) -> int | None:
        """Bytes a build on this GPU can allocate now: what the driver reports free plus what
        CuPy's default memory pool holds unused (the pool hands those to new arrays before it
        asks the driver for more). None with a CuPy that cannot tell."""
        cupy = self._cupy
        try:
            with self.device:
                free, _total = cupy.cuda.runtime.memGetInfo()
                pooled = cupy.get_default_memory_pool().free_bytes()
        except AttributeError:
            return None
        return int(free) + int(pooled)

    def to_device(self, array: Any) -> Any:
        """Copy host data to this device, on this context's stream (asynchronous w.r.t. the host).

        CuPy stages pageable host memory through a pinned buffer, so ``array`` may be reused as
        soon as this returns.
        """
        host = np.asarray(array)
        if host.dtype == _BFLOAT16:  # moved as its bits: no bfloat16 kernel or dtype path needed
            with self.activate():
                bits = self._cupy.asarray(np.ascontiguousarray(host).view(np.uint16))
            return bits.view(self.storage_dtype(_BFLOAT16))
        with self.activate():
            out = self._cupy.asarray(host)
        return out

    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy copy of a device array (CuPy or foreign), after this context's stream finished.

        A foreign array is only read here (the import orders its producer first, and the copy
        ends with a synchronize): its producer is not kept for :meth:`release_foreign`.
        """
        streams, unordered = set(self._foreign_streams), self._foreign_unordered
        array = self.as_device_array(array)
        self._foreign_streams, self._foreign_unordered = streams, unordered
        if isinstance(array, self._cupy.ndarray):
            bf16 = array.dtype == _BFLOAT16
            with self.activate():
                host = (array.view(np.uint16) if bf16 else array).get(stream=self.stream)
            self.stream.synchronize()
            return host.view(_BFLOAT16) if bf16 else host
        return np.asarray(array)

    # ------------------------------------------------------------------ foreign arrays
    def as_device_array(self, array: Any) -> Any:
        """A CuPy view (no copy) of a CUDA array of another library on this device.

        Accepts anything with ``__dlpack__`` (a torch CUDA tensor, JAX, ...) or
        ``__cuda_array_interface__`` (Numba, PyTorch, ...). Anything else, a CuPy array, a host
        array or an array on another GPU, is returned unchanged, so the caller's usual checks
        reject it with their usual message.

        Ordering: work the producer queued on the array before this call runs before anything
        this context launches (DLPack hands CuPy the context's stream to wait on; the CUDA array
        interface makes CuPy synchronize on the producer's stream). The other direction needs
        :meth:`release_foreign` after the launches.

        A torch ``bfloat16`` tensor is accepted through an ``int16`` view of its bits; it becomes
        an ``ml_dtypes.bfloat16`` view, or a ``uint16`` one on a CuPy without bfloat16
        (:meth:`storage_dtype`).
        """
        cupy = self._cupy
        if isinstance(array, cupy.ndarray | np.ndarray):
            return array
        torch = torch_of(array)
        producer: int | None = None  # the producer's stream, where it can be named
        if hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__"):
            try:
                device_type, device_index = array.__dlpack_device__()
            except Exception:
                return array
            if int(device_type) not in _DLPACK_CUDA or int(device_index) != self.device_id.index:
                return array
            if torch is not None:
                refuse_grad(array)
            with self.activate():
                view = self._from_dlpack(array, torch)
            if torch is not None:
                producer = int(torch.cuda.current_stream(array.device).cuda_stream)
            else:
                self._foreign_unordered = True  # a DLPack producer whose stream we cannot name
        else:
            try:
                interface = array.__cuda_array_interface__
            except Exception:  # no interface, or a dtype the producer cannot describe
                return array
            with self.activate():
                view = cupy.asarray(array)  # zero-copy for __cuda_array_interface__ objects
            if view.device.id != self.device_id.index:
                return array
            stream = interface.get("stream") if isinstance(interface, dict) else None
            producer = None if stream is None else int(stream)
        # 0 and 1 name the legacy default stream, which this (blocking) stream is ordered with
        if producer is not None and producer not in (0, 1):
            self._foreign_streams.add(producer)
        return view

    def release_foreign(self) -> None:
        """Order the producers of arrays taken by :meth:`as_device_array` after this context's work.

        Their streams wait (on the device, the host does not block) for everything launched on this
        context's stream so far; a producer whose stream is unknown is served by synchronizing
        this context's stream. Cheap when no foreign array was taken since the last call.
        """
        if not self._foreign_streams and not self._foreign_unordered:
            return
        cupy = self._cupy
        streams, self._foreign_streams = self._foreign_streams, set()
        unordered, self._foreign_unordered = self._foreign_unordered, False
        with self.device:
            if unordered:
                self.stream.synchronize()
                return
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
            for pointer in streams:
                if pointer != self.stream.ptr:
                    cupy.cuda.ExternalStream(pointer).wait_event(event)

    def _from_dlpack(self, array: Any, torch: Any) -> Any:
        cupy = self._cupy
        is_bf16 = torch is not None and array.dtype == torch.bfloat16
        if not is_bf16:
            return cupy.from_dlpack(array)
        if self.bfloat16_native:
            try:
                return cupy.from_dlpack(array)
            except Exception:  # a CuPy whose DLPack import predates bfloat16
                pass
        bits = cupy.from_dlpack(torch_bits_view(torch, array))
        return bits.view(_BFLOAT16 if self.bfloat16_native else np.uint16)


def _cupy_has_bfloat16(cupy: ModuleType) -> bool:
    """True if CuPy accepts ``ml_dtypes.bfloat16`` arrays (CuPy >= 14)."""
    try:
        cupy.empty((0,), dtype=_BFLOAT16)
    except Exception:
        return False
    return True


_STREAMS: dict[int, Any] = {}


def _device_stream(cupy: ModuleType, index: int) -> Any:
    """The stream every context of GPU ``index`` runs on (created once).

    Separate streams per context would leave a model on one stream and its loss on another
    unordered: a blocking stream waits for the legacy default stream, not for other streams.
    """
    stream = _STREAMS.get(index)
    if stream is None:
        with cupy.cuda.Device(index):
            # Blocking (the default): ordered with the legacy default stream user code runs on.
            stream = _STREAMS.setdefault(index, cupy.cuda.Stream(non_blocking=False))
    return stream


class _Activation:
    def __init__(self, ctx: CudaExecutionContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> CudaExecutionContext:
        self._ctx.device.__enter__()
        self._ctx.stream.__enter__()
        return self._ctx

    def __exit__(self, *exc: object) -> None:
        self._ctx.stream.__exit__(*exc)
        self._ctx.device.__exit__(*exc)


_SHARED: dict[DeviceId, CudaExecutionContext] = {}


def shared_context(device: DeviceId) -> CudaExecutionContext:
    """One context per GPU for process-wide shared buffers (e.g. RoPE tables)."""
    ctx = _SHARED.get(device)
    if ctx is None:
        ctx = _SHARED.setdefault(device, CudaExecutionContext(device))
    return ctx
