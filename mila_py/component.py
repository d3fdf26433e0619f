"""Component: the lifecycle every mila_py layer, block and network follows.

The lifecycle (mirroring Mila's ``Component``):

1. **Construct** ``Comp(name, ..., device=None, precision=Precision.FP32)``. Validates the name and
   config; allocates nothing. With ``device`` (``"CPU"``, ``"CUDA:0"``, a DeviceId) the component
   is *standalone*: it creates and owns its execution context right after ``__init__`` returns.
   Without it, the component waits for its parent to hand it a context.
2. **Execution context set**, once only. The hook ``_on_execution_context_set`` runs; leaves create
   their op there. If the hook raises, no context is set and the component can be given another.
3. **build(BuildContext)**, once only (``build`` is final: subclasses implement ``_on_building``).
   Allocates parameters, gradients (TRAINING only) and state. A build the device cannot hold
   (:meth:`Component.required_memory` against the device's available memory) is refused with a
   ``MemoryError`` before anything is allocated. If the hook raises, the component and its whole
   subtree are restored to exactly what they were before, so ``build`` can be retried.
4. **Run**: ``forward``/``backward`` and friends, defined by each subclass. ``set_training_mode``
   switches TRAINING builds between NORMAL and EVAL (hook ``_on_training_mode_changing``).

Subclasses register what they allocate with :meth:`_add_parameter` and :meth:`_add_state`; from
those registrations the base class answers ``named_parameters``, ``get_gradients``,
``zero_gradients``, ``parameter_count`` and ``get_memory_stats`` for every component alike.

Precision: parameters and state are stored in the component's precision. On TRAINING builds the
gradient of a 16-bit parameter (FP16, BF16) is an FP32 buffer (:attr:`Precision.compute_dtype`),
so that micro-batches and many small updates accumulate without 16-bit rounding; the gradients
of FP32 and FP64 parameters have their parameter's dtype. :class:`~mila_py.memory.MemoryStats`
counts each buffer in its own dtype (``by_dtype``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np

from mila_py.build_context import BuildContext, RuntimeMode, TrainingMode
from mila_py.devices import DeviceId, DeviceLike, DeviceType, create_execution_context
from mila_py.devices.execution_context import ExecutionContext
from mila_py.devices.host_memory import host_available_memory
from mila_py.devices.sizing import SizingContext
from mila_py.memory import MemoryCategory, MemoryLocation, MemoryStats, format_bytes
from mila_py.ops.operation import Operation
from mila_py.ops.registry import OpNotFoundError
from mila_py.precision import Precision

__all__ = ["Component", "share_workspace"]

_BUILDING = threading.local()  # depth of nested build() calls in this thread
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,127}")


class _ComponentMeta(type):
    """Runs the standalone-context step after the whole ``__init__`` chain has finished."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        obj._finish_construction()
        return obj


