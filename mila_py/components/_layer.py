"""Layer: what the layer components share (op creation, argument checks, views of owned buffers).

Every layer holds its buffers, allocated once at build for the build shape ``[*lead, C]`` (its
activations and scratch may be another layer's of the same shape, shared by a parent whose parts
run one at a time: :func:`~mila_py.component.share_workspace`). A call with smaller leading
dimensions uses the first ``prod(lead')`` rows of each buffer as a contiguous ``[*lead', C]``
view, so results are always C-contiguous whatever the call's shape.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from mila_py.build_context import BuildContext
from mila_py.component import Component
from mila_py.devices import DeviceLike
from mila_py.init import init_name, rng_for
from mila_py.ops.registry import create_op
from mila_py.precision import Precision

__all__ = ["INIT_STD", "Layer", "check_finite", "check_sizes", "is_bool", "is_int", "leading_view"]

#: standard deviation of the normal initialization (Hugging Face ``initializer_range``)
INIT_STD = 0.02

#: views of owned buffers a layer keeps (see :meth:`Layer._view`)
_MAX_VIEWS = 64


def is_int(value: Any) -> bool:
    """True for ints (and NumPy integers), False for bools."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def is_bool(value: Any) -> bool:
    """True for bools (and NumPy's bool)."""
    return isinstance(value, bool | np.bool_)


def check_sizes(config: Any, *names: str) -> None:
    """Raise unless each field ``names`` of ``config`` is an int > 0 (TypeError / ValueError
    naming the config class and the field); NumPy integers are stored as Python ints."""
    owner = type(config).__name__
    for name in names:
        value = getattr(config, name)
        if not is_int(value):
            raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")
        if type(value) is not int:
            object.__setattr__(config, name, int(value))  # (frozen dataclasses too)


def check_device_array(owner: Any, x: Any, name: str) -> None:
    """Raise TypeError (naming ``owner``) unless ``x`` is an array of ``owner``'s device."""
    ctx = owner.execution_context
    if not ctx.is_device_array(x):
        raise TypeError(
            f"{owner._describe()}: {name} must be an array on {ctx.device_id} "
            f"({ctx.xp.__name__}.ndarray), got {type(x).__module__}.{type(x).__name__}"
        )


#: storage dtypes whose components take an upstream gradient in float32 too
_REDUCED = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def check_grad(owner: Any, dy: Any, name: str, shape: tuple[int, ...], dtype: Any) -> None:
    """Raise unless ``dy`` is an array of ``owner``'s device, of ``dtype`` (or float32 when
    ``dtype`` is 16-bit storage: a gradient kept in float32 upstream) and exactly ``shape``
    (the last forward's output): TypeError / ValueError naming ``owner``."""
    check_device_array(owner, dy, name)
    if dy.dtype != dtype and not (dtype in _REDUCED and dy.dtype == np.float32):
        also = " or float32" if dtype in _REDUCED else ""
        raise TypeError(f"{owner._describe()}: {name} has dtype {dy.dtype}; expected {dtype}{also}")
    if tuple(dy.shape) != tuple(shape):
        raise ValueError(
            f"{owner._describe()}: {name} must have the shape of the last forward output "
            f"{list(shape)}, got {list(dy.shape)}"
        )


def check_finite(config: Any, name: str, *, positive: bool = False) -> None:
    """Raise unless field ``name`` of ``config`` is a finite number (and > 0 when ``positive``)."""
    owner, value = type(config).__name__, getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise TypeError(f"{owner}: {name} must be a number, got {value!r}")
    if not math.isfinite(value) or (positive and value <= 0):
        needs = "finite and > 0" if positive else "finite"
        raise ValueError(f"{owner}: {name} must be {needs}, got {value!r}")


def leading_view(buffer: Any, shape: tuple[int, ...]) -> Any:
    """The first ``prod(shape)`` elements of a C-contiguous ``buffer`` as a ``shape`` view (C-contiguous
    itself, unlike a slice ``buffer[:b, :t]`` of a larger build shape)."""
    return buffer.reshape(-1)[: math.prod(shape)].reshape(shape)


