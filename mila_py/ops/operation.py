"""Operation base class and the protocol for ops that take explicit positions."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from mila_py.build_context import BuildContext
from mila_py.devices.execution_context import ExecutionContext
from mila_py.precision import Precision

__all__ = ["Operation", "PositionalPairedOp"]


class Operation:
    """A device-specific computation behind a component.

    Ops hold no parameters (components own them) but may own state such as tables or scratch
    buffers; they report it through :meth:`state_arrays`, allocated through the execution context.

    Args:
        context: the execution context the op runs on.
        config: the component's config.
        precision: storage precision of the arrays the op receives.
    """

    def __init__(self, context: ExecutionContext, config: Any, precision: Precision) -> None:
        self.context = context
        self.config = config
        self.precision = precision
        self.build_context: BuildContext | None = None

    def build(self, build_context: BuildContext) -> None:
        """Allocate whatever state the op needs for ``build_context``."""
        self.build_context = build_context

    def state_arrays(self) -> list[Any]:
        """Arrays of state this op owns or shares (counted once each in memory stats)."""
        return []

    def state_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state_arrays())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.context.device_id}, {self.precision})"


@runtime_checkable
class PositionalPairedOp(Protocol):
    """An op over a pair of tensors (Q, K) that can be told absolute positions."""

    def prefill(self, q: Any, k: Any, position_offset: int) -> None: ...

    def decode(self, q: Any, k: Any, position: Any) -> None: ...
