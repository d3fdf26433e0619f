"""Residual: the skip connection ``y = x + scale * f`` of two ``[B, T, dim]`` inputs (Mila's
Residual, in its binary form: the block that computes ``f`` from ``x`` stays outside it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_finite, check_sizes

__all__ = ["Residual", "ResidualConfig"]


@dataclass(frozen=True)
class ResidualConfig:
    """Configuration of a :class:`Residual`.

    Args:
        dim: width of the last axis.
        scale: the factor of the branch ``f`` (1.0: the plain residual of a transformer block).

    Raises:
        TypeError: a non-int ``dim`` or a non-number ``scale``.
        ValueError: ``dim <= 0`` or a ``scale`` that is not finite.
    """

    dim: int
    scale: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "dim")
        check_finite(self, "scale")


class Residual(Layer):
    """``y = x + scale * f``: the skip connection around a block ``f = F(x)``.

    No parameters. Every build owns ``output [B, T, dim]``; TRAINING builds with ``scale != 1``
    own ``dbranch`` too (with ``scale == 1`` the branch's gradient is ``dy`` itself).

    Args:
        name: component name.
        config: a :class:`ResidualConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: FP32, BF16 or FP16 (FP64 on the CPU).
    """

    _OP_NAME = "ResidualOp"
    _CONFIG_TYPE = ResidualConfig
    config: ResidualConfig

    def _on_building(self, build_context: BuildContext) -> None:
        dim = self.config.dim
        lead = self._build_lead(build_context, dim, "[B, T, dim]")
        self._add_workspace("output", (*lead, dim))
        self._max_lead = lead
        if build_context.is_training and self.config.scale != 1:
            self._add_workspace("dbranch", (*lead, dim))

    def forward(self, x: Any, f: Any) -> Any:
        """``x + scale * f``.

        Args:
            x: ``[B', T', dim]`` (within the build shape), the skip path.
            f: the branch, the same shape as ``x``.

        Returns:
            ``[B', T', dim]``: a view of the component-owned output buffer, overwritten by the
            next forward.

        Raises:
            TypeError: an input that is not an array of this device and precision.
            ValueError: a wrong width, shapes that differ, or more than the build shape.
            RuntimeError: before build.
        """
        self._require_built("forward()")
        self._check_floats(x, "x", self.config.dim)
        self._check_floats(f, "f", self.config.dim)
        if tuple(f.shape) != tuple(x.shape):
            raise ValueError(
                f"{self._describe()}: x {tuple(x.shape)} and f {tuple(f.shape)} must have one shape"
            )
        return self._forward(x, f)

    def _forward(self, x: Any, f: Any) -> Any:
        """:meth:`forward` without the checks, for a parent passing buffers it owns."""
        y = self._view("output", tuple(x.shape))
        self._op.forward(x, f, y)
        if self._build_context.is_training:  # type: ignore[union-attr]
            self._saved = tuple(x.shape)
        return y

    def _bind_forward(self, x: Any, f: Any) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that compute :meth:`forward` of the buffers ``x`` and ``f``
        (their values at call time) into the output view ``y``, for a decode plan."""
        y = self._view("output", tuple(x.shape))
        return [self._op.bind_forward(x, f, y)], y

    def backward(self, dy: Any) -> tuple[Any, Any]:
        """``dy -> (dx, df)``: ``dx`` is ``dy`` itself, ``df`` is ``scale * dy`` (``dy`` itself
        when ``scale == 1``, else a view of the component-owned ``dbranch`` buffer).

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError, ValueError: ``dy`` does not match the last forward's output.
        """
        self._require_backward()
        self._check_grad(dy, "dy", self._saved)
        df = self._view("dbranch", self._saved) if self.config.scale != 1 else None
        return dy, self._op.backward(dy, df)

    def _extra_repr(self) -> str:
        return f"dim={self.config.dim}, scale={self.config.scale:g}"
