"""AdamW's CUDA op (the fused update kernel) against the array code of the update."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import close, dev
from layer_helpers import f32

from mila_py import Precision
from mila_py.ops.registry import create_op


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20260601)


# ------------------------------------------------------------------ CUDA op against the CPU op
def test_cuda_op_matches_the_array_code(cuda_ctx, rng) -> None:
    op = create_op("AdamWOp", cuda_ctx, None, Precision.FP32)
    p, g, m, v = (f32(rng, 33, 17) for _ in range(4))
    v = np.abs(v)
    gp, gg, gm, gv = dev(p), dev(g), dev(m), dev(v)
    lr, wd, b1, b2, eps, step = 1e-3, 0.1, 0.9, 0.95, 1e-8, 3
    c1, c2 = 1 - b1**step, 1 - b2**step
    op.step(gp, gg, gm, gv, decay=1 - lr * wd, betas=(b1, b2), correction2=c2, eps=eps,
            step_size=lr / c1)  # fmt: skip
    p *= 1.0 - lr * wd
    m *= b1
    m += (1.0 - b1) * g
    v *= b2
    v += (1.0 - b2) * (g * g)
    denom = np.sqrt(v / c2)
    denom += eps
    p -= lr / c1 * (m / denom)
    close(gm, m, rtol=1e-6, atol=0)
    close(gv, v, rtol=1e-6, atol=0)
    close(gp, p, rtol=1e-6, atol=0)
