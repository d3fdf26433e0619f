"""CompositeComponent (ordered, named children) and Network (the root that owns its context)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mila_py.build_context import BuildContext, TrainingMode
from mila_py.component import Component, _restore
from mila_py.devices import DeviceLike
from mila_py.precision import Precision
from mila_py.run_lock import RunLock

__all__ = ["CompositeComponent", "Network"]


class CompositeComponent(Component):
    """A component made of named children, kept in insertion order.

    The composite hands its execution context to every child (children added later get it on
    ``add_component``), propagates training-mode switches, and aggregates parameters, gradients
    and memory statistics (shared arrays counted once). By default ``build`` builds every child
    with the composite's own BuildContext; subclasses override ``_on_building`` to give children
    the contexts they need.
    """

    def __init__(
        self,
        name: str,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        self._components: dict[str, Component] = {}
        self._fixed_children = False

    def _fix_children(self) -> None:
        """Close the set of children (composites whose build knows each child by name: an
        attention's projections, a block's parts); later adds and removals are refused."""
        self._fixed_children = True

    def _check_open(self, what: str) -> None:
        if self.is_built:
            raise RuntimeError(f"{self._describe()} is built; children can only be {what} before")
        if self._fixed_children:
            raise RuntimeError(
                f"{self._describe()} has a fixed set of children {list(self._components)}; "
                f"none can be {what}"
            )

    # ------------------------------------------------------------------ children
    def add_component(self, child: Component) -> CompositeComponent:
        """Append ``child``; returns ``self`` so calls chain.

        Raises:
            TypeError: ``child`` is not a Component.
            RuntimeError: the composite is built or has a fixed set of children, the child
                already belongs to a composite, or it already has an execution context (a
                standalone component cannot join a tree).
            ValueError: a child of that name exists.
        """
        if not isinstance(child, Component):
            raise TypeError(f"{self._describe()}: add_component() needs a Component, got {child!r}")
        self._check_open("added")
        if child.name in self._components:
            raise ValueError(f"{self._describe()} already has a child named '{child.name}'")
        if child._parent is not None:
            raise RuntimeError(
                f"{child._describe()} already belongs to {child._parent._describe()}; remove it "
                "there first (remove_component)"
            )
        if child.has_execution_context:
            raise RuntimeError(
                f"{child._describe()} already has an execution context ({child.device_id}); "
                "construct children without device= and let the parent provide it"
            )
        if child is self or any(c is self for c in child._walk()):
            raise ValueError(f"{self._describe()}: adding '{child.name}' would create a cycle")
        if self.has_execution_context:
            child.set_execution_context(self.execution_context)
        self._components[child.name] = child
        child._parent = self
        return self

    def get_component(self, name: str) -> Component:
        """The direct child called ``name``.

        Raises:
            KeyError: with the names that exist.
        """
        try:
            return self._components[name]
        except KeyError:
            raise KeyError(
                f"{self._describe()} has no child '{name}'; children: {list(self._components)}"
            ) from None

    def find_component(self, path: str) -> Component:
        """A descendant by dotted path, e.g. ``"layers.0.attn"``.

        Names may contain dots themselves: every child name the path starts with (followed by
        a dot, or ending there) is tried, the longest first.

        Raises:
            KeyError: naming the first missing step.
        """
        if not isinstance(path, str):
            raise TypeError(f"{self._describe()}: find_component needs a str path, got {path!r}")
        found, reached, at = _resolve(self, path)
        if found is None:
            rest = path[len(reached) + 1 :] if reached else path
            children = list(at._components) if isinstance(at, CompositeComponent) else []
            where = f"'{reached}' ({at._describe()})" if reached else "it"
            raise KeyError(
                f"{self._describe()} has no descendant '{path}': {where} has no '{rest}' "
                f"(its children: {children})"
            )
        return found

    def has_component(self, name: str) -> bool:
        return name in self._components

    def remove_component(self, name: str) -> Component:
        """Remove and return the child ``name`` (before build only). Unless it was built on its
        own, it leaves without the tree's execution context and can join another tree.

        Raises:
            RuntimeError: after build, or on a composite with a fixed set of children.
            KeyError: no such child.
        """
        self._check_open("removed")
        child = self.get_component(name)
        _release_all([child])  # free to join another tree
        del self._components[name]
        child._parent = None
        return child

    def clear_components(self) -> None:
        """Remove every child (before build only); each can join another tree. A child whose
        release raises leaves every child in place, as it was."""
        self._check_open("removed")
        children = list(self._components.values())
        _release_all(children)
        self._components.clear()
        for child in children:
            child._parent = None

    @property
    def components(self) -> dict[str, Component]:
        """A copy of the children, in order."""
        return dict(self._components)

    def __len__(self) -> int:
        return len(self._components)

    def __iter__(self) -> Any:
        return iter(self._components.values())

    def _children(self) -> list[Component]:
        return list(self._components.values())

    # ------------------------------------------------------------------ hooks
    def _on_execution_context_set(self) -> None:
        # a child that raises leaves every node as it was: set_execution_context restores the
        # whole subtree from its snapshot
        for child in self._components.values():
            child.set_execution_context(self.execution_context)

    def _on_building(self, build_context: BuildContext) -> None:
        for child in self._components.values():
            child.build(build_context)

    def _on_training_mode_changing(self, mode: TrainingMode) -> None:
        # every node below, with its own mode: a failed switch puts each back exactly (a
        # grandchild switched on its own keeps its mode)
        before = [(node, node._training_mode) for node in self._walk()][1:]
        try:
            for child in self._components.values():
                child.set_training_mode(mode)
        except BaseException:
            # top-down: a composite with a hook of its own runs it (which propagates); any
            # node below that had a mode of its own is then put back by its own turn
            for node, previous in before:
                if previous is None or node._training_mode is previous:
                    continue
                if not node._children() or _has_own_mode_hook(node):
                    node._on_training_mode_changing(previous)
                node._training_mode = previous
            raise

    def _extra_repr(self) -> str:
        return f"{len(self._components)} children"


class Network(CompositeComponent):
    """The root of a component tree; it creates and owns the execution context for ``device``.

    Parameter names are relative to the network (``"block.linear.weight"``), like PyTorch.

    The network owns the :class:`~mila_py.run_lock.RunLock` that its stateful calls hold
    (:attr:`run_lock`): calls on one network from several threads run one at a time.

    A network whose backward runs a stack of blocks (a Llama's decoder blocks, last first)
    calls each of :attr:`block_backward_hooks` with the block after that block's backward:
    every parameter gradient of the block, and of the parts after it in parameter order, is
    then final for that backward. Data parallelism starts averaging those gradients there,
    while the earlier blocks still run (:class:`mila_py.distributed.GradientAllReduce`).
    """

    def __init__(
        self,
        name: str,
        *,
        device: DeviceLike = "CPU",
        precision: Precision = Precision.FP32,
    ) -> None:
        if device is None:
            raise ValueError(f"Network '{name}' needs a device, e.g. device='CPU' or 'CUDA:0'")
        super().__init__(name, device=device, precision=precision)
        self._run_lock = RunLock(self._describe())
        #: ``hook(block)`` after each block's backward (see the class docstring)
        self.block_backward_hooks: list[Callable[[Component], None]] = []

    @property
    def run_lock(self) -> RunLock:
        """The lock the network's stateful calls hold; ``with network.run_lock:`` makes a
        sequence of calls (a forward and its backward) run with no other thread's in between."""
        return self._run_lock


def _has_own_mode_hook(node: Component) -> bool:
    """Whether a composite's class adds to the hook that only propagates the mode."""
    hook = type(node)._on_training_mode_changing
    return hook is not CompositeComponent._on_training_mode_changing


def _release_all(children: list[Component]) -> None:
    """Release the execution context of each subtree; if a release hook raises, every subtree
    is put back as it was (context, ops and all) before the error propagates."""
    snapshots = [child._snapshot() for child in children]
    try:
        for child in children:
            child._release_context()
    except BaseException:
        for snapshot in snapshots:
            _restore(snapshot)
        raise


def _resolve(node: Component, path: str) -> tuple[Component | None, str, Component]:
    """``(the descendant of node at path or None, the longest leading part of path that names
    a descendant, that descendant)``; child names with dots are tried longest first."""
    best: tuple[str, Component] = ("", node)
    if not isinstance(node, CompositeComponent):
        return None, *best
    names = [n for n in node._components if path == n or path.startswith(n + ".")]
    for name in sorted(names, key=len, reverse=True):
        child = node._components[name]
        if path == name:
            return child, name, child
        found, below, at = _resolve(child, path[len(name) + 1 :])
        if found is not None:
            return found, path, found
        reached = f"{name}.{below}" if below else name
        if len(reached) > len(best[0]):
            best = (reached, at)
    return None, *best
