"""The execution context: where a component's arrays live and its work runs.

Every buffer a component or op owns is allocated through :meth:`ExecutionContext.allocate`, so
memory is counted in one place (see :mod:`mila_py.memory`).
"""

from __future__ import annotations

import abc
import contextlib
import sys
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceId, DeviceType

__all__ = ["ExecutionContext", "torch_bits_view", "torch_of"]


class ExecutionContext(abc.ABC):
    """Abstract execution context for one device.

    Attributes:
        device_id: the device this context runs on.
        xp: the array module (``numpy`` or ``cupy``).
    """

    device_id: DeviceId
    xp: Any

    @property
    def device_type(self) -> DeviceType:
        return self.device_id.device_type

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until all work submitted through this context has finished."""

    @abc.abstractmethod
    def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
        """Allocate an array on this device (zeroed unless ``zero=False``)."""

    @abc.abstractmethod
    def is_device_array(self, array: Any) -> bool:
        """True if ``array`` lives on this context's device and can be used in place."""

    @abc.abstractmethod
    def to_device(self, array: Any) -> Any:
        """Copy host data (anything ``numpy.asarray`` accepts) to this device."""

    def available_memory(self) -> int | None:
        """Bytes a build on this device can still allocate now; None where the device cannot
        tell (``Component.build`` then checks nothing). Overridden per device."""
        return None

    def activate(self) -> Any:
        """Context manager making this context's device (and stream) current for array work
        that names no device: ``with ctx.activate(): ...``. Nothing to do on the CPU."""
        return contextlib.nullcontext()

    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy copy of an array of this device (never a view of it, on any device)."""
        return np.array(array, copy=True)

    def as_device_array(self, array: Any) -> Any:
        """A view (no copy) of another library's array on this device, in this context's array
        type; anything else is returned unchanged. Overridden per device."""
        return array

    def release_foreign(self) -> None:
        """Order the producers of arrays taken by :meth:`as_device_array` after this context's
        work (nothing to do where work is synchronous)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_id})"


def torch_of(array: Any) -> Any:
    """The torch module if ``array`` is a torch tensor (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(array, torch.Tensor):
        return torch
    return None


def refuse_grad(tensor: Any) -> None:
    """TypeError for a torch tensor that requires grad, whatever its dtype (torch's own DLPack
    export refuses one with a BufferError; a view of its bits would let in-place work bypass
    autograd)."""
    if getattr(tensor, "requires_grad", False):
        raise TypeError(
            f"a torch tensor that requires grad (shape {tuple(tensor.shape)}) cannot be rotated "
            "or filled in place, out of autograd's sight: pass tensor.detach()"
        )


def torch_bits_view(torch: Any, tensor: Any) -> Any:
    """An ``int16`` view of a torch ``bfloat16`` tensor's bits, for a DLPack import that has no
    bfloat16 (a tensor that requires grad is refused, see :func:`refuse_grad`)."""
    refuse_grad(tensor)
    return tensor.view(torch.int16)
