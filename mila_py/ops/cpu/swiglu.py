"""CPU SwiGLUOp: the gated activation between SwiGLU's projections, ``h = silu(g) * u``.

The projections themselves are Linear children of the SwiGLU component; this op is the
elementwise part. With ``s = sigmoid(g)``::

    forward   h  = g * s * u
    backward  du = dh * g * s
              dg = dh * u * s * (1 + g * (1 - s))

``s = 1 / (1 + exp(-g))`` and ``1 - s = 1 / (1 + exp(g))`` are each computed directly, so
neither cancels; where ``exp`` overflows to inf, ``1 / (1 + inf) = 0`` is the right limit (the
overflow warning is silenced). Rows are processed in cache-sized blocks, so temporaries stay
small. The math is dtype-generic (the tests run it in float64). FP16 and BF16 storage computes in
float32, each output rounded once: the fused forward reads and writes the 16-bit bits, the
other paths run the float32 code on widened copies (see :mod:`._wide`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.devices.overlap import same_view
from mila_py.ops.cpu import _fused_layers
from mila_py.ops.cpu._fused_math import bits, compiled, storage
from mila_py.ops.cpu._fused_op import FusedCpuOp
from mila_py.ops.cpu._rows import apart_from, as_rows, out_rows, row_blocks
from mila_py.ops.cpu._wide import CPU_PRECISIONS, is_reduced, store, wide, wide_like
from mila_py.ops.registry import register_op

__all__ = ["CpuSwiGLUOp", "swiglu_backward", "swiglu_forward"]


def _compute_dtype(dtype: Any) -> np.dtype:
    """float64 for float64 storage, else float32 (16-bit storage computes in it)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _sigmoid(g: np.ndarray, sign: float = 1.0) -> np.ndarray:
    """``sigmoid(sign * g) = 1 / (1 + exp(-sign * g))``, a new array."""
    e = np.multiply(g, -sign)
    with np.errstate(over="ignore"):
        np.exp(e, out=e)
    e += 1
    np.reciprocal(e, out=e)
    return e


