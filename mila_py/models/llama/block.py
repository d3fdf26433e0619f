"""LlamaBlock: the pre-norm decoder block (attention and SwiGLU, each behind an RMSNorm and a
residual sum)."""

from __future__ import annotations

from typing import Any

from mila_py.build_context import BuildContext
from mila_py.components._layer import is_int
from mila_py.components.attention import GroupedQueryAttention, check_chunk, check_seq_len
from mila_py.components.residual import Residual, ResidualConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.swiglu import SwiGLU, SwiGLUConfig
from mila_py.composite import CompositeComponent
from mila_py.devices import DeviceLike
from mila_py.models.llama.config import LlamaConfig
from mila_py.ops.operation import DecodePositions
from mila_py.precision import Precision

__all__ = ["LlamaBlock", "tokens_per_pass"]


def tokens_per_pass(build_context: BuildContext) -> int:
    """Tokens per pass: T for TRAINING; the prefill size (0 = all of T) for INFERENCE."""
    n_t = build_context.input_shape[1]
    if build_context.is_inference and build_context.prefill_size:
        return min(n_t, build_context.prefill_size)
    return n_t


class LlamaBlock(CompositeComponent):
    """Pre-norm decoder block: ``h = x + attn(norm1(x))``, ``y = h + mlp(norm2(h))``, the two
    sums its :class:`Residual` children (``attn_residual``, ``mlp_residual``).

    Its parts register their activations and scratch as workspace
    (:meth:`~mila_py.component.Component._add_workspace`): a network whose blocks run one at a
    time builds every block after the first on the first one's buffers
    (:func:`~mila_py.component.share_workspace`), so only the parameters and the KV cache are
    per layer (see :meth:`Llama._build_blocks <mila_py.models.llama.network.Llama>`). The
    block may then write its output into the buffer its input came from: ``x`` is read for
    the last time by ``attn_residual``, before ``mlp_residual`` writes ``y``.
    """

    def __init__(
        self,
        name: str,
        config: LlamaConfig,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        self.config = config
        self.input_layernorm = RmsNorm(
            "input_layernorm", RmsNormConfig(config.dim, config.norm_eps), precision=precision
        )
        self.self_attn = GroupedQueryAttention(
            "self_attn", config.attention_config(), precision=precision
        )
        self.post_attention_layernorm = RmsNorm(
            "post_attention_layernorm",
            RmsNormConfig(config.dim, config.norm_eps),
            precision=precision,
        )
        self.mlp = SwiGLU(
            "mlp", SwiGLUConfig(config.dim, config.hidden_dim, config.mlp_bias), precision=precision
        )
        self.attn_residual = Residual(
            "attn_residual", ResidualConfig(config.dim), precision=precision
        )
        self.mlp_residual = Residual(
            "mlp_residual", ResidualConfig(config.dim), precision=precision
        )
        for child in (
            self.input_layernorm,
            self.self_attn,
            self.attn_residual,
            self.post_attention_layernorm,
            self.mlp,
            self.mlp_residual,
        ):
            self.add_component(child)
        self._fix_children()

    def _on_building(self, build_context: BuildContext) -> None:
        shape = build_context.input_shape
        if len(shape) != 3 or shape[2] != self.config.dim:
            raise ValueError(
                f"{self._describe()}: build shape must be [B, T, dim={self.config.dim}], got {shape}"
            )
        chunk = tokens_per_pass(build_context)
        act = build_context.with_shape((shape[0], chunk, shape[2]))
        self.input_layernorm.build(act)
        self.self_attn.build(build_context)  # the whole context: its KV cache
        self.attn_residual.build(act)
        self.post_attention_layernorm.build(act)
        self.mlp.build(act)
        self.mlp_residual.build(act)
        if build_context.is_training:
            self._add_workspace("dhidden", shape)
            self._add_workspace("dinput", shape)

    def forward(self, x: Any, position_offset: int = 0, *, seq_len: int | None = None) -> Any:
        """``x [B, T, dim] -> [B, T, dim]`` (a view of the block's output buffer).

        On INFERENCE builds ``x`` is a prefill chunk at ``position_offset``; ``seq_len`` is the
        end of the whole prompt it belongs to, for RoPE's length-dependent scaling (default:
        the chunk's end; see :meth:`Rope.prefill`).

        Raises:
            TypeError, ValueError: ``x`` is not a float array ``[B', T', dim]`` of this device
                within the build (``T' >= 1``), or it overlaps a buffer of this block (the
                block's own output given back: pass a copy). Nothing is written then.
        """
        check_chunk(self, x)
        if seq_len is not None and is_int(position_offset):  # before the norm writes
            end = position_offset + x.shape[1]
            check_seq_len(self, seq_len, end, self.self_attn.context_length)
        return self._forward(x, position_offset, seq_len)

    def _forward(self, x: Any, position_offset: int, seq_len: int | None = None) -> Any:
        """:meth:`forward` for a parent passing a buffer it owns (no overlap check); a chunked
        prefill passes the end of its whole prompt as ``seq_len`` (RoPE's length-dependent
        scaling)."""
        return self._run(x, lambda a: self.self_attn.forward(a, position_offset, seq_len=seq_len))

    def decode(self, x: Any, positions: Any) -> Any:
        """One token per sequence, ``x [B, 1, dim]`` at ``positions`` (INFERENCE builds)."""
        check_chunk(self, x)
        return self._decode(x, positions)

    def _decode(self, x: Any, positions: Any) -> Any:
        """:meth:`decode` for a parent passing a buffer it owns (no overlap check)."""
        return self._run(x, lambda a: self.self_attn.decode(a, positions))

    def _bind_decode(
        self, x: Any, positions: DecodePositions, scores: Any
    ) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that run :meth:`decode` of the buffer ``x [B, 1, dim]`` (its
        values at call time) at ``positions`` (read at call time, checked by the caller) into
        ``y``, for a decode plan of an INFERENCE build. ``scores``: the CPU attention's scratch,
        ``>= n_heads * context`` elements."""
        norm_steps, normed = self.input_layernorm._bind_forward(x)
        attn_steps, attended = self.self_attn._bind_decode(normed, positions, scores)
        skip_steps, h = self.attn_residual._bind_forward(x, attended)
        post_steps, post = self.post_attention_layernorm._bind_forward(h)
        mlp_steps, mlp_out = self.mlp._bind_forward(post)
        out_steps, out = self.mlp_residual._bind_forward(h, mlp_out)
        steps = [*norm_steps, *attn_steps, *skip_steps, *post_steps, *mlp_steps, *out_steps]
        return steps, out

    def _run(self, x: Any, attend: Any) -> Any:
        attended = attend(self.input_layernorm.forward(x))  # the one check of x
        # x, h and the children's outputs are checked or owned: the children skip their checks
        h = self.attn_residual._forward(x, attended)
        return self.mlp_residual._forward(
            h, self.mlp._forward(self.post_attention_layernorm._forward(h))
        )

    def backward(self, dy: Any) -> Any:
        """``dy [B, T, dim] -> dx [B, T, dim]``; accumulates every parameter gradient."""
        if not self.is_built or not self.build_context.is_training:
            raise RuntimeError(f"{self._describe()}: backward() needs a TRAINING build")
        xp = self.execution_context.xp
        skip, branch = self.mlp_residual.backward(dy)  # the one check of dy
        n_b, n_t = dy.shape[0], dy.shape[1]
        dh = self._state["dhidden"][:n_b, :n_t]
        xp.add(skip, self.post_attention_layernorm.backward(self.mlp.backward(branch)), out=dh)
        dx = self._state["dinput"][:n_b, :n_t]
        skip, branch = self.attn_residual.backward(dh)
        xp.add(skip, self.input_layernorm.backward(self.self_attn.backward(branch)), out=dx)
        return dx
