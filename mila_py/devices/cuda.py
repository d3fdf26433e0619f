"""CUDA execution context: CuPy arrays on one GPU, all work on the context's own stream.

CuPy is imported only when a CUDA context is created, so the package imports on machines
without CuPy or without a GPU.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceId, DeviceType
from mila_py.devices.execution_context import ExecutionContext

__all__ = ["CudaExecutionContext", "cuda_device_count", "import_cupy", "shared_context"]

_INSTALL_HINT = (
    "install CuPy for your CUDA toolkit with `pip install mila-py[cuda12]` "
    "or `pip install mila-py[cuda13]`"
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

    The context selects its device and owns a non-blocking ``cupy.cuda.Stream``; everything a
    component launches runs on that stream (use :meth:`activate` as a context manager) and
    :meth:`synchronize` waits on it.

    Raises:
        RuntimeError: if CuPy is missing (with the pip command to fix it) or the GPU does not exist.
    """

    def __init__(self, device: DeviceId) -> None:
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
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def activate(self) -> Any:
        """Context manager making this device and its stream current: ``with ctx.activate(): ...``."""
        return _Activation(self)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
        with self.activate():
            array = self._cupy.empty(shape, dtype=dtype)
            if zero:
                array.fill(0)
        return array

    def is_device_array(self, array: Any) -> bool:
        return isinstance(array, self._cupy.ndarray) and array.device.id == self.device_id.index

    def to_device(self, array: Any) -> Any:
        with self.activate():
            out = self._cupy.asarray(np.asarray(array))
        return out

    def to_host(self, array: Any) -> np.ndarray:
        if isinstance(array, self._cupy.ndarray):
            with self.activate():
                host = array.get(stream=self.stream)
            self.stream.synchronize()
            return host
        return np.asarray(array)


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