def swiglu_forward(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """``out = silu(gate) * up``.

    Args:
        gate: ``[..., H]``.
        up: ``[..., H]``.
        out: ``[..., H]``, C-contiguous, written (may not alias ``gate`` or ``up``).
    """
    g2, u2, h2 = as_rows(gate), as_rows(up), out_rows(out)  # [N, H]
    for s in row_blocks(g2.shape[0], g2.shape[1]):
        h = h2[s]
        np.multiply(_sigmoid(g2[s]), g2[s], out=h)
        h *= u2[s]


def swiglu_backward(
    gate: np.ndarray,
    up: np.ndarray,
    dh: np.ndarray,
    dgate: np.ndarray,
    dup: np.ndarray,
) -> None:
    """Write ``dgate`` and ``dup`` for the upstream gradient ``dh``.

    Args:
        gate: ``[..., H]`` the forward ``g``.
        up: ``[..., H]`` the forward ``u``.
        dh: ``[..., H]`` upstream gradient; not modified unless it is ``dgate``.
        dgate: ``[..., H]``, C-contiguous, overwritten; may be ``dh`` itself (in place).
        dup: ``[..., H]``, C-contiguous, overwritten.
    """
    g2, u2, dh2 = as_rows(gate), as_rows(up), as_rows(dh)  # [N, H]
    dg2, du2 = out_rows(dgate), out_rows(dup)
    for s in row_blocks(g2.shape[0], g2.shape[1]):
        g, u = g2[s], u2[s]
        sig = _sigmoid(g)  # [n, H]
        silu = g * sig
        # dsilu/dg = s + g s (1 - s) = s + silu (1 - s)
        dsilu = _sigmoid(g, -1.0)  # 1 - s
        dsilu *= silu
        dsilu += sig
        dsilu *= u
        np.multiply(dh2[s], silu, out=du2[s])  # before dgate: dgate may overwrite dh
        np.multiply(dh2[s], dsilu, out=dg2[s])


@register_op("SwiGLUOp", DeviceType.CPU, precisions=CPU_PRECISIONS)
class CpuSwiGLUOp(FusedCpuOp):
    """``silu(g) * u`` (see :func:`swiglu_forward`, :func:`swiglu_backward`); forward and
    backward run the fused Numba kernels of :mod:`._fused_layers` when they are available."""

    def fuses(self, dtype: Any) -> bool:
        """Whether calls on ``dtype`` run the fused kernels (16-bit storage: as float32)."""
        return super().fuses(np.dtype(np.float32) if is_reduced(dtype) else dtype)

    def forward(self, gate: Any, up: Any, out: Any) -> None:
        gate, up = apart_from((out,), gate, up)
        if self.fuses(gate.dtype):
            self._fused_call(_fused_layers.swiglu_rows, out, gate, up)()
        elif is_reduced(out.dtype):  # float32 copies, rounded once into out
            h = wide_like(out)
            swiglu_forward(wide(gate), wide(up), h)
            store(out, h)
        else:
            swiglu_forward(gate, up, out)

    @staticmethod
    def _fused_call(kernel: Any, out: Any, *inputs: Any) -> Callable[[], Any]:
        """``kernel`` on 2-D views of ``inputs`` and ``out`` (16-bit storage as its bits), as a
        call of its compiled function (no dispatch: decode plans bind it)."""
        one = _compute_dtype(out.dtype).type(1.0)
        rows = [bits(as_rows(a)) for a in inputs]
        args = (*rows, bits(out_rows(out)), one, storage(out.dtype))
        return functools.partial(compiled(kernel, args), *args)

    def bind_forward(self, gate: Any, up: Any, out: Any) -> Callable[[], Any]:
        """The fused kernel on 2-D views (C-contiguous ``gate`` and ``up``), else :meth:`forward`."""
        if self.fuses(gate.dtype) and gate.flags.c_contiguous and up.flags.c_contiguous:
            return self._fused_call(_fused_layers.swiglu_rows, out, gate, up)
        return super().bind_forward(gate, up, out)

    def bind_forward_packed(self, both: Any, out: Any) -> Callable[[], Any]:
        """``out = silu(g) * u`` with ``g`` and ``u`` the two halves of each row of the
        C-contiguous ``both [..., 2H]`` (``out [..., H]``), as a callable of no arguments: the
        fused kernel reads the dense rows (the strided halves would not vectorize)."""
        h = out.shape[-1]
        if self.fuses(both.dtype):
            return self._fused_call(_fused_layers.swiglu_packed_rows, out, both)
        return super().bind_forward(both[..., :h], both[..., h:], out)

    def backward(self, gate: Any, up: Any, dh: Any, dgate: Any, dup: Any) -> None:
        """``dgate``, ``dup`` for ``dh``; ``dgate`` may be ``dh`` itself (the same elements), any
        other overlap of an output with an input is copied apart first."""
        if is_reduced(dup.dtype):  # float32 copies, each output rounded once
            dg, du = wide(dh), wide_like(dup)
            self._backward(wide(gate), wide(up), dg, dg, du)
            store(dgate, dg)
            store(dup, du)
            return
        self._backward(gate, up, dh, dgate, dup)

    def _backward(self, gate: Any, up: Any, dh: Any, dgate: Any, dup: Any) -> None:
        in_place = same_view(dgate, dh)
        gate, up = apart_from((dgate, dup), gate, up)
        (dh,) = apart_from((dup,) if in_place else (dgate, dup), dh)
        if not self.fuses(gate.dtype):
            swiglu_backward(gate, up, dh, dgate, dup)
            return
        dg2 = out_rows(dgate)
        if not same_view(dgate, dh):  # the kernel turns dh into dgate in place
            np.copyto(dg2, as_rows(dh))
        _fused_layers.swiglu_backward_rows(as_rows(gate), as_rows(up), dg2, out_rows(dup))
