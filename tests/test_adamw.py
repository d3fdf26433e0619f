"""AdamW's CUDA op (the fused update kernel) against the array code of the update: the op
alone, and the optimizer over a CUDA Linear with the op and without it."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import EMULATED, close, dev, host
from layer_helpers import f32

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Linear, LinearConfig
from mila_py.ops.registry import create_op
from mila_py.optim import AdamW


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


def test_the_optimizer_with_the_cuda_op_equals_the_array_code(cuda_device: str) -> None:
    """Three steps of two AdamW over two equal CUDA Linears, one through the fused op and one
    through the array code: the same parameters and moments (bit for bit on the kernel
    emulator, where both do the same IEEE operations in the same order; to float32 roundings on
    a GPU, whose compilers may contract a product and a sum into one FMA)."""
    models = []
    for _ in range(2):
        lin = Linear("lin", LinearConfig(9, 5, bias=True), device=cuda_device)
        lin.build(BuildContext((2, 9), RuntimeMode.TRAINING))
        models.append(lin)
    plain = AdamW(models[0], lr=3e-3, weight_decay=0.1)
    fused = AdamW(models[1], lr=3e-3, weight_decay=0.1)
    assert fused._fused is not None
    plain._fused = None  # the array code, the reference
    for step in range(3):
        for model in models:
            for (_, g), seed in zip(model.named_gradients(), range(10), strict=False):
                g[...] = dev(f32(np.random.default_rng(step * 10 + seed), *g.shape))
        plain.step()
        fused.step()
    pairs = [
        (a, b)
        for (_, a), (_, b) in zip(
            models[0].named_parameters(), models[1].named_parameters(), strict=True
        )
    ]
    pairs += list(zip(plain._m + plain._v, fused._m + fused._v, strict=True))
    for a, b in pairs:
        if EMULATED:
            np.testing.assert_array_equal(host(b), host(a))
        else:
            close(b, host(a), rtol=1e-6, atol=1e-7)
    if EMULATED:
        assert fused._fused.context.launches == ["adamw_step"] * 6
