"""CUDA AdamWOp: one fused kernel per parameter for :class:`mila_py.optim.AdamW`'s update.

The generic array code of ``AdamW.step`` launches about a dozen CuPy kernels (and as many
temporaries) per parameter; this kernel reads ``p, g, m, v`` once and writes ``p, m, v`` once,
with NumPy's float32 roundings in the same order::

    p = p * decay                              (parameters that decay)
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g        (scaled, then squared, as torch)
    p = p - step_size * (m / (sqrt(v) / sqrt(correction2) + eps))   (as torch orders them)

Every scalar arrives as the float32 that NumPy would round the Python float to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mila_py.devices.device import DeviceType
from mila_py.ops.cuda import _kernels
from mila_py.ops.operation import FusedAdamW
from mila_py.ops.registry import register_op
from mila_py.precision import Precision

__all__ = ["ADAMW_CUDA_SOURCE", "CudaAdamWOp"]

ADAMW_CUDA_SOURCE = r"""
extern "C" __global__ void adamw_step(
    float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
    float* __restrict__ v, long long n, int decays, float decay, float beta1,
    float one_minus_beta1, float beta2, float one_minus_beta2, float correction2_sqrt, float eps,
    float step_size)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float gi = g[i];
        float pi = p[i];
        if (decays) {
            pi = __fmul_rn(pi, decay);
        }
        const float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(one_minus_beta1, gi));
        const float vi = __fadd_rn(
            __fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_minus_beta2, gi), gi));
        const float denom = __fadd_rn(__fdiv_rn(sqrtf(vi), correction2_sqrt), eps);
        p[i] = __fsub_rn(pi, __fmul_rn(step_size, __fdiv_rn(mi, denom)));
        m[i] = mi;
        v[i] = vi;
    }
}
"""


@register_op("AdamWOp", DeviceType.CUDA, precisions=(Precision.FP32,))
class CudaAdamWOp(FusedAdamW):
    """The fused AdamW update of one parameter: one kernel launch (see :class:`FusedAdamW`)."""

    def _update(
        self, p: Any, g: Any, m: Any, v: Any, decays: bool, scalars: tuple[Any, ...]
    ) -> None:
        n = int(p.size)
        args = (p, g, m, v, np.int64(n), np.int32(decays), *scalars)
        ctx: Any = self.context
        with ctx.activate():
            _kernels.launch(
                ctx, ADAMW_CUDA_SOURCE, "adamw_step", _kernels.grid_1d(n), _kernels.THREADS, args
            )
