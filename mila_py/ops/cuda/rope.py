"""CUDA RopeOp: one kernel launch rotates Q and K together, in place or into gradient buffers.

Kernel layout (``rope.cu``): one thread block per token; the block first stages the token's
cos/sin row in shared memory (read once, reused by every head of Q and K), then its threads walk
the ``(heads of Q + heads of K) x (pair groups)`` items, consecutive threads on consecutive groups
of one head (coalesced). A pair group is read with one access of ``VEC`` elements per half: 16
bytes where alignment allows, else 8, 4, ... down to single elements (``VEC = 1``). Rows may have
any stride (Q/K views of a fused QKV buffer); the last axis must be contiguous.

Arithmetic is fp32 with the CPU kernels' order of operations (``x1 c - x2 s``, ``x2 c + x1 s``),
written with ``__fmul_rn``/``__fadd_rn`` so that the compiler never contracts it into FMAs: every
vector width gives bit-identical results. 16-bit storage is carried as raw bits and converted
with PTX ``cvt`` (FP16) or integer round-to-nearest-even (BF16), so the source includes no CUDA
header: NVRTC's header discovery differs between CuPy installs, and CuPy's bundled
``cuda_fp16.h`` does not always match a toolkit's ``cuda_bf16.h``.

Positions are validated on the host by the Rope component before launch; the op re-checks
``seq_len`` against the table in O(1), so a bad call never reads past the table and Q, K stay
untouched. Explicit positions go to the kernel as int32 device memory: uploaded per call, or a
decode plan's step buffer (:attr:`DecodePositions.device`), which the kernel reads.

The kernel file is compiled and launched through :mod:`._kernels` like the other CUDA ops'
(lazily, with CuPy/NVRTC, one module per device and storage precision holding that precision's
instantiations, see :func:`kernel_names`); scalars are passed with explicit widths (CuPy turns a
Python int into 64 bits). The CPU test suite runs this source in its kernel emulator:
``tests/test_rope.py`` (the component on every device) and ``tests/test_rope_cuda_op.py`` (what
only this op has) over the emulated ``CUDA:0`` (on a GPU, the same bodies run on it), and
``tests/test_rope_kernel_emulated.py`` for what only the emulator shows (the instantiation each
layout launches, its traps for misaligned or out-of-bounds accesses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.build_context import BuildContext
from mila_py.devices import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import DecodePositions, Operation, bind_rope_decode
from mila_py.ops.registry import register_op
from mila_py.precision import Precision
from mila_py.rope.config import RopeConfig, RopeLayout
from mila_py.rope.table import RopeTable, get_rope, mrope_axes

__all__ = ["THREADS", "CudaRopeOp", "kernel_name", "kernel_names", "vector_widths"]

#: the kernel file
_FILE = "rope.cu"
#: threads per block: ``rope_qk``'s ``__launch_bounds__`` in ``rope.cu``
THREADS = 128

_CTYPES = {Precision.FP32: "float", Precision.FP16: "mila_half", Precision.BF16: "mila_bf16"}


def vector_widths(precision: Precision) -> tuple[int, ...]:
    """Elements per access the kernels are instantiated for, widest first (16, 8, 4, 2 bytes)."""
    item = precision.itemsize
    return tuple(sorted({max(1, nbytes // item) for nbytes in (16, 8, 4, 2)}, reverse=True))


def kernel_name(precision: Precision, vec: int, interleaved: bool) -> str:
    return f"rope_qk<{_CTYPES[precision]}, {vec}, {'true' if interleaved else 'false'}>"


def kernel_names(precision: Precision) -> list[str]:
    """Every instantiation the op can launch for ``precision`` (one module per precision)."""
    return [
        kernel_name(precision, vec, inter)
        for vec in vector_widths(precision)
        for inter in (False, True)
    ]


@register_op("RopeOp", DeviceType.CUDA, precisions=(Precision.FP32, Precision.FP16, Precision.BF16))
class CudaRopeOp(Operation):
    """CuPy RoPE: a fused Q+K kernel on the execution context's stream."""

    config: RopeConfig

    def __init__(self, context: Any, config: RopeConfig, precision: Precision) -> None:
        super().__init__(context, config, precision)
        self.table: RopeTable | None = None
        self._interleaved = config.layout is RopeLayout.INTERLEAVED
        self._widths = vector_widths(precision)
        # every instantiation of this precision (one module), and the one to launch per width
        self._names = tuple(kernel_names(precision))
        self._name_of = {
            vec: kernel_name(precision, vec, self._interleaved) for vec in self._widths
        }
        self._item = precision.itemsize
        # the width each address alignment allows (a handful of alignments per model)
        self._width_of: dict[int, int] = {}
        self._mrope: tuple[np.int32, ...] = (np.int32(0),) * 3
        self._axes: np.ndarray | None = None

    def build(self, build_context: BuildContext) -> None:
        super().build(build_context)
        self.table = get_rope(self.config, self.context.device_id)
        cfg = self.config
        self._axes = mrope_axes(cfg, self.table)
        self._mrope = (np.int32(0),) * 3
        if cfg.mrope_section is not None:  # the kernel's (mode, a, b) of mrope_axis()
            t, h, w = cfg.mrope_section
            mode, lo, hi = (2, 3 * h, 3 * w) if cfg.mrope_interleaved else (1, t, t + h)
            self._mrope = (np.int32(mode), np.int32(lo), np.int32(hi))

    def state_arrays(self) -> list[Any]:
        return self.table.arrays() if self.table is not None else []

    def prefill(self, q: Any, k: Any, position_offset: int) -> None:
        self.apply(q, k, offset=int(position_offset), seq_len=int(position_offset) + q.shape[1])

    def decode(self, q: Any, k: Any, position: Any) -> None:
        if np.ndim(position) == 0:
            self.prefill(q, k, int(position))
        else:
            positions = np.asarray(position, dtype=np.int64).reshape(-1, 1)
            self.apply(q, k, positions=positions, seq_len=int(positions.max(initial=0)) + 1)

    def bind_decode(self, q: Any, k: Any, positions: DecodePositions) -> Callable[[], None]:
        """:meth:`decode` of ``q``, ``k`` ``[B, 1, width]`` at ``positions`` (read at each call),
        as a callable of no arguments (a decode plan). Where one table serves every position
        below ``positions.limit`` (default: the table's length), one launch that reads the positions from the step's device
        buffer (:attr:`DecodePositions.device`) and nothing from the host, so a CUDA graph can
        replay it; a length-dependent scaling (``dynamic``, LongRoPE) whose table changes below
        the limit goes through :meth:`apply` (which reads the positions on the host)."""
        general = bind_rope_decode(self.apply, q, k, positions)
        table = self.table
        assert table is not None, "CudaRopeOp used before build"
        item = self._item
        if q.shape[1] != 1 or q.shape[0] == 0 or q.strides[2] != item or k.strides[2] != item:
            return general
        device, limit = positions.device, positions.limit
        if limit is None:  # every position is below the table's length
            limit = self.config.max_seq_len
        if device is None or not 0 < limit <= self.config.max_seq_len:
            return general
        first, last = table.tables_for(1), table.tables_for(limit)
        if first is None or last is None or first[0] is not last[0] or first[1] is not last[1]:
            return general  # the rows depend on the step's length
        cos, sin = first

        def rotate() -> None:
            self._launch(q, k, q, k, cos, sin, device, 0, False)

        return rotate

    def vector_width(self, *arrays: Any) -> int:
        """The widest access (elements) that every array's base, row strides and the head allow.

        Strides of axes of length 1 are never stepped, so they do not count.

        Raises:
            ValueError: an array whose first element or row strides are not a whole number of
                elements from an aligned address (no access width would be aligned).
        """
        aligned = 16  # the largest power of two (bytes, at most 16) dividing every address
        for a in arrays:
            aligned = math.gcd(aligned, _kernels.address(a))
            if a.shape[0] != 1:
                aligned = math.gcd(aligned, a.strides[0])
            if a.shape[1] != 1:
                aligned = math.gcd(aligned, a.strides[1])
        vec = self._width_of.get(aligned)
        if vec is None:
            vec = self._width_of.setdefault(aligned, self._width_for(aligned, arrays))
        return vec

    def _width_for(self, aligned: int, arrays: tuple[Any, ...]) -> int:
        """The widest access of :data:`vector_widths` that ``aligned`` bytes, the rotated span
        and the head size allow."""
        assert self.table is not None, "CudaRopeOp used before build"
        item = self._item
        if aligned % item:
            raise ValueError(
                f"CUDA RoPE needs Q and K at whole elements of {item} bytes from an aligned "
                f"address, with row strides of whole elements; got strides "
                f"{[a.strides for a in arrays]}"
            )
        n_freq = self.table.n_freq
        span = 2 * n_freq if self._interleaved else n_freq
        for vec in self._widths:
            if vec == 1 or (
                aligned % (vec * item) == 0 and span % vec == 0 and self.config.head_dim % vec == 0
            ):
                return vec
        return 1

    def apply(
        self,
        q: Any,
        k: Any,
        *,
        offset: int = 0,
        positions: np.ndarray | None = None,
        seq_len: int,
        inverse: bool = False,
        q_out: Any = None,
        k_out: Any = None,
    ) -> None:
        """Same contract as :meth:`mila_py.ops.cpu.rope.CpuRopeOp.apply`, on CuPy arrays.

        Raises:
            ValueError: a last axis that is not contiguous, ``seq_len`` past the table, or
                arrays not at whole elements (see :meth:`vector_width`); all checked before
                anything is launched.
        """
        assert self.table is not None, "CudaRopeOp used before build"
        q_out = q if q_out is None else q_out
        k_out = k if k_out is None else k_out
        n_b, n_t = int(q.shape[0]), int(q.shape[1])
        if n_b == 0 or n_t == 0:  # nothing to rotate (empty arrays may carry any strides)
            return
        item = self._item
        for a in (q, k, q_out, k_out):
            if a.strides[2] != item:
                raise ValueError(
                    "CUDA RoPE needs the last axis of Q and K contiguous, got strides "
                    f"{a.strides} for shape {a.shape}"
                )
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"CUDA RoPE: position {seq_len - 1} is beyond the table: positions must be "
                f"< max_seq_len = {self.config.max_seq_len}"
            )
        ctx = self.context
        table = self.table
        tables = table.tables_for(seq_len)
        per_axis = positions is not None and positions.ndim == 3  # M-RoPE positions [3, B, T]
        if tables is None:  # a length-dependent type past its original context: rows per call
            cos_rows, sin_rows, offset, positions = table.call_rows(
                (n_b, n_t), offset, positions, seq_len, self._axes if per_axis else None
            )
            per_axis = False
            tables = ctx.to_device(cos_rows), ctx.to_device(sin_rows)
        pos = None  # a null pointer: the kernel reads positions only when told to
        if positions is not None:  # every one below the table's length: they fit an int32
            shape = (3, n_b, n_t) if per_axis else (n_b, n_t)
            pos = ctx.to_device(
                np.ascontiguousarray(np.broadcast_to(positions, shape), dtype=np.int32)
            )
        self._launch(q, k, q_out, k_out, *tables, pos, offset, inverse, per_axis)

    def _launch(
        self,
        q: Any,
        k: Any,
        q_out: Any,
        k_out: Any,
        cos: Any,
        sin: Any,
        pos: Any,
        offset: int,
        inverse: bool,
        per_axis: bool = False,
    ) -> None:
        """One launch on the context's stream: a block per token, at positions ``offset + t``
        or (``pos``, int32 device memory) ``pos[b, t]``, ``pos[axis, b, t]`` when ``per_axis``
        (M-RoPE)."""
        assert self.table is not None, "CudaRopeOp used before build"
        cfg = self.config
        n_b, n_t = int(q.shape[0]), int(q.shape[1])
        n_freq = self.table.n_freq
        in_place = q_out is q and k_out is k
        vec = self.vector_width(*((q, k) if in_place else (q, k, q_out, k_out)))
        copy_rest = not in_place and 2 * n_freq < cfg.head_dim
        item = self._item
        strides = (np.int64(st // item) for a in (q, k, q_out, k_out) for st in a.strides[:2])
        args = (
            q, q_out, k, k_out, cos, sin, _kernels.NULL if pos is None else pos,
            np.int32(pos is not None), np.int64(offset), np.int32(n_t), np.int32(cfg.n_heads),
            np.int32(cfg.n_kv_heads), np.int32(cfg.head_dim), np.int32(n_freq), *strides,
            np.float32(-1.0 if inverse else 1.0), np.int32(copy_rest),
            *(self._mrope if per_axis else (np.int32(0),) * 3),
        )  # fmt: skip
        _kernels.launch(
            self.context,
            _FILE,
            self._name_of[vec],
            (n_b * n_t,),
            THREADS,
            args,
            shared_mem=2 * n_freq * 4,
            name_expressions=self._names,
        )
