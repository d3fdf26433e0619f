"""Helpers shared by the row-wise NumPy ops: 2-D views and cache-sized row blocks."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["apart_from", "as_rows", "out_flat", "out_rows", "row_blocks"]

#: elements of one row block: temporaries of a block (a few of them) stay in a 1-2 MiB L2
BLOCK_ELEMENTS = 1 << 15


def as_rows(x: np.ndarray) -> np.ndarray:
    """``x [..., C]`` as ``[N, C]``: a view when ``x`` is contiguous, else a copy (read-only use)."""
    return x.reshape(-1, x.shape[-1])


def out_rows(out: np.ndarray) -> np.ndarray:
    """``out [..., C]`` as a ``[N, C]`` view that writes through to ``out``.

    Raises:
        ValueError: ``out`` is not C-contiguous (a reshape would silently copy).
    """
    if not out.flags.c_contiguous:
        raise ValueError(f"output arrays must be C-contiguous, got strides {out.strides}")
    return out.reshape(-1, out.shape[-1])


def out_flat(out: np.ndarray) -> np.ndarray:
    """``out`` as a 1-D view that writes through to it.

    Raises:
        ValueError: ``out`` is not C-contiguous.
    """
    if not out.flags.c_contiguous:
        raise ValueError(f"output arrays must be C-contiguous, got strides {out.strides}")
    return out.reshape(-1)


def row_blocks(n_rows: int, row_length: int) -> Iterator[slice]:
    """Slices of about :data:`BLOCK_ELEMENTS` elements covering rows ``0 .. n_rows - 1``."""
    step = max(1, BLOCK_ELEMENTS // max(1, row_length))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def apart_from(outputs: tuple[np.ndarray, ...], *inputs: np.ndarray) -> tuple[np.ndarray, ...]:
    """``inputs``, each copied if it shares memory with one of ``outputs``.

    The row-wise kernels (fused, and the NumPy references block by block) read a row of their
    inputs and then write that row of their outputs: an input that overlaps an output shifted
    by a row would be read after it was overwritten. Ops call this on their general paths
    (decode plans bind their own, separate buffers); an op that supports one exact in-place
    pair (the same elements as input and output) leaves that input out."""
    return tuple(
        a.copy() if any(np.may_share_memory(a, out) for out in outputs) else a for a in inputs
    )
