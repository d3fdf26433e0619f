"""RmsNorm: root-mean-square normalization with a learned scale (Hugging Face LlamaRMSNorm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_finite, check_sizes

__all__ = ["RmsNorm", "RmsNormConfig"]


@dataclass(frozen=True)
class RmsNormConfig:
    """Configuration of an :class:`RmsNorm` layer.

    Args:
        dim: width of the normalized (last) axis.
        eps: added to the mean square before the square root (HF ``rms_norm_eps``).

    Raises:
        TypeError: a non-int ``dim`` or a non-number ``eps``.
        ValueError: ``dim <= 0``, or ``eps`` not finite and > 0.
    """

    dim: int
    eps: float = 1e-5

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "dim")
        check_finite(self, "eps", positive=True)


class RmsNorm(Layer):
    """``y = x / sqrt(mean(x^2, -1) + eps) * weight`` over the last axis.

    Parameter: ``weight [dim]``, initialized to ones (when the build initializes parameters).
    The arithmetic is float32, in Hugging Face's order (normalize, then scale).

    The build shape is the input's, ``[B, T, dim]`` (any number of leading dimensions); calls may
    use smaller leading dimensions. Every build owns ``rstd [B, T]`` (float32, the reciprocal RMS
    of each row, kept for backward); TRAINING builds own ``dinput``.

    Args:
        name: component name.
        config: an :class:`RmsNormConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: FP32, BF16 or FP16 (FP64 on the CPU); the statistics are FP32.
    """

    _OP_NAME = "RmsNormOp"
    _CONFIG_TYPE = RmsNormConfig
    config: RmsNormConfig

    def _on_building(self, build_context: BuildContext) -> None:
        dim = self.config.dim
        lead = self._build_lead(build_context, dim, "[B, T, dim]")
        weight = self._add_parameter("weight", self._allocate((dim,)))
        if build_context.should_initialize_parameters:
            weight.fill(1)
        self._add_workspace("output", (*lead, dim))
        # float32 at least: the statistics are computed in float32 whatever the storage precision
        self._add_workspace("rstd", lead, np.promote_types(self._dtype, np.float32))
        if build_context.is_training:
            self._add_workspace("dinput", (*lead, dim))
        self._max_lead = lead

    @property
    def weight(self) -> Any:
        """``[dim]`` (after build)."""
        self._require_built("weight")
        return self._parameters["weight"]

    def forward(self, x: Any) -> Any:
        """Normalize each row of ``x``.

        Args:
            x: ``[B', T', dim]`` with ``B' <= B``, ``T' <= T`` of the build shape. On TRAINING
                builds it is kept (not copied) for :meth:`backward`: do not modify it.

        Returns:
            ``[B', T', dim]``: a view of the component-owned output buffer, overwritten by the
            next forward.

        Raises:
            TypeError: ``x`` is not an array of this device and precision.
            ValueError: ``x`` has the wrong width or exceeds the build shape.
            RuntimeError: before build.
        """
        self._require_built("forward()")
        self._check_floats(x, "x", self.config.dim)
        return self._forward(x)

    def _forward(self, x: Any) -> Any:
        """:meth:`forward` without the input checks, for a parent passing a buffer it owns (or
        one it has checked): this device and dtype, ``[*lead, dim]`` within the build."""
        shape = x.shape
        y = self._view("output", shape)
        self._op.forward(x, self._parameters["weight"], y, self._view("rstd", shape[:-1]))
        if self._build_context.is_training:  # type: ignore[union-attr]
            self._saved = x
        return y

    def _bind_forward(self, x: Any) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that compute :meth:`forward` of the buffer ``x`` (its values
        at call time) into the output view ``y``, for a decode plan (INFERENCE builds)."""
        y = self._view("output", x.shape)
        rstd = self._view("rstd", x.shape[:-1])
        return [self._op.bind_forward(x, self._parameters["weight"], y, rstd)], y

    def backward(self, dy: Any) -> Any:
        """Accumulate ``dweight``; return ``dx``.

        Args:
            dy: ``[B', T', dim]``, the gradient of the last forward's output.

        Returns:
            ``[B', T', dim]``: a view of the component-owned ``dinput`` buffer, overwritten by the
            next backward.

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError, ValueError: ``dy`` does not match the last forward's output.
        """
        self._require_backward()
        x = self._saved
        self._check_grad(dy, "dy", tuple(x.shape))
        dx = self._view("dinput", tuple(x.shape))
        rstd = self._view("rstd", tuple(x.shape[:-1]))
        self._op.backward(x, self._parameters["weight"], rstd, dy, self._gradients["weight"], dx)
        return dx

    def _extra_repr(self) -> str:
        return f"dim={self.config.dim}, eps={self.config.eps:g}"