class Layer(Component):
    """Base of the layer components: a config, one device op, and the checks every call runs.

    Subclasses set ``_OP_NAME`` and ``_CONFIG_TYPE`` and implement ``_on_building``; they may be
    composites too (``class SwiGLU(Layer, CompositeComponent)``): the hooks here call ``super()``.

    Args:
        name: component name.
        config: an instance of the subclass's ``_CONFIG_TYPE``.
        device: ``"CPU"``, ``"CUDA:0"``, ... for a standalone component; None inside a Network.
        precision: storage precision of its arrays.

    Raises:
        TypeError: ``config`` has the wrong type.
        OpNotFoundError: (with ``device``) no op for this device and precision.
    """

    _OP_NAME: ClassVar[str]
    _CONFIG_TYPE: ClassVar[type]

    def __init__(
        self,
        name: str,
        config: Any,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if not isinstance(config, self._CONFIG_TYPE):
            raise TypeError(
                f"{type(self).__name__} '{name}': config must be a {self._CONFIG_TYPE.__name__}, "
                f"got {config!r}"
            )
        self.config = config
        self._op: Any = None
        self._dtype = np.dtype(precision.numpy_dtype)
        self._max_lead: tuple[int, ...] = ()
        #: what the last forward of a TRAINING build kept for backward (None before any)
        self._saved: Any = None
        #: ``(state key, shape) -> (buffer, view)``, see :meth:`_view`
        self._views: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = {}

    # ------------------------------------------------------------------ lifecycle hooks
    def _on_execution_context_set(self) -> None:
        self._op = create_op(self._OP_NAME, self.execution_context, self.config, self.precision)
        super()._on_execution_context_set()

    @property
    def op(self) -> Any:
        """The device op."""
        return self._op

    # ------------------------------------------------------------------ helpers for subclasses
    def _init_normal(self, array: Any, std: float = INIT_STD) -> None:
        """Fill ``array`` with Normal(0, std) draws from this component's own seeded stream."""
        rng = rng_for(init_name(self))
        if (
            isinstance(array, np.ndarray)
            and array.dtype in (np.float32, np.float64)
            and array.flags.c_contiguous
        ):
            rng.standard_normal(out=array, dtype=array.dtype)
            array *= std
        else:  # the same draws, made on the host (a transposed view, a device, 16-bit storage)
            wide = array.dtype in (np.float32, np.float64)
            values = rng.standard_normal(array.shape, dtype=array.dtype if wide else np.float32)
            values *= std
            array[...] = self.execution_context.to_device(values.astype(array.dtype))

    def _build_lead(self, build_context: BuildContext, last: int, layout: str) -> tuple[int, ...]:
        """The leading dimensions of a build shape ``[*lead, last]`` (at least one)."""
        shape = build_context.input_shape
        if len(shape) < 2 or shape[-1] != last:
            raise ValueError(
                f"{self._describe()}: build input_shape must be {layout} = [..., {last}], "
                f"got {shape}"
            )
        return shape[:-1]

    def _view(self, key: str, shape: tuple[int, ...]) -> Any:
        """The first ``prod(shape)`` elements of the state buffer ``key`` as a ``shape`` view.

        Views are kept per ``(key, shape)`` (decode asks for the same few hundreds of times per
        token); an entry serves only while ``key`` still names the buffer it was cut from. Each
        call returns a new view object of the kept one (``[...]``, cheaper than the reshapes), so
        a caller that changes its view's shape or flags changes nothing for the next caller.
        """
        buffer = self._state[key]
        entry = self._views.get((key, shape))
        if entry is not None and entry[0] is buffer:
            return entry[1][...]
        view = leading_view(buffer, shape)
        if len(self._views) >= _MAX_VIEWS:  # many distinct call shapes: start over
            self._views.clear()
        self._views[(key, shape)] = (buffer, view)
        return view[...]

    def _require_built(self, what: str) -> None:
        if self._build_context is None:
            raise RuntimeError(
                f"{self._describe()}: {what} needs a built component; call "
                "build(BuildContext(input_shape, RuntimeMode.TRAINING or INFERENCE)) first"
            )

    def _require_backward(self) -> None:
        """Raise unless backward is possible: a TRAINING build after a forward."""
        self._require_built("backward()")
        if not self.build_context.is_training:
            raise RuntimeError(
                f"{self._describe()} was built for INFERENCE and has no gradient buffers; "
                "build it with RuntimeMode.TRAINING to call backward()"
            )
        if self._saved is None:
            raise RuntimeError(f"{self._describe()}: backward() needs a forward() first")

    def _check_device_array(self, x: Any, name: str) -> None:
        check_device_array(self, x, name)

    def _check_lead(self, x: Any, name: str, expected: str, lead: tuple[int, ...]) -> None:
        if any(n > m for n, m in zip(lead, self._max_lead, strict=True)):
            raise ValueError(
                f"{self._describe()}: {name} of shape {tuple(x.shape)} exceeds the build shape: "
                f"expected {expected}; build with a larger input_shape for bigger calls"
            )

    def _expected(self, *trailing: int) -> str:
        dims = [f"<={m}" for m in self._max_lead] + [str(t) for t in trailing]
        return "[" + ", ".join(dims) + "]"

    def _check_floats(self, x: Any, name: str, last: int) -> tuple[int, ...]:
        """Validate a float input ``[*lead, last]`` against the build shape; returns ``lead``.

        Runs on every call of every layer (decode makes hundreds per token), so the passing
        path builds no strings."""
        self._check_device_array(x, name)
        if x.dtype != self._dtype:
            raise TypeError(
                f"{self._describe()}: {name} has dtype {x.dtype}; this component is "
                f"{self.precision} ({self._dtype}); convert with .astype"
            )
        shape = x.shape
        max_lead = self._max_lead
        if len(shape) != len(max_lead) + 1 or shape[-1] != last:
            raise ValueError(
                f"{self._describe()}: {name} must be {self._expected(last)}, got {tuple(shape)}"
            )
        lead = tuple(shape[:-1])  # NumPy and CuPy shapes are tuples of ints already
        for n, m in zip(lead, max_lead, strict=True):
            if n > m:
                self._check_lead(x, name, self._expected(last), lead)
        output = self._state.get("output")
        if output is not None and self.execution_context.xp.may_share_memory(x, output):
            raise ValueError(
                f"{self._describe()}: {name} overlaps this component's own output buffer, which "
                "the call overwrites; pass a copy"
            )
        return lead

    def _check_ints(self, x: Any, name: str) -> tuple[int, ...]:
        """Validate an integer input shaped like the build's leading dimensions; returns its shape."""
        self._check_device_array(x, name)
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{self._describe()}: {name} must be integers, got dtype {x.dtype}")
        expected = self._expected()
        if x.ndim != len(self._max_lead):
            raise ValueError(f"{self._describe()}: {name} must be {expected}, got {tuple(x.shape)}")
        shape = tuple(int(n) for n in x.shape)
        self._check_lead(x, name, expected, shape)
        return shape

    def _check_grad(self, dy: Any, name: str, shape: tuple[int, ...]) -> None:
        """Validate an upstream gradient: this device, this dtype (or float32 for 16-bit
        storage), exactly ``shape``."""
        check_grad(self, dy, name, shape, self._dtype)
