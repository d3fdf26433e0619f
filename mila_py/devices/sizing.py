"""A sizing context: builds through it have every buffer's shape and dtype but no memory.

``Llama.required_memory`` builds a twin of the model through one and reads its memory stats:
the prediction of a build that would not fit is a table of bytes, not a ``MemoryError`` (or,
on a GPU, an out-of-memory that evicts what is there).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.execution_context import ExecutionContext

__all__ = ["SizingContext"]


class SizingContext(ExecutionContext):
    """Wraps a real execution context; :meth:`allocate` returns arrays of the requested shape
    and dtype whose elements all share one real element (every stride 0), so their ``nbytes``
    is what the real build allocates while they hold one item. Everything else (the array
    module, the op registry's device, tables, streams) is the wrapped context's.

    A twin built through it must never run: its buffers alias themselves.
    """

    def __init__(self, inner: ExecutionContext) -> None:
        self._inner = inner
        self.device_id = inner.device_id
        self.xp = inner.xp

    def __getattr__(self, name: str) -> Any:  # device-specific members (stream, ...)
        inner = self.__dict__.get("_inner")
        if inner is None:  # a copy or unpickle asks before __init__ ran
            raise AttributeError(name)
        return getattr(inner, name)

    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
        one = self._inner.allocate((1,), dtype, zero=zero)
        shape = tuple(int(n) for n in shape)
        return self.xp.lib.stride_tricks.as_strided(one, shape=shape, strides=(0,) * len(shape))

    def synchronize(self) -> None:
        self._inner.synchronize()

    def activate(self) -> Any:
        return self._inner.activate()

    def available_memory(self) -> int | None:
        return self._inner.available_memory()

    def is_device_array(self, array: Any) -> bool:
        return self._inner.is_device_array(array)

    def to_device(self, array: Any) -> Any:
        return self._inner.to_device(array)

    def to_host(self, array: Any) -> np.ndarray:
        return self._inner.to_host(array)
