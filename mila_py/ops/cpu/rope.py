"""CPU RopeOp: rotary position embedding on NumPy arrays, in place.

Two paths compute the same function:

- ``numpy``: the readable reference. Tokens are processed in blocks small enough to stay in
  cache, so each block is read from memory once although NumPy makes several passes over it;
  large calls spread the blocks over the cores (NumPy releases the GIL inside each pass).
- ``fused``: one Numba pass over Q and K together (see ``_rope_fused``), parallel over cores for
  large calls and serial for decode. Used automatically when Numba is installed.

For a pair ``(x1, x2)`` of a head at position ``p`` with ``c = cos[p, i]``, ``s = sin[p, i]``:
``x1' = x1 c - x2 s``, ``x2' = x2 c + x1 s``; the inverse (backward) uses ``-s``. The halves are
``x[i], x[i + n]`` (layout "half") or ``x[2i], x[2i + 1]`` (layout "interleaved"), for
``i < n = n_freq``; channels past ``2 n`` of a head pass through.

Arrays are ``q: [B, T, n_heads * head_dim]``, ``k: [B, T, n_kv_heads * head_dim]`` with any
strides (views of a fused QKV buffer work); the op trusts its caller (the Rope component) to have
validated shapes, dtypes and positions.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from mila_py.build_context import BuildContext
from mila_py.devices import DeviceType
from mila_py.ops.cpu import _rope_fused
from mila_py.ops.cpu._fused_math import BACKENDS, bits, cpu_backend, storage
from mila_py.ops.cpu._wide import is_reduced
from mila_py.ops.operation import DecodePositions, Operation, bind_rope_decode
from mila_py.ops.registry import register_op
from mila_py.precision import Precision
from mila_py.rope.config import RopeConfig, RopeLayout
from mila_py.rope.table import RopeTable, get_rope, mrope_axes

__all__ = ["BACKENDS", "CpuRopeOp"]

_Array = np.ndarray

#: bytes of one tensor a NumPy block covers: big enough that the Python work per block is
#: small, small enough that the block and its scratch stay in L2/L3 across NumPy's passes
#: (1-2 MiB is best where L2 holds 1 MiB per core; far larger blocks spill and run 2x slower)
_NUMPY_BLOCK_BYTES = 1024 * 1024
#: elements (Q + K) above which the fused kernel and the NumPy path use every core. High on
#: purpose: RoPE is memory-bound, and handing mid-sized calls to a thread pool that BLAS
#: threads are still spinning on (right after a matmul, as in attention) costs far more than
#: it saves.
_PARALLEL_ELEMENTS = 1 << 22


@register_op(
    "RopeOp",
    DeviceType.CPU,
    precisions=(Precision.FP32, Precision.FP64, Precision.FP16, Precision.BF16),
)
class CpuRopeOp(Operation):
    """NumPy/Numba RoPE for one configuration and precision.

    Attributes:
        backend: ``"auto"`` (fused when Numba is installed), ``"numpy"`` or ``"fused"``;
            the environment variable ``MILA_PY_CPU_BACKEND`` sets the default (an unknown
            value there is a ValueError when the op is made; see
            :func:`mila_py.ops.cpu._fused_math.cpu_backend`).
        table: the shared :class:`RopeTable` (after build).
    """

    config: RopeConfig

    def __init__(self, context: Any, config: RopeConfig, precision: Precision) -> None:
        super().__init__(context, config, precision)
        self._backend = cpu_backend()
        self._fused_on = self._backend == "fused" or (
            self._backend == "auto" and _rope_fused.AVAILABLE
        )
        self.table: RopeTable | None = None
        self._dtype = precision.numpy_dtype
        self._interleaved = config.layout is RopeLayout.INTERLEAVED
        self._axes: np.ndarray | None = None  # M-RoPE: the position axis of each frequency

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"CpuRopeOp.backend must be one of {BACKENDS}, got {value!r}")
        if value == "fused" and not _rope_fused.AVAILABLE:
            raise RuntimeError(
                'the fused CPU RoPE kernel needs Numba: `pip install -e ".[jit]"` in the '
                "mila_py checkout (or `pip install numba`)"
            )
        self._backend = value
        self._fused_on = value == "fused" or (value == "auto" and _rope_fused.AVAILABLE)

    @property
    def uses_fused(self) -> bool:
        return self._fused_on

    def build(self, build_context: BuildContext) -> None:
        super().build(build_context)
        self.table = get_rope(self.config, self.context.device_id)
        self._axes = mrope_axes(self.config, self.table)

    def state_arrays(self) -> list[Any]:
        return self.table.arrays() if self.table is not None else []

    # ------------------------------------------------------------------ entry points
    def prefill(self, q: np.ndarray, k: np.ndarray, position_offset: int) -> None:
        """Rotate in place at positions ``offset .. offset + T - 1``."""
        self.apply(q, k, offset=int(position_offset), seq_len=int(position_offset) + q.shape[1])

    def decode(self, q: np.ndarray, k: np.ndarray, position: Any) -> None:
        """Rotate ``T == 1`` tokens in place at ``position`` (int or one per sequence ``[B]``)."""
        if np.ndim(position) == 0:
            self.prefill(q, k, int(position))
        else:
            positions = np.asarray(position, dtype=np.int64).reshape(-1, 1)
            self.apply(q, k, positions=positions, seq_len=int(positions.max(initial=0)) + 1)

    def bind_decode(
        self, q: np.ndarray, k: np.ndarray, positions: DecodePositions
    ) -> Callable[[], None]:
        """:meth:`decode` of ``q``, ``k`` ``[B, 1, width]`` at ``positions`` (read at each call),
        as a callable of no arguments (a decode plan: fixed buffers, positions that move).

        The fused kernel is called directly while it applies (fp32/fp64 data, a table that
        covers the positions); anything else goes through :meth:`apply`."""
        table = self.table
        assert table is not None, "CpuRopeOp used before build"
        cfg = self.config
        n_rows = q.shape[0]
        fmt = storage(q.dtype)
        args = (
            cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, table.n_freq, self._interleaved, False, fmt
        )  # fmt: skip
        kernel = _rope_fused.rope_rows_inplace
        no_positions = _rope_fused.NO_POSITIONS
        each = positions.each.reshape(n_rows, 1)  # a view: the values of the step
        direct = q.shape[1] == 1 and (q.dtype in (np.float32, np.float64) or is_reduced(q.dtype))
        general = bind_rope_decode(self.apply, q, k, positions)
        q, k = bits(q), bits(k)  # 16-bit storage: the kernel rotates the bits

        def rotate() -> None:
            top = positions.highest
            tables = table.tables_for(top + 1) if direct and self.uses_fused else None
            if tables is None:
                general()
            elif positions.uniform:
                kernel(q, k, tables[0], tables[1], top, no_positions, False, 0, n_rows, *args)
            else:
                kernel(q, k, tables[0], tables[1], 0, each, True, 0, n_rows, *args)

        return rotate

    def apply(
        self,
        q: np.ndarray,
        k: np.ndarray,
        *,
        offset: int = 0,
        positions: np.ndarray | None = None,
        seq_len: int,
        inverse: bool = False,
        q_out: np.ndarray | None = None,
        k_out: np.ndarray | None = None,
    ) -> None:
        """Rotate ``q``/``k`` (or their inverse) into ``q_out``/``k_out`` (default: in place).

        Args:
            q: ``[B, T, n_heads * head_dim]``.
            k: ``[B, T, n_kv_heads * head_dim]``.
            offset: position of token ``t`` is ``offset + t`` when ``positions`` is None.
            positions: int64 ``[B, T]`` explicit positions (broadcast views allowed), or with an
                M-RoPE config ``[3, B, T]``: frequency ``j`` of a token turns by its position on
                axis ``config.mrope_axes()[j]``.
            seq_len: ``max(position) + 1`` of the call (length-dependent scaling types use it).
            inverse: apply ``R^T`` (backward).
            q_out, k_out: outputs of the same shapes (may be ``q``/``k``).
        """
        assert self.table is not None, "CpuRopeOp used before build"
        q_out = q if q_out is None else q_out
        k_out = k if k_out is None else k_out
        tables = self.table.tables_for(seq_len)
        axes = positions is not None and positions.ndim == 3  # M-RoPE positions [3, B, T]
        if tables is None or (axes and not self.uses_fused):
            # rows per token: a length-dependent type past its original context, or M-RoPE on
            # the NumPy path
            cos, sin, offset, positions = self.table.call_rows(
                q.shape[:2], offset, positions, seq_len, self._axes if axes else None
            )
        else:
            cos, sin = tables
        if self.uses_fused:
            self._fused(q, k, q_out, k_out, cos, sin, offset, positions, inverse)
        else:
            jobs = [
                job
                for x_in, x_out, heads in (
                    (q, q_out, self.config.n_heads),
                    (k, k_out, self.config.n_kv_heads),
                )
                for job in self._numpy_blocks(x_in, x_out, heads, cos, sin, offset, positions)
            ]
            _run_blocks(jobs, self.table.n_freq, self._interleaved, inverse)

    # ------------------------------------------------------------------ fused path
    def _fused(
        self,
        q: np.ndarray,
        k: np.ndarray,
        q_out: np.ndarray,
        k_out: np.ndarray,
        cos: np.ndarray,
        sin: np.ndarray,
        offset: int,
        positions: np.ndarray | None,
        inverse: bool,
    ) -> None:
        cfg = self.config
        n_freq = self.table.n_freq  # type: ignore[union-attr]
        n_b, n_t = q.shape[0], q.shape[1]
        fmt = storage(q.dtype)  # 16-bit storage: the kernels rotate the bits
        args = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, n_freq, self._interleaved, inverse, fmt)
        # run(q, k, position of token 0, positions of these tokens, first row, end row)
        if positions is None:
            pos = _rope_fused.NO_POSITIONS

            def run(qx: _Array, kx: _Array, first: int, sub: _Array, r0: int, r1: int) -> None:
                _rope_fused.rope_rows_inplace(qx, kx, cos, sin, first, sub, False, r0, r1, *args)

        elif positions.ndim == 3:  # M-RoPE [3, B, T]: each frequency at its axis' position
            pos = np.ascontiguousarray(np.broadcast_to(positions, (3, n_b, n_t)), dtype=np.int64)
            axes = self._axes

            def run(qx: _Array, kx: _Array, first: int, sub: _Array, r0: int, r1: int) -> None:
                _rope_fused.rope_rows_mrope_inplace(qx, kx, cos, sin, sub, axes, r0, r1, *args)

        else:
            pos = np.ascontiguousarray(np.broadcast_to(positions, (n_b, n_t)), dtype=np.int64)

            def run(qx: _Array, kx: _Array, first: int, sub: _Array, r0: int, r1: int) -> None:
                _rope_fused.rope_rows_inplace(qx, kx, cos, sin, first, sub, True, r0, r1, *args)

        out_of_place = q_out is not q or k_out is not k
        parallel = n_b * n_t * (q.shape[2] + k.shape[2]) >= _PARALLEL_ELEMENTS
        if out_of_place:  # see _rope_fused: copy, then rotate the copy in place
            np.copyto(q_out, q)
            np.copyto(k_out, k)
            q, k = q_out, k_out
        # FP64: the same fp32 tables, float64 arithmetic; FP16/BF16: their bits, widened to
        # fp32 in registers and rounded once on store
        q, k = bits(q), bits(k)
        if not parallel:
            run(q, k, offset, pos, 0, n_b * n_t)
            return
        _in_parallel(lambda rows: run(q, k, offset, pos, *rows), _row_ranges(n_b * n_t))

    # ------------------------------------------------------------------ NumPy path
    def _numpy_blocks(
        self,
        x_in: np.ndarray,
        x_out: np.ndarray,
        n_heads: int,
        cos: np.ndarray,
        sin: np.ndarray,
        offset: int,
        positions: np.ndarray | None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(x [b, t, H, 2n] view of x_out, cos rows, sin rows)`` per cache-sized block."""
        head_dim = self.config.head_dim
        n = self.table.n_freq  # type: ignore[union-attr]
        if x_out is not x_in:
            x_out[...] = x_in
        if x_out.size == 0:  # B == 0 or T == 0: nothing to rotate (and no block to size)
            return []
        n_b, n_t = x_out.shape[0], x_out.shape[1]
        rotated = _heads_view(x_out, n_heads, head_dim)[..., : 2 * n]  # [B, T, H, 2n], a view
        if positions is not None:
            positions = np.broadcast_to(positions, (n_b, n_t))
        block = max(1, _NUMPY_BLOCK_BYTES // (4 * n_heads * head_dim))
        if n_t <= block:  # few tokens per sequence: block over sequences instead
            step = max(1, block // n_t)
            blocks = [(slice(b0, min(n_b, b0 + step)), slice(0, n_t)) for b0 in range(0, n_b, step)]
        else:
            blocks = [
                (slice(b, b + 1), slice(t0, min(n_t, t0 + block)))
                for b in range(n_b)
                for t0 in range(0, n_t, block)
            ]
        return [(rotated[bs, ts], *_rows(cos, sin, offset, positions, bs, ts)) for bs, ts in blocks]


def _run_blocks(
    jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n: int, interleaved: bool, inverse: bool
) -> None:
    """Rotate every block; large calls split the blocks over the cores.

    NumPy releases the GIL inside each ufunc call, and a block's calls are long enough (1 MiB of
    data) that threads overlap almost completely.
    """
    elements = sum(x.size for x, _, _ in jobs)
    workers = min(_cpu_count(), len(jobs)) if elements >= _PARALLEL_ELEMENTS else 1
    if workers <= 1:
        _rotate_blocks(jobs, n, interleaved, inverse)
        return
    parts = [jobs[i::workers] for i in range(workers)]
    _in_parallel(lambda part: _rotate_blocks(part, n, interleaved, inverse), parts)


def _row_ranges(n_rows: int) -> list[tuple[int, int]]:
    """``n_rows`` tokens as a few contiguous ranges per core (a slow core takes fewer)."""
    parts = min(n_rows, 4 * _cpu_count())
    bounds = [n_rows * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _in_parallel(fn: Callable[[Any], None], items: Sequence[Any]) -> None:
    """``fn(item)`` for every item on the op's thread pool.

    Returns once every task has finished, also when one raised (no task keeps writing into the
    caller's arrays after the call); then the first error is raised.
    """
    futures = [_pool().submit(fn, item) for item in items]
    wait(futures)
    for future in futures:
        future.result()


def _rotate_blocks(
    jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], n: int, interleaved: bool, inverse: bool
) -> None:
    if not jobs:
        return
    # One scratch area per worker, reused by every block: fresh large allocations per block
    # would page-fault on every block.
    largest = max(x.size for x, _, _ in jobs)
    wide = np.float64 if jobs[0][0].dtype == np.float64 else np.float32
    scratch = np.empty((2, largest), dtype=wide)
    for x, c, s in jobs:
        spare = scratch[0, : x.size].reshape(x.shape)
        if x.dtype in (np.float32, np.float64):
            work = x
        else:
            work = scratch[1, : x.size].reshape(x.shape)
            work[...] = x
        _rotate_block(work, c, -s if inverse else s, n, interleaved, spare)
        if work is not x:
            x[...] = work  # round once to the storage precision


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_cpu_count(), thread_name_prefix="mila_py-cpu")


# A forked child inherits the pool object but not its threads: its tasks would wait forever.
# The child starts a pool of its own on first use instead.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _heads_view(x: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """``x [B, T, H * d]`` as ``[B, T, H, d]`` without copying, whatever the strides."""
    sb, st, sc = x.strides
    return as_strided(
        x, shape=(x.shape[0], x.shape[1], n_heads, head_dim), strides=(sb, st, head_dim * sc, sc)
    )


def _rows(
    cos: np.ndarray,
    sin: np.ndarray,
    offset: int,
    positions: np.ndarray | None,
    bs: slice,
    ts: slice,
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin rows for a block, shaped to broadcast against ``[b, t, H, n]``."""
    if positions is None:
        rows = slice(offset + ts.start, offset + ts.stop)
        return cos[None, rows, None, :], sin[None, rows, None, :]
    idx = positions[bs, ts]
    return cos[idx][:, :, None, :], sin[idx][:, :, None, :]


def _rotate_block(
    x: np.ndarray, c: np.ndarray, s: np.ndarray, n: int, interleaved: bool, spare: np.ndarray
) -> None:
    """Rotate fp32 ``x [b, t, H, 2n]`` in place by ``c, s [b, t, 1, n]`` (``spare``: x-sized scratch).

    Interleaved pairs are adjacent, so they are complex numbers: one complex multiply by
    ``c + i s``. Half pairs use ``x * [c, c] + [x2, x1] * [-s, s]`` on whole rotated spans:
    one copy that swaps the halves, then three passes over whole heads. NumPy's cost here is
    per inner loop (one head row, as cos/sin broadcast over heads), so fewer, wider passes win.
    """
    if interleaved and x.strides[-1] == x.itemsize:
        z: Any = x.view(
            np.complex64 if x.dtype == np.float32 else np.complex128
        )  # x[2i] + i x[2i+1]
        z *= c + 1j * s
        return
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        x1_s, x2_s = x1 * s, x2 * s
        x1 *= c
        x2 *= c
        x1 -= x2_s
        x2 += x1_s
        return
    halves = (*x.shape[:-1], 2, n)
    swapped = spare  # [x2, x1], then [-x2 s, x1 s]
    np.copyto(swapped.reshape(halves), x.reshape(halves)[..., ::-1, :])
    swapped *= np.concatenate((-s, s), axis=-1)
    x *= np.concatenate((c, c), axis=-1)
    x += swapped
