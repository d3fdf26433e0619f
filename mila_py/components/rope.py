"""Rope: rotary position embedding of Q and K, in place (Mila's ``Rope`` component).

The component owns no output buffers: it rotates the caller's Q and K (typically views of a
fused QKV projection) through the ``RopeOp`` of its device. TRAINING builds own the input-gradient
buffers ``dq_in``/``dk_in`` that :meth:`Rope.backward` fills. The cos/sin table is shared by every
Rope with the same configuration on a device (see :func:`get_rope`).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.component import Component
from mila_py.devices import DeviceLike
from mila_py.devices.overlap import arrays_overlap, same_view, self_overlaps
from mila_py.ops.operation import PositionalPairedOp
from mila_py.ops.registry import create_op, find_op
from mila_py.precision import Precision
from mila_py.rope.config import RopeConfig, RopeLayout

__all__ = ["Rope"]


class Rope(Component):
    """Rotary position embedding applied in place to Q ``[B, T, n_heads * head_dim]`` and K
    ``[B, T, n_kv_heads * head_dim]``.

    Args:
        name: component name.
        config: a :class:`RopeConfig`.
        device: ``"CPU"``, ``"CUDA:0"``, ... for a standalone component; None inside a Network.
        precision: dtype of Q and K (FP32, FP16 or BF16); arithmetic is FP32 with FP32 tables.

    The build shape is Q's: ``BuildContext((B, T, n_heads * head_dim), mode)``. Calls may use any
    ``B' <= B`` and ``T' <= T``.

    Every call validates before touching data: a call that raises leaves Q, K and the component
    unchanged.

    Q and K may also be another library's arrays on the component's device, such as torch
    tensors (CPU or CUDA, FP16 and BF16 included) or anything speaking DLPack or the CUDA array
    interface: they are rotated in place through a view of their memory, with no copy, and on
    a GPU the producer's stream is ordered after the kernel before the call returns.

    Length-dependent scaling (``dynamic``, ``longrope``) picks its frequencies from the largest
    position of each call, as Hugging Face does. With a KV cache this means keys cached while the
    context was short were rotated with other frequencies than later queries use: exact for a
    prefill of the whole context, approximate across the switch when decoding.
    """

    def __init__(
        self,
        name: str,
        config: RopeConfig,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if not isinstance(config, RopeConfig):
            raise TypeError(f"Rope '{name}': config must be a RopeConfig, got {config!r}")
        self.config = config
        self._op: Any = None
        self._dtype = precision.numpy_dtype
        self._q_width = config.channels
        self._k_width = config.kv_channels
        self._max_batch = 0
        self._max_tokens = 0

    # ------------------------------------------------------------------ lifecycle hooks
    def _on_execution_context_set(self) -> None:
        # the dtype arrays of this precision carry on the device (bfloat16's uint16 bits on a
        # CuPy without bfloat16, as DLPack imports of torch bf16 tensors arrive there)
        storage = getattr(self.execution_context, "storage_dtype", None)
        self._dtype = np.dtype(
            self.precision.numpy_dtype if storage is None else storage(self.precision.numpy_dtype)
        )
        find_op("RopeOp", self.execution_context.device_type, self.precision)
        op = create_op("RopeOp", self.execution_context, self.config, self.precision)
        if not isinstance(op, PositionalPairedOp):  # checked once, here (DESIGN §4)
            raise TypeError(
                f"{self._describe()}: the registered RopeOp {type(op).__name__} is not a "
                "PositionalPairedOp (it needs prefill(q, k, position_offset) and "
                "decode(q, k, position))"
            )
        self._op = op

    def _on_building(self, build_context: BuildContext) -> None:
        shape = build_context.input_shape
        if len(shape) != 3 or shape[2] != self._q_width:
            raise ValueError(
                f"{self._describe()}: build shape must be Q's [B, T, n_heads * head_dim = "
                f"{self._q_width}], got {shape}"
            )
        n_b, n_t = shape[0], shape[1]
        self._op.build(build_context)
        if build_context.is_training:
            self._add_workspace("dq_in", (n_b, n_t, self._q_width), gradient=True)
            self._add_workspace("dk_in", (n_b, n_t, self._k_width), gradient=True)
        self._max_batch, self._max_tokens = n_b, n_t

    # ------------------------------------------------------------------ properties
    @property
    def op(self) -> Any:
        """The device op (``op.backend`` selects the CPU path)."""
        return self._op

    @property
    def table(self) -> Any:
        """The shared cos/sin :class:`RopeTable` (after build)."""
        self._require_built("table")
        return self._op.table

    @property
    def input_gradients(self) -> tuple[Any, ...]:
        """``(dq_in, dk_in)`` full-size buffers on TRAINING builds (what backward fills), else ()."""
        grads = self._input_gradients
        return (grads["dq_in"], grads["dk_in"]) if grads else ()

    @property
    def attention_scaling(self) -> float:
        """The factor already folded into cos and sin (YaRN mscale, LongRoPE scaling)."""
        return self.table.attention_scaling

    @property
    def softmax_scale_multiplier(self) -> float:
        """Extra factor attention must apply to its softmax scale (DeepSeek YaRN), else 1.0."""
        return self.table.softmax_scale_multiplier

    # ------------------------------------------------------------------ run
    def forward(self, q: Any, k: Any) -> None:
        """Rotate Q and K in place at positions ``0 .. T-1``.

        Args:
            q: ``[B, T, n_heads * head_dim]``, rotated in place.
            k: ``[B, T, n_kv_heads * head_dim]``, rotated in place.
        """
        self.prefill(q, k, 0)

    def prefill(self, q: Any, k: Any, position_offset: int, *, seq_len: int | None = None) -> None:
        """Rotate Q and K in place at positions ``position_offset .. position_offset + T - 1``.

        Args:
            seq_len: the sequence length a length-dependent scaling (``dynamic``, LongRoPE)
                picks its frequencies for; default ``position_offset + T``. A prefill cut in
                chunks passes the end of the whole prompt, so that every chunk rotates as
                one pass over the prompt would.

        Raises:
            ValueError: a negative offset, ``position_offset + T > max_seq_len``, or a
                ``seq_len`` short of the chunk's end or past ``max_seq_len``.
        """
        try:
            q, k = self._device_arrays(q, k)
            n_t = self._check_qk(q, k)
            offset = self._check_int(position_offset, "position_offset")
            last = offset + n_t - 1
            if last >= self.config.max_seq_len:
                raise ValueError(
                    f"{self._describe()}: position {last} (offset {offset} + T {n_t} - 1) is "
                    f"beyond the table: positions must be < max_seq_len = "
                    f"{self.config.max_seq_len}"
                )
            length = last + 1 if seq_len is None else self._check_int(seq_len, "seq_len")
            if not last + 1 <= length <= self.config.max_seq_len:
                raise ValueError(
                    f"{self._describe()}: seq_len {length} must cover the chunk (>= {last + 1}) "
                    f"and fit the table (<= max_seq_len = {self.config.max_seq_len})"
                )
            self._op.apply(q, k, offset=offset, seq_len=length)
        finally:
            self._release_foreign()

    def decode(self, q: Any, k: Any, position: Any) -> None:
        """Rotate one token per sequence in place.

        Args:
            q: ``[B, 1, n_heads * head_dim]``.
            k: ``[B, 1, n_kv_heads * head_dim]``.
            position: an int for every sequence, or one int per sequence ``[B]``; with an
                M-RoPE config also ``[3, B]`` (a position per axis and sequence).
        """
        try:
            q, k = self._device_arrays(q, k)
            n_t = self._check_qk(q, k)
            if n_t != 1:
                raise ValueError(f"{self._describe()}: decode takes T == 1, got T = {n_t}")
            if isinstance(position, int | np.integer) and not isinstance(position, bool):
                offset = self._check_int(position, "position")
                if offset >= self.config.max_seq_len:
                    raise ValueError(
                        f"{self._describe()}: position {offset} is beyond the table: positions "
                        f"must be < max_seq_len = {self.config.max_seq_len}"
                    )
                self._op.apply(q, k, offset=offset, seq_len=offset + 1)
                return
            positions, high = self._check_positions(position, (q.shape[0],), "position")
            self._op.apply(q, k, positions=positions[..., None], seq_len=high + 1)
        finally:
            self._release_foreign()

    def _decode_at(self, q: Any, k: Any, position: int) -> None:
        """:meth:`decode` at one int position, for a parent that checked what it passes: ``q``
        and ``k`` ``[B, 1, width]`` of this device and dtype, ``0 <= position < max_seq_len``."""
        self._op.apply(q, k, offset=position, seq_len=position + 1)

    def rotate(self, q: Any, k: Any, positions: Any) -> None:
        """Rotate Q and K in place at explicit positions (packed or ragged batches).

        Args:
            q: ``[B, T, n_heads * head_dim]``.
            k: ``[B, T, n_kv_heads * head_dim]``.
            positions: integers broadcastable to ``[B, T]`` (``[T]``, ``[B, 1]``, ``[B, T]``, ...).
                With an M-RoPE config (``mrope_section``) also ``[3, B, T]`` (broadcastable:
                ``[3, 1, T]``, ...): temporal, height and width positions, each frequency
                turned by the position of its axis (:meth:`RopeConfig.mrope_axes`). Positions
                without the leading axis put a token at the same position on every axis, as
                Hugging Face does for text.
        """
        try:
            q, k = self._device_arrays(q, k)
            self._check_qk(q, k)
            positions, high = self._check_positions(positions, q.shape[:2], "positions")
            self._op.apply(q, k, positions=positions, seq_len=high + 1)
        finally:
            self._release_foreign()

    def backward(self, dq: Any, dk: Any, positions: Any = None) -> tuple[Any, Any]:
        """Gradients w.r.t. the inputs of the rotation: ``R^T dq``, ``R^T dk``.

        Args:
            dq: ``[B, T, n_heads * head_dim]`` upstream gradient of rotated Q (not modified).
            dk: ``[B, T, n_kv_heads * head_dim]`` upstream gradient of rotated K (not modified).
            positions: the positions of the forward call: None for ``0 .. T-1``, or integers
                broadcastable to ``[B, T]`` (or ``[3, B, T]`` with M-RoPE) as in :meth:`rotate`.

        Returns:
            ``(dq_in, dk_in)``: views ``[B, T, ...]`` of the component-owned gradient buffers,
            overwritten by the next backward.

        Raises:
            RuntimeError: on INFERENCE builds (they own no gradient buffers).
        """
        self._require_built("backward")
        if not self.build_context.is_training:
            raise RuntimeError(
                f"{self._describe()} was built for INFERENCE and has no gradient buffers; "
                "build with RuntimeMode.TRAINING to call backward()"
            )
        try:
            dq, dk = self._device_arrays(dq, dk)
            n_t = self._check_qk(dq, dk, names=("dq", "dk"), writeable=False)
            n_b = dq.shape[0]
            dq_in = self._input_gradients["dq_in"][:n_b, :n_t]
            dk_in = self._input_gradients["dk_in"][:n_b, :n_t]
            self._check_not_in_outputs((dq, dk), (dq_in, dk_in))
            if positions is None:
                if n_t > self.config.max_seq_len:
                    raise ValueError(
                        f"{self._describe()}: T = {n_t} exceeds max_seq_len = "
                        f"{self.config.max_seq_len}"
                    )
                self._op.apply(
                    dq, dk, offset=0, seq_len=n_t, inverse=True, q_out=dq_in, k_out=dk_in
                )
            else:
                pos, high = self._check_positions(positions, (n_b, n_t), "positions")
                self._op.apply(
                    dq,
                    dk,
                    positions=pos,
                    seq_len=high + 1,
                    inverse=True,
                    q_out=dq_in,
                    k_out=dk_in,
                )
        finally:
            self._release_foreign()
        return dq_in, dk_in

    # ------------------------------------------------------------------ checks
    def _device_arrays(self, q: Any, k: Any) -> tuple[Any, Any]:
        """Q and K as arrays of this device: another library's arrays there (a torch tensor,
        anything with ``__dlpack__`` or ``__cuda_array_interface__``) become views of the same
        memory, so they rotate in place; anything else comes back unchanged for the checks to
        accept or refuse. Called inside the ``try`` whose ``finally`` runs
        :meth:`_release_foreign`, so a producer taken before an error is still ordered."""
        ctx = self._context
        if ctx is None:  # not placed yet: the checks say so
            return q, k
        return ctx.as_device_array(q), ctx.as_device_array(k)

    def _release_foreign(self) -> None:
        """Order the producers of adopted arrays (torch's stream) after this call's launches."""
        if self._context is not None:
            self._context.release_foreign()

    def _require_built(self, what: str) -> None:
        if self._build_context is None:
            raise RuntimeError(
                f"{self._describe()}: {what} needs a built component; call "
                f"build(BuildContext((B, T, {self._q_width}), RuntimeMode.TRAINING or INFERENCE))"
            )

    def _check_qk(
        self,
        q: Any,
        k: Any,
        *,
        names: tuple[str, str] = ("q", "k"),
        writeable: bool = True,
    ) -> int:
        """Validate Q and K; returns T."""
        if self._build_context is None:
            self._require_built("a call")
        ctx = self._context
        for x, name, width in ((q, names[0], self._q_width), (k, names[1], self._k_width)):
            if not ctx.is_device_array(x):  # type: ignore[union-attr]
                raise TypeError(
                    f"{self._describe()}: {name} must be an array on {ctx.device_id} "  # type: ignore[union-attr]
                    f"({ctx.xp.__name__}.ndarray), got {type(x).__module__}.{type(x).__name__}"  # type: ignore[union-attr]
                )
            if x.dtype != self._dtype:
                raise TypeError(
                    f"{self._describe()}: {name} has dtype {x.dtype}; this component is "
                    f"{self.precision} ({self._dtype}); convert with .astype"
                )
            if x.ndim != 3 or x.shape[2] != width:
                raise ValueError(
                    f"{self._describe()}: {name} must be [B, T, {width}], got {tuple(x.shape)}"
                )
            if writeable and not _is_writeable(x):
                raise ValueError(f"{self._describe()}: {name} is read-only; RoPE rotates in place")
            if writeable and self_overlaps(x):
                raise ValueError(
                    f"{self._describe()}: {name} has elements that share memory (shape "
                    f"{tuple(x.shape)}, strides {tuple(x.strides)}); RoPE rotates in place and "
                    "would turn them more than once; pass a copy"
                )
        n_b, n_t = q.shape[0], q.shape[1]
        if k.shape[0] != n_b or k.shape[1] != n_t:
            raise ValueError(
                f"{self._describe()}: {names[0]} {tuple(q.shape)} and {names[1]} "
                f"{tuple(k.shape)} must share B and T"
            )
        if n_b > self._max_batch or n_t > self._max_tokens:
            raise ValueError(
                f"{self._describe()}: [B={n_b}, T={n_t}] exceeds the build shape "
                f"[B={self._max_batch}, T={self._max_tokens}]"
            )
        if writeable and arrays_overlap(q, k):
            raise ValueError(
                f"{self._describe()}: {names[0]} and {names[1]} share memory; RoPE rotates both in "
                "place and would turn the shared elements twice (views of a fused QKV buffer "
                "must take disjoint channels)"
            )
        return int(n_t)

    def _check_not_in_outputs(self, grads: tuple[Any, Any], outs: tuple[Any, Any]) -> None:
        """Refuse upstream gradients that lie in the gradient buffers backward writes (a
        previous backward's results passed back): they would be overwritten before they are
        read. Each may be its own output buffer, exactly (the rotation is then in place)."""
        for grad, name, own in zip(grads, ("dq", "dk"), ("dq_in", "dk_in"), strict=True):
            for out, out_name in zip(outs, ("dq_in", "dk_in"), strict=True):
                if arrays_overlap(grad, out) and not (out_name == own and same_view(grad, out)):
                    raise ValueError(
                        f"{self._describe()}: {name} lies in this component's {out_name} buffer "
                        "(a previous backward's result), which backward overwrites before it "
                        "reads it; pass a copy"
                    )

    def _check_int(self, value: Any, name: str) -> int:
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{self._describe()}: {name} must be an int, got {value!r}") from None
        if number < 0:
            raise ValueError(f"{self._describe()}: {name} must be >= 0, got {number}")
        return number

    def _check_positions(
        self, positions: Any, shape: tuple[int, ...], name: str
    ) -> tuple[np.ndarray, int]:
        """Host int64 positions broadcast-compatible with ``shape``, all in ``[0, max_seq_len)``,
        and the highest of them (0 when there are none): a call at them spans ``highest + 1``.

        With an M-RoPE config, positions with one more leading axis of length 3 (``[3, B, T]``
        for ``shape = (B, T)``) are per-axis positions; they are returned broadcast to
        ``[3, *shape]``.
        """
        if hasattr(positions, "__cuda_array_interface__") or type(positions).__module__.startswith(
            "cupy"
        ):
            positions = self.execution_context.to_host(positions)
        array = np.asarray(positions)
        if array.dtype.kind not in "iu":  # signed or unsigned integers (not bool: kind "b")
            raise TypeError(f"{self._describe()}: {name} must be integers, got dtype {array.dtype}")
        per_axis = array.ndim == len(shape) + 1 and array.shape[0] == 3
        target = (3, *shape) if per_axis else tuple(shape)
        fits = array.shape == target  # the usual case, without NumPy's broadcast machinery
        if not fits:
            try:
                fits = np.broadcast_shapes(array.shape, target) == target
            except ValueError:
                fits = False
        if per_axis and fits and not self.config.is_mrope:
            raise ValueError(
                f"{self._describe()}: {name} of shape {array.shape} are M-RoPE positions "
                f"{list(target)} (an axis of 3 in front); they need a RopeConfig with "
                "mrope_section"
            )
        if not fits:
            expected = f"{list(shape)}"
            if self.config.is_mrope:
                expected += f" or (M-RoPE) {[3, *shape]}"
            raise ValueError(
                f"{self._describe()}: {name} of shape {array.shape} does not broadcast to "
                f"{expected}"
            )
        if array.size == 0:
            if math.prod(target) == 0:  # an empty batch: nothing to rotate
                return np.zeros(target, dtype=np.int64), 0
            raise ValueError(f"{self._describe()}: {name} is empty")
        low, high = int(array.min()), int(array.max())
        if low < 0:
            raise ValueError(f"{self._describe()}: {name} must be >= 0, got {low}")
        if high >= self.config.max_seq_len:
            raise ValueError(
                f"{self._describe()}: position {high} is beyond the table: positions must be "
                f"< max_seq_len = {self.config.max_seq_len}"
            )
        array = array.astype(np.int64, copy=False)
        return (np.broadcast_to(array, target) if per_axis else array), high

    def _extra_repr(self) -> str:
        cfg = self.config
        mrope = "" if cfg.mrope_section is None else f", mrope={list(cfg.mrope_section)}"
        return (
            f"heads={cfg.n_heads}/{cfg.n_kv_heads}, head_dim={cfg.head_dim}, "
            f"rotary_dim={cfg.rotated_dim}, layout={RopeLayout(cfg.layout).value}, "
            f"type={cfg.rope_type}{mrope}"
        )


def _is_writeable(x: Any) -> bool:
    flags = getattr(x, "flags", None)
    return bool(getattr(flags, "writeable", True)) if flags is not None else True
