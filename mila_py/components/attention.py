"""GroupedQueryAttention: causal multi-head attention with GQA and RoPE on a fused QKV projection."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.components._layer import check_device_array, check_sizes, is_int, leading_view
from mila_py.components.linear import Linear, LinearConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.rope import Rope
from mila_py.composite import CompositeComponent
from mila_py.devices import DeviceLike
from mila_py.ops.operation import DecodePositions
from mila_py.ops.registry import create_op
from mila_py.precision import Precision
from mila_py.rope.config import RopeConfig, RopeLayout

__all__ = ["AttentionConfig", "CachedLengths", "GroupedQueryAttention"]


@dataclass(frozen=True)
class AttentionConfig:
    """Configuration of causal grouped-query attention.

    Args:
        dim: model width (input and output features).
        n_heads: query heads; n_kv_heads: key/value heads (divides n_heads).
        max_seq_len: longest context (RoPE table size).
        head_dim: per-head width; default ``dim // n_heads``.
        rope_base, rope_scaling, rope_layout, rotary_dim: as in :class:`RopeConfig`.
        qkv_bias: a bias on the fused QKV projection (Qwen2; Llama's ``attention_bias``).
        out_bias: a bias on the output projection (Llama's ``attention_bias``).
        qk_norm: RMS-normalize each head of Q and K over ``head_dim`` before RoPE, with one
            learned weight per channel shared by the heads (Qwen3's ``q_norm``/``k_norm``).
        qk_norm_eps: that normalization's epsilon.
        rope_softmax_scale: multiply the softmax scale ``1/sqrt(head_dim)`` by
            :attr:`Rope.softmax_scale_multiplier` (DeepSeek's YaRN rule, ``mscale(factor,
            mscale_all_dim)**2``). Off by default: Llama, Qwen and Mistral fold YaRN's
            attention factor into cos/sin only, as Hugging Face does.
    """

    dim: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int
    head_dim: int | None = None
    rope_base: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rope_layout: str = "half"
    rotary_dim: int = 0
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    rope_softmax_scale: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_sizes(self, "dim", "n_heads", "n_kv_heads", "max_seq_len")
        if self.head_dim is not None:
            check_sizes(self, "head_dim")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"AttentionConfig: n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"AttentionConfig: dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given"
            )
        self.rope_config()  # validates the RoPE part

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def q_width(self) -> int:
        return self.n_heads * self.resolved_head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.resolved_head_dim

    def rope_config(self) -> RopeConfig:
        return RopeConfig(
            channels=self.q_width,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            max_seq_len=self.max_seq_len,
            base=self.rope_base,
            rotary_dim=self.rotary_dim,
            layout=RopeLayout(self.rope_layout),
            scaling=self.rope_scaling,
        )


def check_decode_positions(
    positions: Any, n_b: int, context: int, who: str, to_host: Any
) -> tuple[Any, int, int]:
    """Positions of a decode call of ``n_b`` sequences, checked against a ``context``-token KV
    cache: ``(an int, or [n_b] int64 on the host, lowest, highest)``.

    Raises:
        TypeError: not an int, nor 1 or ``n_b`` integers (``to_host`` brings device arrays over).
        ValueError: a position outside ``[0, context)``.
    """
    if is_int(positions):  # the common case: no array work
        lowest = highest = int(positions)
        checked: Any = lowest
    else:
        host = np.asarray(to_host(positions))
        if host.dtype.kind not in "iu" or host.size not in (1, n_b):
            raise TypeError(
                f"{who}: decode positions must be an int or {n_b} ints, got {host.dtype} of "
                f"shape {host.shape}"
            )
        checked = np.broadcast_to(host.astype(np.int64).reshape(-1), (n_b,))
        # an empty batch decodes nothing (its positions bound nothing)
        lowest, highest = (int(checked.min()), int(checked.max())) if n_b else (0, 0)
    if lowest < 0 or highest >= context:
        raise ValueError(
            f"{who}: decode positions must be in [0, {context}), got {lowest}..{highest}"
        )
    return checked, lowest, highest


class CachedLengths:
    """How many leading positions of each sequence's KV cache hold keys and values written
    since the last reset (host ints; a model's layers share one).

    A call may only continue what is cached: a prefill chunk or decode token at position ``p``
    of sequence ``b`` needs ``p <= lengths[b]``, since its query attends to every position
    before ``p`` (a larger ``p`` would read rows never written, silently). Afterwards the
    sequence holds ``0 .. p + T - 1``: whatever lay past that (a rewound turn) is dropped.
    """

    __slots__ = ("lengths",)

    def __init__(self, n_b: int) -> None:
        self.lengths = [0] * n_b

    def check(self, first: Any, n_b: int, who: str) -> None:
        """Refuse a call whose first position (an int, or host ints ``[n_b]``) of some sequence
        ``b < n_b`` lies past ``lengths[b]``."""
        if n_b > len(self.lengths):
            raise ValueError(f"{who}: {n_b} sequences; the KV cache holds {len(self.lengths)}")
        have = self.lengths[:n_b]
        if isinstance(first, int):
            if first <= min(have, default=first):  # (no sequences: nothing to continue)
                return
            wanted = [first] * n_b
        else:
            wanted = np.asarray(first).tolist()
        for b, (p, n) in enumerate(zip(wanted, have, strict=True)):
            if p > n:
                cached = f"positions 0..{n - 1}" if n else "no positions"
                raise ValueError(
                    f"{who}: sequence {b} has {cached} in its KV cache; position {p} would "
                    f"attend to {n}..{p - 1}, never written (continue from a position <= {n}, "
                    "or prefill from position 0)"
                )

    def mark(self, first: Any, count: int, n_b: int) -> None:
        """Sequences ``b < n_b`` now hold positions ``0 .. first[b] + count - 1``."""
        if isinstance(first, int):
            self.lengths[:n_b] = [first + count] * n_b
        else:
            self.lengths[:n_b] = (np.asarray(first) + count).tolist()

    def reset(self) -> None:
        self.lengths[:] = [0] * len(self.lengths)


def check_chunk(owner: Any, x: Any) -> None:
    """Refuse, before anything is written, an input ``x [B, T, dim]`` of ``owner`` (a block
    whose children keep or re-read ``x`` after writing their buffers) that is not a device
    array, has ``T == 0`` (no query to attend with), or overlaps one of ``owner``'s buffers."""
    check_device_array(owner, x, "x")
    if x.ndim == 3 and x.shape[1] == 0:
        raise ValueError(
            f"{owner._describe()}: x [B, T, dim] needs T >= 1, got shape {tuple(x.shape)}"
        )
    owner._refuse_own_state(x, "x")


def check_seq_len(owner: Any, seq_len: Any, end: int, limit: int) -> None:
    """Refuse, before anything is written, a prefill chunk's ``seq_len`` (the end of its
    whole prompt) that is not an int in ``end .. limit`` (the chunk's end, the context), or
    any on a TRAINING build (which runs from position 0 to its own length)."""
    if not owner.build_context.is_inference:
        raise ValueError(f"{owner._describe()}: seq_len is for INFERENCE prefill chunks")
    if not is_int(seq_len):
        raise TypeError(f"{owner._describe()}: seq_len must be an int, got {seq_len!r}")
    if not end <= seq_len <= limit:
        raise ValueError(
            f"{owner._describe()}: seq_len {seq_len} must cover the chunk (>= {end}) and fit "
            f"the context (<= {limit})"
        )


class GroupedQueryAttention(CompositeComponent):
    """Causal self-attention: ``o_proj(softmax(QK^T * scale + causal) V)`` with RoPE on Q and K.

    Children: ``qkv_proj`` (Linear ``dim -> (Hq + 2 Hk) * d``, one fused projection), ``rope``
    (rotates the Q and K views of the projection in place) and ``o_proj`` (``Hq * d -> dim``).
    With ``config.qk_norm`` also ``q_norm`` and ``k_norm`` (RmsNorm over ``d``, run on
    ``[B, T, H, d]`` views of Q and K): RoPE then rotates their output buffers instead.

    ``forward(x [B, T, dim]) -> [B, T, dim]``; ``backward(dy) -> dx`` on TRAINING builds.
    """

    def __init__(
        self,
        name: str,
        config: AttentionConfig,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"{name}: config must be an AttentionConfig, got {config!r}")
        self.config = config
        qkv_out = config.q_width + 2 * config.kv_width
        self.qkv_proj = Linear(
            "qkv_proj", LinearConfig(config.dim, qkv_out, bias=config.qkv_bias), precision=precision
        )
        self.q_norm: RmsNorm | None = None
        self.k_norm: RmsNorm | None = None
        if config.qk_norm:
            head_norm = RmsNormConfig(config.resolved_head_dim, config.qk_norm_eps)
            self.q_norm = RmsNorm("q_norm", head_norm, precision=precision)
            self.k_norm = RmsNorm("k_norm", head_norm, precision=precision)
        self.rope = Rope("rope", config.rope_config(), precision=precision)
        self.o_proj = Linear(
            "o_proj",
            LinearConfig(config.q_width, config.dim, bias=config.out_bias),
            precision=precision,
        )
        for child in (self.qkv_proj, self.q_norm, self.k_norm, self.rope, self.o_proj):
            if child is not None:
                self.add_component(child)
        self._fix_children()
        self._op: Any = None
        self._saved: tuple[Any, ...] | None = None
        self._cached: CachedLengths | None = None  # INFERENCE builds

    def _on_execution_context_set(self) -> None:
        super()._on_execution_context_set()
        self._op = create_op("AttentionOp", self.execution_context, self.config, self.precision)

    def _on_building(self, build_context: BuildContext) -> None:
        cfg = self.config
        shape = build_context.input_shape
        if len(shape) != 3 or shape[2] != cfg.dim:
            raise ValueError(
                f"{self._describe()}: build shape must be [B, T, dim={cfg.dim}], got {shape}"
            )
        n_b, n_t = shape[0], shape[1]
        if n_t > cfg.max_seq_len:
            raise ValueError(
                f"{self._describe()}: T = {n_t} exceeds max_seq_len = {cfg.max_seq_len}"
            )
        # INFERENCE: T is the context the KV cache holds; activations are sized for one
        # prefill chunk (prefill_size, or the whole context when 0).
        chunk = n_t
        if build_context.is_inference and build_context.prefill_size:
            chunk = min(n_t, build_context.prefill_size)
        self.qkv_proj.build(build_context.with_shape((n_b, chunk, cfg.dim)))
        d = cfg.resolved_head_dim
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.build(build_context.with_shape((n_b, chunk, cfg.n_heads, d)))
            self.k_norm.build(build_context.with_shape((n_b, chunk, cfg.n_kv_heads, d)))
        self.rope.build(build_context.with_shape((n_b, chunk, cfg.q_width)))
        self.o_proj.build(build_context.with_shape((n_b, chunk, cfg.q_width)))
        self._add_workspace("attn_out", (n_b, chunk, cfg.q_width))
        if build_context.is_inference:
            self._add_state("k_cache", self._allocate((n_b, n_t, cfg.kv_width)))
            self._add_state("v_cache", self._allocate((n_b, n_t, cfg.kv_width)))
        self._cached = CachedLengths(n_b) if build_context.is_inference else None
        if build_context.is_training:
            groups = cfg.n_heads // cfg.n_kv_heads
            # the softmax's probabilities in its compute dtype (float32 for 16-bit storage)
            probs = (n_b, cfg.n_kv_heads, groups, n_t, n_t)
            self._add_workspace("probs", probs, self.precision.compute_dtype)
            self._add_workspace("dqkv", (n_b, n_t, cfg.q_width + 2 * cfg.kv_width))
        self._saved = None

    @property
    def scale(self) -> float:
        """Softmax scale: ``1/sqrt(head_dim)``, times RoPE's softmax multiplier when the config's
        ``rope_softmax_scale`` asks for it (DeepSeek YaRN)."""
        base = 1.0 / math.sqrt(self.config.resolved_head_dim)
        if self.config.rope_softmax_scale:
            return self.rope.softmax_scale_multiplier * base
        return base

    def _split_qkv(self, qkv: Any) -> tuple[Any, Any, Any]:
        cfg = self.config
        q_end = cfg.q_width
        k_end = q_end + cfg.kv_width
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]

    def _heads(self, x: Any) -> Any:
        """``[B, T, H * d]`` -> ``[B, T, H, d]`` (a view: only the last axis splits)."""
        return x.reshape(*x.shape[:-1], -1, self.config.resolved_head_dim)

    def _normalized(self, q: Any, k: Any) -> tuple[Any, Any]:
        """Q and K as RoPE and attention take them: the projection's views, or with ``qk_norm``
        views ``[B, T, H * d]`` of the head norms' output buffers (the projection's Q and K stay
        as they are: the norms' backward reads them)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        q_n = self.q_norm._forward(self._heads(q))
        k_n = self.k_norm._forward(self._heads(k))
        return q_n.reshape(q.shape), k_n.reshape(k.shape)

    def _bind_normalized(self, q: Any, k: Any) -> tuple[list[Any], Any, Any]:
        """``(steps, q, k)``: :meth:`_normalized` bound for a decode plan."""
        if self.q_norm is None or self.k_norm is None:
            return [], q, k
        q_steps, q_n = self.q_norm._bind_forward(self._heads(q))
        k_steps, k_n = self.k_norm._bind_forward(self._heads(k))
        return [*q_steps, *k_steps], q_n.reshape(q.shape), k_n.reshape(k.shape)

    @property
    def context_length(self) -> int:
        """Tokens the KV cache holds (INFERENCE builds)."""
        return int(self._state["k_cache"].shape[1])

    @property
    def cached_lengths(self) -> tuple[int, ...]:
        """Positions ``0 .. n - 1`` each sequence of the build holds in the KV cache
        (INFERENCE builds; see :class:`CachedLengths`)."""
        if self._cached is None:
            raise RuntimeError(f"{self._describe()}: cached_lengths needs an INFERENCE build")
        return tuple(self._cached.lengths)

    def reset_cache(self) -> None:
        """Zero the KV cache (INFERENCE builds): every sequence then holds no position."""
        if self._cached is None:
            raise RuntimeError(f"{self._describe()}: reset_cache() needs an INFERENCE build")
        with self.execution_context.activate():  # this device's stream, after its other work
            self._state["k_cache"][...] = 0
            self._state["v_cache"][...] = 0
        self._cached.reset()

    def forward(self, x: Any, position_offset: int = 0, *, seq_len: int | None = None) -> Any:
        """``x [B, T, dim] -> [B, T, dim]`` (a view of ``o_proj``'s output buffer).

        TRAINING builds attend within ``x`` (positions ``0 .. T-1``). INFERENCE builds are a
        prefill chunk at positions ``position_offset .. position_offset + T - 1``: its keys and
        values are written to the KV cache and its queries attend to everything cached before.
        ``seq_len`` (INFERENCE): the end of the whole prompt the chunk belongs to, for RoPE's
        length-dependent scaling (see :meth:`Rope.prefill`); default the chunk's end.
        """
        if not self.is_built:
            raise RuntimeError(f"{self._describe()}: forward() needs a built component")
        check_chunk(self, x)
        if not is_int(position_offset):
            raise TypeError(
                f"{self._describe()}: position_offset must be an int, got {position_offset!r}"
            )
        inference = self.build_context.is_inference
        # the positions first: a call that raises writes nothing (the projection's buffers
        # hold what the next backward reads)
        n_t = x.shape[1] if getattr(x, "ndim", 0) == 3 else 0
        end = position_offset + n_t
        if inference and (position_offset < 0 or end > self.context_length):
            raise ValueError(
                f"{self._describe()}: positions {position_offset}..{end - 1} do not fit the "
                f"KV cache of {self.context_length} tokens"
            )
        if not inference and position_offset:
            raise ValueError(f"{self._describe()}: TRAINING builds run from position 0")
        if seq_len is not None:
            check_seq_len(self, seq_len, end, self.context_length if inference else n_t)
        if inference and n_t:
            self._cached.check(position_offset, x.shape[0], self._describe())  # type: ignore[union-attr]
        with self.execution_context.activate():  # cache writes and views on this device's stream
            return self._forward_checked(x, position_offset, seq_len, n_t, end)

    def _forward_checked(
        self, x: Any, position_offset: int, seq_len: int | None, n_t: int, end: int
    ) -> Any:
        cfg = self.config
        inference = self.build_context.is_inference
        qkv = self.qkv_proj.forward(x)  # [B, T, (Hq + 2 Hk) d]
        q, k, v = self._split_qkv(qkv)
        q, k = self._normalized(q, k)
        n_b = x.shape[0]
        out = self._state["attn_out"][:n_b, :n_t]
        if inference:
            self.rope.prefill(q, k, position_offset, seq_len=seq_len)
            k_cache = self._state["k_cache"][:n_b]
            v_cache = self._state["v_cache"][:n_b]
            k_cache[:, position_offset:end] = k
            v_cache[:, position_offset:end] = v
            self._cached.mark(position_offset, n_t, n_b)  # type: ignore[union-attr]
            self._op.prefill(
                q,
                k_cache[:, :end],
                v_cache[:, :end],
                cfg.n_heads,
                cfg.n_kv_heads,
                self.scale,
                out,
                position_offset,
            )
            return self.o_proj._forward(out)  # its own buffer
        self.rope.forward(q, k)
        full = self._state["probs"]  # [B, Hk, g, T, T] of the build; a call's own leading part
        probs_buf = leading_view(full, (n_b, *full.shape[1:3], n_t, n_t))
        probs = self._op.forward(
            q, k, v, cfg.n_heads, cfg.n_kv_heads, self.scale, out=out, probs=probs_buf
        )
        self._saved = (q, k, v, probs, out)
        return self.o_proj._forward(out)  # its own buffer

    def decode(self, x: Any, positions: Any) -> Any:
        """One new token per sequence: ``x [B, 1, dim]`` at ``positions`` (int or ``[B]``).

        Each sequence attends to its own cached keys ``0 .. positions[b]`` (ragged batches).
        """
        if not self.is_built or not self.build_context.is_inference:
            raise RuntimeError(f"{self._describe()}: decode() needs an INFERENCE build")
        if getattr(x, "ndim", 0) != 3 or x.shape[1] != 1:
            raise ValueError(
                f"{self._describe()}: decode takes x [B, 1, dim], got "
                f"{getattr(x, 'shape', type(x).__name__)}"
            )
        n_b = x.shape[0]
        checked, lowest, highest = check_decode_positions(
            positions, n_b, self.context_length, self._describe(), self.execution_context.to_host
        )
        self._cached.check(checked, n_b, self._describe())  # type: ignore[union-attr]
        with self.execution_context.activate():  # cache writes on this device's stream
            return self._decode_checked(x, checked, lowest, highest)

    def _decode_checked(self, x: Any, checked: Any, lowest: int, highest: int) -> Any:
        cfg = self.config
        n_b = x.shape[0]
        pos = None if isinstance(checked, int) else checked
        qkv = self.qkv_proj.forward(x)  # checks the rest of x
        q, k, v = self._split_qkv(qkv)
        q, k = self._normalized(q, k)
        uniform = lowest == highest
        if uniform:  # checked above: 0 <= lowest < context_length <= max_seq_len
            self.rope._decode_at(q, k, lowest)
        else:
            self.rope.decode(q, k, pos)
        k_cache = self._state["k_cache"][:n_b]
        v_cache = self._state["v_cache"][:n_b]
        if uniform:  # one position for all: every cached key up to it is visible, no mask
            p = lowest
            k_cache[:, p] = k[:, 0]
            v_cache[:, p] = v[:, 0]
            end, visible = p + 1, None
        else:  # pos stays on the host (checks, RoPE); the device's copy indexes the cache
            assert pos is not None  # several positions came as an array
            xp = self.execution_context.xp
            pos_d = xp.asarray(pos)
            rows = xp.arange(n_b)
            k_cache[rows, pos_d] = k[:, 0]
            v_cache[rows, pos_d] = v[:, 0]
            end = highest + 1
            visible = pos + 1  # host ints: sequence b sees its keys 0 .. pos[b]
        self._cached.mark(checked, 1, n_b)  # type: ignore[union-attr]
        out = self._state["attn_out"][:n_b, :1]
        self._op.forward(
            q,
            k_cache[:, :end],
            v_cache[:, :end],
            cfg.n_heads,
            cfg.n_kv_heads,
            self.scale,
            out=out,
            causal=False,
            visible=visible,
        )
        return self.o_proj._forward(out)  # its own buffer

    def _bind_decode(
        self, x: Any, positions: DecodePositions, scores: Any
    ) -> tuple[list[Any], Any]:
        """``(steps, y)``: callables that run :meth:`decode` of the buffer ``x [B, 1, dim]`` (its
        values at call time) at ``positions`` (read at call time, checked by the caller) into
        ``y``, for a decode plan of an INFERENCE build. ``scores``: the CPU op's scratch of
        ``>= n_heads * context`` elements for the attention probabilities (None on CUDA)."""
        cfg = self.config
        n_b = x.shape[0]
        steps, qkv = self.qkv_proj._bind_forward(x)
        q, k, v = self._split_qkv(qkv)
        norm_steps, q, k = self._bind_normalized(q, k)
        k_cache = self._state["k_cache"][:n_b]
        v_cache = self._state["v_cache"][:n_b]
        write_cache = self._op.bind_cache_write(k[:, 0], v[:, 0], k_cache, v_cache, positions)
        out = leading_view(self._state["attn_out"], (n_b, 1, cfg.q_width))
        attend = self._op.bind_decode(
            q, k_cache, v_cache, cfg.n_heads, cfg.n_kv_heads, self.scale, out, positions, scores
        )
        o_steps, y = self.o_proj._bind_forward(out)
        rotate = self.rope._op.bind_decode(q, k, positions)
        return [*steps, *norm_steps, rotate, write_cache, attend, *o_steps], y

    def backward(self, dy: Any) -> Any:
        """``dy [B, T, dim] -> dx [B, T, dim]``; accumulates every child's parameter gradients."""
        if not self.is_built or not self.build_context.is_training:
            raise RuntimeError(f"{self._describe()}: backward() needs a TRAINING build")
        if self._saved is None:
            raise RuntimeError(f"{self._describe()}: backward() before forward()")
        cfg = self.config
        q, k, v, probs, out = self._saved
        d_attn = self.o_proj.backward(dy)  # [B, T, Hq d]
        n_b, n_t = q.shape[0], q.shape[1]
        dqkv = self._state["dqkv"][:n_b, :n_t]
        dq, dk, dv = self._split_qkv(dqkv)
        self._op.backward(
            d_attn, q, k, v, probs, cfg.n_heads, cfg.n_kv_heads, self.scale, dq, dk, dv, out=out
        )
        dq_in, dk_in = self.rope.backward(dq, dk)  # gradients before the rotation
        if self.q_norm is not None and self.k_norm is not None:  # ... and before the norms
            dq_in = self.q_norm.backward(self._heads(dq_in)).reshape(dq.shape)
            dk_in = self.k_norm.backward(self._heads(dk_in)).reshape(dk.shape)
        dq[...] = dq_in
        dk[...] = dk_in
        return self.qkv_proj.backward(dqkv)
