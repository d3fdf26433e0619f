"""SwiGLU: the gated feed-forward block of Llama, ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mila_py.build_context import BuildContext
from mila_py.components._layer import Layer, check_sizes, is_bool, leading_view
from mila_py.components.linear import Linear, LinearConfig, transposes
from mila_py.composite import CompositeComponent
from mila_py.devices import DeviceLike, DeviceType
from mila_py.init import init_name, set_init_name
from mila_py.precision import Precision

__all__ = ["SwiGLU", "SwiGLUConfig"]


@dataclass(frozen=True)
class SwiGLUConfig:
    """Configuration of a :class:`SwiGLU` block.

    Args:
        dim: width of the input and output (HF ``hidden_size``).
        hidden_dim: width of the gated hidden layer (HF ``intermediate_size``).
        bias: biases on the three projections (HF Llama's ``mlp_bias``).

    Raises:
        TypeError: a non-int size, or a non-bool ``bias``.
        ValueError: a size that is not positive.
    """

    dim: int
    hidden_dim: int
    bias: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction)."""
        check_sizes(self, "dim", "hidden_dim")
        if not is_bool(self.bias):
            raise TypeError(f"SwiGLUConfig: bias must be a bool, got {self.bias!r}")


class SwiGLU(Layer, CompositeComponent):
    """``y = down_proj(silu(gate_proj(x)) * up_proj(x))``, three :class:`Linear` children (with
    biases when ``config.bias``) named as in Hugging Face Llama (``gate_proj``, ``up_proj``:
    ``[hidden_dim, dim]``; ``down_proj``: ``[dim, hidden_dim]``).

    The build shape is the input's, ``[B, T, dim]`` (any number of leading dimensions); calls may
    use smaller leading dimensions. The block owns ``hidden [B, T, hidden_dim]`` (the input of
    ``down_proj``, kept for backward); TRAINING builds also own ``dup [B, T, hidden_dim]`` and
    ``dinput [B, T, dim]``. Each child is seeded with ``"<this block's init name>.<child>"``
    (see :mod:`mila_py.init`: a network holding several SwiGLU blocks gives each its path with
    :func:`~mila_py.init.assign_init_names`, or all blocks start with the same weights).

    INFERENCE builds on the CPU without biases *pack* the two input projections: ``gate_proj``'s
    and ``up_proj``'s weights are the two halves of one ``[2 hidden_dim, dim]`` matrix (stored
    as ``[dim, 2 hidden_dim]`` rows when ``dim <= 2 hidden_dim``, the :class:`Linear` rule, and as
    ``[2 hidden_dim, dim]`` rows in 16-bit storage), and
    a decode step computes both with one matrix product into ``gate_up [B, 2 hidden_dim]`` (a
    state buffer of ``B`` rows, the build's first dimension). Names, shapes, values and the
    component calls are those of unpacked builds; one product instead of two is ~20% of a
    decode step of a ~10M Llama on 2 cores (CPU BLAS runs a product that large on both).

    Args:
        name: component name.
        config: a :class:`SwiGLUConfig`.
        device: ``"CPU"``, ... for a standalone component; None inside a Network.
        precision: FP32, BF16 or FP16 (FP64 on the CPU).
    """

    _OP_NAME = "SwiGLUOp"
    _CONFIG_TYPE = SwiGLUConfig
    config: SwiGLUConfig

    def __init__(
        self,
        name: str,
        config: SwiGLUConfig,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, config, device=device, precision=precision)
        into = LinearConfig(config.dim, config.hidden_dim, bias=config.bias)
        out_of = LinearConfig(config.hidden_dim, config.dim, bias=config.bias)
        self.gate_proj = Linear("gate_proj", into, precision=precision)
        self.up_proj = Linear("up_proj", into, precision=precision)
        self.down_proj = Linear("down_proj", out_of, precision=precision)
        for child in (self.gate_proj, self.up_proj, self.down_proj):
            self.add_component(child)
        self._fix_children()

    def _on_building(self, build_context: BuildContext) -> None:
        dim, hidden = self.config.dim, self.config.hidden_dim
        lead = self._build_lead(build_context, dim, "[B, T, dim]")
        for child in (self.gate_proj, self.up_proj, self.down_proj):
            set_init_name(child, f"{init_name(self)}.{child.name}")
        packs = self._packs(build_context)
        if packs:
            # the Linear layout rule for the packed [2 hidden, dim] matrix
            if transposes(self, dim, 2 * hidden):
                packed = self._allocate((dim, 2 * hidden)).T
            else:
                packed = self._allocate((2 * hidden, dim))
            self.gate_proj._packed_weight = packed[:hidden]
            self.up_proj._packed_weight = packed[hidden:]
        try:
            self.gate_proj.build(build_context)
            self.up_proj.build(build_context)
        finally:  # the children hold their views now; the next build decides again
            self.gate_proj._packed_weight = self.up_proj._packed_weight = None
        self.down_proj.build(build_context.with_shape((*lead, hidden)))
        self._add_workspace("hidden", (*lead, hidden))
        if packs:
            self._add_workspace("gate_up", (lead[0], 2 * hidden))
        if build_context.is_training:
            self._add_workspace("dup", (*lead, hidden))
            self._add_workspace("dinput", (*lead, dim))
        self._max_lead = lead

    def _packs(self, build_context: BuildContext) -> bool:
        """Whether a build packs ``gate_proj`` and ``up_proj`` (see the class docstring). Not on
        CUDA: cuBLAS reads only C- or F-contiguous weights in place, and the halves of the usual
        ``[dim, 2 hidden_dim]`` storage are neither (each prefill GEMM would copy its weight);
        the CUDA ops have no packed activation either."""
        return (
            build_context.is_inference
            and not self.config.bias
            and self.device_id.device_type is DeviceType.CPU
        )

    def _packed_weight(self) -> Any:
        """``[2 hidden_dim, dim]``: ``gate_proj``'s weight followed by ``up_proj``'s, one view of
        the buffer they share on a packed build; None when they are separate arrays."""
        gate, up = self.gate_proj._parameters["weight"], self.up_proj._parameters["weight"]
        if not (isinstance(gate, np.ndarray) and isinstance(up, np.ndarray)):
            return None
        step = gate.shape[0] * gate.strides[0]
        if (
            gate.base is None
            or gate.base is not up.base
            or gate.strides != up.strides
            or step == 0
            or up.ctypes.data != gate.ctypes.data + step
        ):
            return None
        return as_strided(gate, (2 * gate.shape[0], gate.shape[1]), gate.strides, writeable=False)

    def forward(self, x: Any) -> Any:
        """``down(silu(gate(x)) * up(x))``.

        Args:
            x: ``[B', T', dim]`` with ``B' <= B``, ``T' <= T`` of the build shape. On TRAINING
                builds it is kept (not copied) for :meth:`backward`: do not modify it.

        Returns:
            ``[B', T', dim]``: a view of ``down_proj``'s output buffer, overwritten by the next
            forward.

        Raises:
            TypeError: ``x`` is not an array of this device and precision.
            ValueError: ``x`` has the wrong width, exceeds the build shape or overlaps one of
                this block's buffers.
            RuntimeError: before build.
        """
        self._require_built("forward()")
        self._check_floats(x, "x", self.config.dim)
        self._refuse_own_state(x, "x")  # kept for backward: no child may overwrite it
        return self._forward(x)

    def _forward(self, x: Any) -> Any:
        """:meth:`forward` without the input checks, for a parent passing a buffer it owns (or
        one it has checked): this device and dtype, ``[*lead, dim]`` within the build. The
        projections get buffers this block checked or owns, so they skip their checks too."""
        gate = self.gate_proj._forward(x)
        up = self.up_proj._forward(x)
        hidden = self._view("hidden", (*x.shape[:-1], self.config.hidden_dim))
        self._op.forward(gate, up, hidden)
        if self._build_context.is_training:  # type: ignore[union-attr]
            self._saved = (x, gate, up)
        return self.down_proj._forward(hidden)

    def _bind_forward(self, x: Any) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that compute :meth:`forward` of the buffer ``x`` (its values
        at call time) into the output view ``y``, for a decode plan (INFERENCE builds). On a
        packed build, ``x`` of at most ``B`` rows takes one matrix product for gate and up."""
        hidden_dim = self.config.hidden_dim
        lead = tuple(x.shape[:-1])
        hidden = self._view("hidden", (*lead, hidden_dim))
        down_steps, y = self.down_proj._bind_forward(hidden)
        gate_up = self._state.get("gate_up")
        packed = None if gate_up is None else self._packed_weight()
        if packed is not None and math.prod(lead) <= gate_up.shape[0]:  # type: ignore[union-attr]
            both = leading_view(gate_up, (*lead, 2 * hidden_dim))
            product = self.gate_proj.op.bind_forward(x, packed, None, both)
            return [product, self._op.bind_forward_packed(both, hidden), *down_steps], y
        gate_steps, gate = self.gate_proj._bind_forward(x)
        up_steps, up = self.up_proj._bind_forward(x)
        return [*gate_steps, *up_steps, self._op.bind_forward(gate, up, hidden), *down_steps], y

    def backward(self, dy: Any) -> Any:
        """Accumulate the three weight gradients; return ``dx``.

        Args:
            dy: ``[B', T', dim]``, the gradient of the last forward's output.

        Returns:
            ``[B', T', dim]``: a view of the block-owned ``dinput`` buffer, overwritten by the
            next backward.

        Raises:
            RuntimeError: on INFERENCE builds, or before any forward.
            TypeError, ValueError: ``dy`` does not match the last forward's output.
        """
        self._require_backward()
        x, gate, up = self._saved
        self._check_grad(dy, "dy", tuple(x.shape))
        dh = self.down_proj.backward(dy)
        dup = self._view("dup", tuple(gate.shape))
        # dgate overwrites dh in place: dh is down_proj's dinput, recomputed by every backward,
        # so this saves a [B, T, hidden_dim] buffer and repeated backward calls stay exact.
        self._op.backward(gate, up, dh, dh, dup)
        dx_gate = self.gate_proj.backward(dh)
        dx_up = self.up_proj.backward(dup)
        dx = self._view("dinput", tuple(x.shape))
        self.execution_context.xp.add(dx_gate, dx_up, out=dx)
        return dx

    def _extra_repr(self) -> str:
        bias = ", bias=True" if self.config.bias else ""
        return f"dim={self.config.dim}, hidden_dim={self.config.hidden_dim}{bias}"
