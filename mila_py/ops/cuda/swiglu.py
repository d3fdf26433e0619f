"""CUDA SwiGLUOp: ``h = silu(g) * u`` and its gradients, one fused elementwise kernel each.

Same formulas and order of operations as :mod:`mila_py.ops.cpu.swiglu`, with
``s = 1 / (1 + exp(-g))`` and ``1 - s = 1 / (1 + exp(g))`` each computed directly::

    forward   h  = (s * g) * u
    backward  du = dh * (g * s)
              dg = dh * (((1 - s) * (g * s) + s) * u)

Where ``exp`` overflows to inf, ``1 / (1 + inf) = 0`` is the right limit (the GPU raises
nothing). The backward reads ``dh`` before writing ``dgate`` at each element, so ``dgate`` may be
``dh`` itself (the SwiGLU component relies on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cpu._rows import out_rows
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import Operation
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["SWIGLU_CUDA_SOURCE", "CudaSwiGLUOp"]

SWIGLU_CUDA_SOURCE = r"""
__device__ __forceinline__ float mila_sigmoid(float g) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
}

// h = silu(g) * u over n contiguous elements (grid-stride).
extern "C" __global__ void swiglu_forward(
    const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ h,
    long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        h[i] = __fmul_rn(__fmul_rn(mila_sigmoid(g), g), up[i]);
    }
}

// du = dh * silu(g), dg = dh * silu'(g) * u. dgate may alias dh (read before written), so
// neither is __restrict__.
extern "C" __global__ void swiglu_backward(
    const float* __restrict__ gate, const float* __restrict__ up, const float* dh,
    float* dgate, float* __restrict__ dup, long long n)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        const float u = up[i];
        const float d = dh[i];
        const float s = mila_sigmoid(g);
        const float silu = __fmul_rn(g, s);
        const float one_minus_s = mila_sigmoid(-g);
        const float dsilu = __fmul_rn(__fadd_rn(__fmul_rn(one_minus_s, silu), s), u);
        dup[i] = __fmul_rn(d, silu);
        dgate[i] = __fmul_rn(d, dsilu);
    }
}
"""


@register_op("SwiGLUOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaSwiGLUOp(Operation):
    """Fused ``silu(g) * u`` kernels (same contract as the CPU op)."""

    def forward(self, gate: Any, up: Any, out: Any) -> None:
        """``out = silu(gate) * up`` (``out`` C-contiguous, not aliasing the inputs)."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            g2 = _kernels.contiguous_rows(xp, gate)
            u2 = _kernels.contiguous_rows(xp, up)
            h2 = out_rows(out)
            n = int(h2.size)
            if n == 0:
                return
            _kernels.launch(
                ctx,
                SWIGLU_CUDA_SOURCE,
                "swiglu_forward",
                _kernels.grid_1d(n),
                _kernels.THREADS,
                (g2, u2, h2, np.int64(n)),
            )

    def bind_forward(self, gate: Any, up: Any, out: Any) -> Callable[[], Any]:
        """:meth:`forward` of fixed buffers as one kernel launch with its arguments made here
        (C-contiguous ``gate`` and ``up``; else the general call), run with the context active."""
        n = int(out.size)
        if not (gate.flags.c_contiguous and up.flags.c_contiguous) or n == 0:
            return super().bind_forward(gate, up, out)
        ctx: Any = self.context
        args = (gate, up, out_rows(out), _kernels.bound_scalar(ctx.xp, np.int64(n)))
        call = _kernels.bind_launch(
            ctx, SWIGLU_CUDA_SOURCE, "swiglu_forward", _kernels.grid_1d(n), _kernels.THREADS
        )
        return lambda: call(args)

    def backward(self, gate: Any, up: Any, dh: Any, dgate: Any, dup: Any) -> None:
        """Overwrite ``dgate`` and ``dup`` (C-contiguous); ``dgate`` may be ``dh`` itself."""
        ctx: Any = self.context
        xp = ctx.xp
        with ctx.activate():
            g2 = _kernels.contiguous_rows(xp, gate)
            u2 = _kernels.contiguous_rows(xp, up)
            dg2, du2 = out_rows(dgate), out_rows(dup)
            # dh is dgate itself (C-contiguous) or read as its own contiguous rows
            dh2 = dg2 if dh is dgate else _kernels.contiguous_rows(xp, dh)
            n = int(dg2.size)
            if n == 0:
                return
            _kernels.launch(
                ctx,
                SWIGLU_CUDA_SOURCE,
                "swiglu_backward",
                _kernels.grid_1d(n),
                _kernels.THREADS,
                (g2, u2, dh2, dg2, du2, np.int64(n)),
            )