class Component(metaclass=_ComponentMeta):
    """Base class of every mila_py component.

    Args:
        name: 1-128 characters: a letter, then letters, digits, ``.``, ``_`` or ``-``.
        device: makes the component standalone on that device; ``None`` waits for a parent.
        precision: storage precision of its tensors.

    Raises:
        ValueError: a malformed name or device string.
        TypeError: a name that is not a str, a precision that is not a :class:`Precision`.
    """

    _FINAL_METHODS: ClassVar[tuple[str, ...]] = ("build", "set_execution_context")
    #: the built component whose workspace buffers the next build takes instead of allocating
    #: its own (see :func:`share_workspace`); None: the build allocates them
    _workspace_donor: Component | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method in Component._FINAL_METHODS:
            for klass in cls.__mro__:  # the class and its mixins, up to Component
                if klass is Component:
                    break
                if method in klass.__dict__:
                    raise TypeError(
                        f"{cls.__name__} overrides Component.{method} (in {klass.__name__}), "
                        "which is final; implement the hook (_on_building / "
                        "_on_execution_context_set) instead"
                    )

    def __init__(
        self,
        name: str,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"component name must be a str, got {name!r}")
        if not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"invalid component name {name!r}: use 1-128 characters, a letter first, "
                "then letters, digits, '.', '_' or '-'"
            )
        if not isinstance(precision, Precision):
            raise TypeError(f"{name}: precision must be a Precision, got {precision!r}")
        self._name = name
        self._precision = precision
        self._standalone_device: DeviceId | None = (
            DeviceId.parse(device) if device is not None else None
        )
        self._context: ExecutionContext | None = None
        self._owns_context = False
        self._parent: Component | None = None  # the composite this one was added to
        self._build_context: BuildContext | None = None
        self._training_mode: TrainingMode | None = None
        self._parameters: dict[str, Any] = {}
        self._gradients: dict[str, Any] = {}
        self._input_gradients: dict[str, Any] = {}
        self._state: dict[str, Any] = {}

    def _finish_construction(self) -> None:
        if self._standalone_device is not None and self._context is None:
            self.set_execution_context(create_execution_context(self._standalone_device))
            self._owns_context = True

    # ------------------------------------------------------------------ identity and context
    @property
    def name(self) -> str:
        return self._name

    @property
    def precision(self) -> Precision:
        return self._precision

    @property
    def has_execution_context(self) -> bool:
        return self._context is not None

    @property
    def execution_context(self) -> ExecutionContext:
        """The context this component runs on.

        Raises:
            RuntimeError: if no context has been set yet.
        """
        if self._context is None:
            raise RuntimeError(
                f"{self._describe()} has no execution context: construct it with device=... "
                "or add it to a Network"
            )
        return self._context

    @property
    def device_id(self) -> DeviceId:
        return self.execution_context.device_id

    def set_execution_context(self, context: ExecutionContext) -> None:
        """Give the component its execution context (once; parents call this for children).

        Raises:
            RuntimeError: if a context is already set.
            TypeError: if ``context`` is not an ExecutionContext.
        """
        if self._context is not None:
            raise RuntimeError(
                f"{self._describe()} already has an execution context ({self._context.device_id}); "
                "it can be set only once"
            )
        if not isinstance(context, ExecutionContext):
            raise TypeError(f"{self._describe()}: expected an ExecutionContext, got {context!r}")
        snapshot = self._snapshot()
        self._context = context
        try:
            self._on_execution_context_set()
        except OpNotFoundError as exc:
            _restore(snapshot)
            if getattr(exc, "component", None) is None:  # the leaf whose op is missing: name it
                others = sorted(str(p) for p in exc.other_precisions)
                hint = (
                    f"construct it with a precision that device supports ({', '.join(others)})"
                    if others
                    else "the op is not registered for that device"
                )
                named = OpNotFoundError(
                    f"{self._describe()} ({self.precision} on {context.device_id}): {exc}; {hint}"
                )
                named.other_precisions = exc.other_precisions
                named.component = self  # type: ignore[attr-defined]
                raise named from None
            raise
        except BaseException:
            # Restore the whole subtree: a nested composite may have handed the context to
            # grandchildren before a later sibling's hook raised.
            _restore(snapshot)
            raise

    def _release_context(self) -> None:
        """Give back the context this subtree received from a tree it leaves (removal from an
        unbuilt composite), so that it can join another: children first, then
        :meth:`_on_execution_context_released`, then the context itself. Components that are
        built, or own their context, keep theirs (and so do their subtrees)."""
        if self._context is None or self._owns_context or self.is_built:
            return
        for child in self._children():
            child._release_context()
        self._on_execution_context_released()
        self._context = None

    def synchronize(self) -> None:
        """Wait for the device work this component submitted."""
        self.execution_context.synchronize()

    # ------------------------------------------------------------------ build
    @property
    def is_built(self) -> bool:
        return self._build_context is not None

    @property
    def build_context(self) -> BuildContext:
        """The BuildContext given to :meth:`build`.

        Raises:
            RuntimeError: before build.
        """
        if self._build_context is None:
            raise RuntimeError(
                f"{self._describe()} is not built yet: call build(BuildContext(...))"
            )
        return self._build_context

    @property
    def runtime_mode(self) -> RuntimeMode:
        return self.build_context.runtime_mode

    def build(self, build_context: BuildContext, *, check_memory: bool = True) -> None:
        """Allocate everything the component needs for ``build_context`` (final; once only).

        Args:
            build_context: what to build for.
            check_memory: first compare :meth:`required_memory` with the memory the device
                has available (:meth:`ExecutionContext.available_memory`; on a GPU, the host
                buffers with the system's too) and refuse a build that cannot fit before
                anything is allocated. ``False`` builds without asking (a device whose free
                memory is misreported, or memory that will be freed meanwhile). The root of a
                tree checks the whole build once; the parts it builds are not checked again.

        Raises:
            TypeError: if ``build_context`` is not a BuildContext.
            RuntimeError: if already built, no execution context is set, or the component is
                part of a tree (the root builds every part, with the context each needs).
            ValueError: if the subclass rejects the context (e.g. a shape that fits no config),
                or two components of the tree have one dotted path.
            MemoryError: the build needs more memory than the device has available (the
                message gives both); nothing was allocated and the component is unbuilt.
        """
        if not isinstance(build_context, BuildContext):
            raise TypeError(
                f"{self._describe()}: build() needs a BuildContext, got {build_context!r}"
            )
        if self._build_context is not None:
            raise RuntimeError(f"{self._describe()} is already built; build() runs once")
        if self._context is None:
            raise RuntimeError(
                f"{self._describe()} cannot be built without an execution context: construct it "
                "with device=... or add it to a Network"
            )
        depth = getattr(_BUILDING, "depth", 0)
        if depth == 0 and self._parent is not None:
            root = self._parent
            while root._parent is not None:
                root = root._parent
            raise RuntimeError(
                f"{self._describe()} belongs to {self._parent._describe()}: a tree is built from "
                f"its root ({root._describe()}), which builds each part with the context it needs"
            )
        if depth == 0 and check_memory:
            self._check_memory(build_context)
        snapshot = self._snapshot()
        if depth == 0:  # the root of this build: seed every descendant by its dotted path
            from mila_py.init import assign_init_names

            assign_init_names(self)
        _BUILDING.depth = depth + 1
        try:
            self._parameters, self._gradients, self._state = {}, {}, {}
            self._input_gradients = {}
            self._pending_build_context = build_context
            self._on_building(build_context)
            del self._pending_build_context
            self._build_context = build_context
            self._training_mode = (
                TrainingMode.NORMAL if build_context.is_training else TrainingMode.EVAL
            )
        except BaseException:
            _restore(snapshot)
            raise
        finally:
            _BUILDING.depth = depth

    def required_memory(self, build_context: BuildContext) -> MemoryStats:
        """The :class:`MemoryStats` a build with ``build_context`` will have, without
        allocating it: the subtree is built through a
        :class:`~mila_py.devices.sizing.SizingContext` (buffers of the build's shapes that
        hold one element each), measured, and put back exactly as it was, unbuilt.

        Raises:
            TypeError: ``build_context`` is not a BuildContext.
            RuntimeError: no execution context, or already built (its
                :meth:`get_memory_stats` is what it holds).
            ValueError: what :meth:`build` would raise for ``build_context``.
        """
        if not isinstance(build_context, BuildContext):
            raise TypeError(
                f"{self._describe()}: required_memory needs a BuildContext, got {build_context!r}"
            )
        context = self.execution_context
        if self.is_built:
            raise RuntimeError(
                f"{self._describe()} is built: get_memory_stats() gives the memory it holds"
            )
        snapshot = self._snapshot()
        depth = getattr(_BUILDING, "depth", 0)
        try:
            for component in self._walk():  # the subtree takes the sizing context instead
                component._context = None
            self.set_execution_context(SizingContext(context))
            # built as a part is: no memory check, no initialization (nothing is drawn)
            _BUILDING.depth = depth + 1
            self.build(replace(build_context, initialize_parameters=False))
            return self.get_memory_stats()
        finally:
            _BUILDING.depth = depth
            _restore(snapshot)

    def _check_memory(self, build_context: BuildContext) -> None:
        """Raise MemoryError if :meth:`required_memory` exceeds what the device (and, for a
        GPU, the host) has available; nothing to check where neither is known."""
        context = self._context
        if context is None or isinstance(context, SizingContext):  # a sizing build: no memory
            return
        on_cpu = context.device_type is DeviceType.CPU
        device_free = context.available_memory()
        host_free = None if on_cpu else host_available_memory()
        if device_free is None and host_free is None:
            return
        try:
            needed = self.required_memory(build_context)
        except Exception:
            # a build that cannot be sized fails the same way for real (a shape it refuses),
            # or needs buffers it can fill: the build itself reports it, and rolls back
            return
        # on the CPU the device's memory and the host's are the same system memory
        device_needed = needed.total_bytes if on_cpu else needed.device_total_bytes
        short = [
            (what, need, free)
            for what, need, free in (
                (f"{context.device_id} memory", device_needed, device_free),
                ("host memory", needed.host_total_bytes, host_free),
            )
            if free is not None and need > free
        ]
        if short:
            lacks = "; ".join(
                f"it needs {format_bytes(need)} ({need:,} bytes) of {what}, "
                f"{format_bytes(free)} ({free:,} bytes) is available"
                for what, need, free in short
            )
            raise MemoryError(
                f"{self._describe()}: cannot build for {build_context.input_shape} "
                f"({build_context.runtime_mode.value}): {lacks}. Nothing was allocated: build "
                "for a smaller batch or context, free memory, or pass check_memory=False to "
                "build anyway"
            )

    def _snapshot(self) -> list[tuple[Any, dict[str, Any]]]:
        """Shallow copies of the ``__dict__`` of this component, its ops and its subtree."""
        saved: list[tuple[Any, dict[str, Any]]] = []
        for component in self._walk():
            saved.append((component, dict(component.__dict__)))
            for value in component.__dict__.values():
                if isinstance(value, Operation):
                    saved.append((value, dict(value.__dict__)))
        return saved

    # ------------------------------------------------------------------ training mode
    @property
    def training_mode(self) -> TrainingMode | None:
        """NORMAL or EVAL once built (INFERENCE builds always EVAL); ``None`` before build."""
        return self._training_mode

    @property
    def is_training_mode(self) -> bool:
        return self._training_mode is TrainingMode.NORMAL

    def set_training_mode(self, mode: TrainingMode) -> None:
        """Switch a TRAINING build, and every component in it, between NORMAL and EVAL.

        A no-op when the whole subtree is in ``mode`` already; a composite in ``mode`` whose
        child was switched on its own brings that child back (as ``torch.nn.Module.train``).

        Raises:
            TypeError: ``mode`` is not a TrainingMode.
            RuntimeError: before build, or on an INFERENCE build.
        """
        if not isinstance(mode, TrainingMode):
            raise TypeError(f"{self._describe()}: expected a TrainingMode, got {mode!r}")
        if self._build_context is None:
            raise RuntimeError(f"{self._describe()}: set_training_mode() needs a built component")
        if self._build_context.is_inference:
            raise RuntimeError(
                f"{self._describe()} was built for INFERENCE and always runs in EVAL; "
                "build it with RuntimeMode.TRAINING to train"
            )
        if all(node._training_mode is mode for node in self._walk()):
            return
        self._on_training_mode_changing(mode)
        self._training_mode = mode

    def train(self) -> None:
        """Shorthand for ``set_training_mode(TrainingMode.NORMAL)``."""
        self.set_training_mode(TrainingMode.NORMAL)

    def eval(self) -> None:
        """Shorthand for ``set_training_mode(TrainingMode.EVAL)`` on TRAINING builds."""
        self.set_training_mode(TrainingMode.EVAL)

    # ------------------------------------------------------------------ hooks
    def _on_execution_context_set(self) -> None:
        """Called once the context is set (create ops here). Raising unsets the context."""

    def _on_execution_context_released(self) -> None:
        """Called before the context is taken away (the component left its tree unbuilt): undo
        what :meth:`_on_execution_context_set` made. The default drops every op attribute."""
        for key, value in list(vars(self).items()):
            if isinstance(value, Operation):
                setattr(self, key, None)

    def _on_building(self, build_context: BuildContext) -> None:
        """Allocate buffers for ``build_context``; succeed fully or raise (the base rolls back)."""

    def _on_training_mode_changing(self, mode: TrainingMode) -> None:
        """Called before the training mode changes to ``mode``."""

    # ------------------------------------------------------------------ registration helpers
    def _allocate(self, shape: tuple[int, ...], dtype: Any = None, *, zero: bool = True) -> Any:
        dtype = self._precision.numpy_dtype if dtype is None else dtype
        return self.execution_context.allocate(tuple(shape), dtype, zero=zero)

    def _add_parameter(self, name: str, array: Any, *, with_gradient: bool | None = None) -> Any:
        """Register a parameter (and, on TRAINING builds, a zeroed gradient of the same shape,
        in :attr:`Precision.compute_dtype` of the component's precision: FP32 for 16-bit
        parameters).

        Raises:
            ValueError: ``with_gradient=True`` on an INFERENCE build (which has no gradients).
        """
        training = self._building_context().is_training
        if with_gradient and not training:
            raise ValueError(
                f"{self._describe()}: parameter {name!r} asks for a gradient on an INFERENCE "
                "build, which has none"
            )
        self._parameters[name] = array
        if with_gradient is None:
            with_gradient = training
        if with_gradient:
            self._gradients[name] = self.execution_context.allocate(
                array.shape, self._precision.compute_dtype
            )
        return array

    def _add_gradient(self, name: str, array: Any) -> Any:
        """Register a gradient buffer that belongs to no parameter (e.g. Rope's ``dq_in``).

        It counts as gradient memory but is not listed by ``get_gradients``, which stays aligned
        with ``get_parameters``.
        """
        self._input_gradients[name] = array
        return array

    def _add_state(self, name: str, array: Any) -> Any:
        """Register a state buffer (caches, activations, scratch); shared arrays count once."""
        self._state[name] = array
        return array

    def _add_workspace(
        self, name: str, shape: tuple[int, ...], dtype: Any = None, *, gradient: bool = False
    ) -> Any:
        """Allocate and register a workspace buffer: activations or scratch that a call
        overwrites and that no later call needs, except a TRAINING build's backward reading
        what its own forward wrote. A state buffer (``gradient``: an input-gradient buffer,
        see :meth:`_add_gradient`) of ``shape`` and ``dtype`` (default: the precision's).

        Within :func:`share_workspace` the build takes the donor's buffer of the same name
        instead of allocating one: the two components then run on one buffer, one at a time,
        and memory stats count it once.

        Raises:
            ValueError: the donor has no buffer ``name`` of this shape and dtype.
        """
        dtype = np.dtype(self._precision.numpy_dtype if dtype is None else dtype)
        shape = tuple(int(n) for n in shape)
        donor = self._workspace_donor
        if donor is None:
            array = self._allocate(shape, dtype)
        else:
            given = (donor._input_gradients if gradient else donor._state).get(name)
            stored = getattr(self.execution_context, "storage_dtype", np.dtype)(dtype)
            if given is None or tuple(given.shape) != shape or given.dtype != stored:
                has = "none" if given is None else f"{tuple(given.shape)} {given.dtype}"
                raise ValueError(
                    f"{self._describe()}: the workspace shared by {donor._describe()} has no "
                    f"buffer {name!r} of shape {shape} and dtype {stored} (it has {has}); "
                    "share the workspace of a component built like this one"
                )
            array = given
        if gradient:
            return self._add_gradient(name, array)
        return self._add_state(name, array)

    def _building_context(self) -> BuildContext:
        pending = self.__dict__.get("_pending_build_context")
        return pending if pending is not None else self.build_context

    # ------------------------------------------------------------------ parameters and memory
    def _children(self) -> list[Component]:
        return []

    def _walk(self) -> Iterator[Component]:
        yield self
        for child in self._children():
            yield from child._walk()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """``(dotted name, parameter)`` in canonical order (children in insertion order)."""
        for name, array in self._parameters.items():
            yield prefix + name, array
        for child in self._children():
            yield from child.named_parameters(prefix + child.name + ".")

    def named_gradients(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """``(dotted name, gradient)`` aligned with :meth:`named_parameters` where both exist."""
        for name, array in self._gradients.items():
            yield prefix + name, array
        for child in self._children():
            yield from child.named_gradients(prefix + child.name + ".")

    def named_parameter_gradients(self, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
        """``(dotted name, parameter, gradient)`` of the parameters that have a gradient, in
        :meth:`named_parameters` order, paired within each component (never by name alone:
        dotted child names can spell the same path twice)."""
        grads = self._gradients
        for name, array in self._parameters.items():
            if name in grads:
                yield prefix + name, array, grads[name]
        for child in self._children():
            yield from child.named_parameter_gradients(prefix + child.name + ".")

    def _named_state(self, prefix: str = "") -> Iterator[tuple[str, Any]]:
        """``(dotted name, buffer)`` of every state buffer of the subtree (activations, caches,
        scratch: what calls overwrite)."""
        for name, array in self._state.items():
            yield prefix + name, array
        for child in self._children():
            yield from child._named_state(prefix + child.name + ".")

    def _refuse_own_state(self, x: Any, name: str) -> None:
        """Raise ValueError if the device array ``x`` may share memory with a state buffer of
        this subtree: a call would overwrite its own input (a block given its own output back
        computes wrong values and gradients from the overwritten copy)."""
        may_share = self.execution_context.xp.may_share_memory
        for where, buffer in self._named_state():
            if may_share(x, buffer):
                raise ValueError(
                    f"{self._describe()}: {name} overlaps {where}, a buffer of this component "
                    "that the call overwrites; pass a copy"
                )

    def get_parameters(self) -> list[Any]:
        return [array for _, array in self.named_parameters()]

    def get_gradients(self) -> list[Any]:
        """Gradients of the parameters that have one, in :meth:`get_parameters` order.

        Empty on INFERENCE builds. Input-gradient buffers (Rope's ``dq_in``) are not listed.
        """
        return [grad for _, _, grad in self.named_parameter_gradients()]

    def parameter_count(self) -> int:
        """Elements in the subtree's parameters, each distinct array once (as memory stats
        count it: a parameter two components share is one)."""
        distinct = {id(p): p for p in self.get_parameters()}
        return sum(int(p.size) for p in distinct.values())

    def zero_gradients(self) -> None:
        """Set every parameter gradient of the subtree to zero (input-gradient buffers such as
        Rope's ``dq_in``, which each backward overwrites, are left as they are)."""
        grads = [grad for _, grad in self.named_gradients()]
        if grads:  # on this component's device and stream (after what wrote them)
            with self.execution_context.activate():
                for grad in grads:
                    grad.fill(0)

    def _memory_entries(self) -> Iterator[tuple[MemoryCategory, MemoryLocation, Any]]:
        for component in self._walk():
            for array in component._parameters.values():
                yield MemoryCategory.PARAMETERS, MemoryLocation.DEVICE, array
            for array in (*component._gradients.values(), *component._input_gradients.values()):
                yield MemoryCategory.GRADIENTS, MemoryLocation.DEVICE, array
            for array in component._state.values():
                yield MemoryCategory.STATE, component._location_of(array), array
            for value in component.__dict__.values():
                if isinstance(value, Operation):
                    for array in value.state_arrays():
                        yield MemoryCategory.STATE, component._location_of(array), array

    def _location_of(self, array: Any) -> MemoryLocation:
        # On a GPU component a NumPy array is host memory; on the CPU every array is device memory.
        context = self._context
        if context is None or context.device_type is DeviceType.CPU:
            return MemoryLocation.DEVICE
        return MemoryLocation.HOST if isinstance(array, np.ndarray) else MemoryLocation.DEVICE

    def get_memory_stats(self) -> MemoryStats:
        """Bytes this component (and its subtree) owns now; each distinct array counted once."""
        return MemoryStats.from_arrays(self._memory_entries())

    # ------------------------------------------------------------------ weights
    def save(self, path: Any, *, precision: Any = None) -> None:
        """Save every parameter to a safetensors file, named by dotted tree path, atomically,
        with this component's class and config in its metadata; ``precision`` (default: this
        component's) is the precision the tensors are written in."""
        from mila_py.serialization import save

        save(self, path, precision)

    def load(self, path: Any, *, check_config: bool = True) -> None:
        """Load parameters from a safetensors file; every mismatch (the config it was saved
        from included, unless ``check_config=False``) is reported, nothing loaded."""
        from mila_py.serialization import load

        load(self, path, check_config=check_config)

    # ------------------------------------------------------------------ text
    def _describe(self) -> str:
        return f"{type(self).__name__} '{self._name}'"

    def _extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        return "\n".join(self._repr_lines())

    def _repr_lines(self, indent: str = "") -> list[str]:
        parts = [f"params={self.parameter_count():,}"]
        extra = self._extra_repr()
        if extra:
            parts.insert(0, extra)
        if self._context is not None:
            parts.append(str(self._context.device_id))
        parts.append(str(self._precision))
        parts.append("built" if self.is_built else "unbuilt")
        lines = [f"{indent}{type(self).__name__}('{self._name}', {', '.join(parts)})"]
        for child in self._children():
            lines.extend(child._repr_lines(indent + "  "))
        return lines


@contextmanager
def share_workspace(
    donor: Component, receiver: Component, *, keep: Collection[str] = ()
) -> Iterator[None]:
    """Within the ``with`` block, builds of ``receiver``'s subtree take the workspace buffers
    (:meth:`Component._add_workspace`) of ``donor``'s, component by component, instead of
    allocating their own: a network of identical blocks that run one after another (an
    INFERENCE stack of decoder blocks) then holds one set of activation buffers, not one per
    block, and its memory stats count them once. Buffers registered otherwise (parameters,
    a KV cache) stay the receiver's own.

    Args:
        donor: a built component.
        receiver: an unbuilt component of the same structure (classes and child names).
        keep: dotted paths, relative to ``receiver``, of parts (and their subtrees) that
            allocate their own workspace all the same.

    Raises:
        RuntimeError: ``donor`` is not built.
        ValueError: the two trees differ, or ``keep`` names no part of ``receiver``.
    """
    if not donor.is_built:
        raise RuntimeError(f"share_workspace: the donor {donor._describe()} is not built")
    pairs: list[tuple[Component, Component]] = []
    kept: set[str] = set()

    def pair(given: Component, taker: Component, path: str) -> None:
        if type(given) is not type(taker) or (path and given.name != taker.name):
            raise ValueError(
                f"share_workspace: {taker._describe()} ({path or 'the receiver'}) does not match "
                f"{given._describe()} of the donor; the two trees must have one structure"
            )
        if path in keep:
            kept.add(path)
            return
        given_children, taker_children = given._children(), taker._children()
        if len(given_children) != len(taker_children):
            raise ValueError(
                f"share_workspace: {taker._describe()} has {len(taker_children)} children, the "
                f"donor's {given._describe()} {len(given_children)}"
            )
        pairs.append((given, taker))
        for a, b in zip(given_children, taker_children, strict=True):
            pair(a, b, f"{path}.{b.name}" if path else b.name)

    pair(donor, receiver, "")
    unknown = sorted(set(keep) - kept)
    if unknown:
        raise ValueError(
            f"share_workspace: keep names no part of {receiver._describe()}: {unknown}"
        )
    try:
        for given, taker in pairs:
            taker._workspace_donor = given
        yield
    finally:  # the receivers hold their buffers now; a later build allocates again
        for _, taker in pairs:
            taker.__dict__.pop("_workspace_donor", None)


def _restore(snapshot: list[tuple[Any, dict[str, Any]]]) -> None:
    """Put back the ``__dict__`` contents saved by :meth:`Component._snapshot`."""
    for obj, saved in snapshot:
        obj.__dict__.clear()
        obj.__dict__.update(saved)
