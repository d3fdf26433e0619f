"""Shared helpers of the Rope tests: building components, random inputs, tolerances, backends."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from rope_reference import Spec

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.ops.cpu import _rope_fused

FP32, FP16, BF16 = Precision.FP32, Precision.FP16, Precision.BF16
PRECISIONS = (FP32, FP16, BF16)
TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE

#: the two CPU paths every correctness case runs on
BACKEND_PARAMS = [
    "numpy",
    pytest.param(
        "fused",
        marks=pytest.mark.skipif(not _rope_fused.AVAILABLE, reason="Numba is not installed"),
    ),
]

#: (rtol, atol) against the float64 reference. FP32: table rounding plus a few fp32 operations.
#: FP16/BF16: one rounding of the fp32 result, at most half an ulp = 2^-11 / 2^-8 relative.
TOLERANCES: dict[Precision, tuple[float, float]] = {
    FP32: (2e-6, 2e-6),
    FP16: (2.0**-11 * 1.01, 2e-6),
    BF16: (2.0**-8 * 1.01, 2e-6),
}


def dtype_of(precision: Precision) -> np.dtype:
    return {
        FP32: np.dtype(np.float32),
        FP16: np.dtype(np.float16),
        BF16: np.dtype(ml_dtypes.bfloat16),
    }[precision]


def rope_config(
    heads: tuple[int, int] = (3, 1),
    head_dim: int = 12,
    *,
    max_seq_len: int = 2048,
    **kwargs: Any,
) -> RopeConfig:
    """A RopeConfig from ``(n_heads, n_kv_heads)`` and ``head_dim`` (12 by default: not a power
    of two, n_freq = 6); other fields as keywords."""
    hq, hk = heads
    return RopeConfig(
        channels=hq * head_dim, n_heads=hq, n_kv_heads=hk, max_seq_len=max_seq_len, **kwargs
    )


def make_rope(
    config: RopeConfig,
    batch: int,
    tokens: int,
    *,
    mode: RuntimeMode = INFERENCE,
    precision: Precision = FP32,
    backend: str | None = None,
    name: str = "rope",
    device: str = "CPU",
) -> Rope:
    """A standalone Rope built for ``[batch, tokens, channels]`` (on the CPU by default)."""
    rope = Rope(name, config, device=device, precision=precision)
    if backend is not None:
        rope.op.backend = backend
    rope.build(BuildContext((batch, tokens, config.channels), mode))
    return rope


def random_qk(
    rng: np.random.Generator,
    config: RopeConfig,
    batch: int,
    tokens: int,
    precision: Precision = FP32,
) -> tuple[np.ndarray, np.ndarray]:
    """Random Q and K of the component's dtype (standard normal, asymmetric)."""
    head_dim = config.channels // config.n_heads
    dt = dtype_of(precision)
    q = rng.standard_normal((batch, tokens, config.n_heads * head_dim)).astype(dt)
    k = rng.standard_normal((batch, tokens, config.n_kv_heads * head_dim)).astype(dt)
    return q, k


def f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def assert_close(actual: Any, expected: Any, precision: Precision, *, scale: float = 1.0) -> None:
    """``actual`` (component dtype) against a float64 reference with precision-keyed tolerances."""
    rtol, atol = TOLERANCES[precision]
    np.testing.assert_allclose(f64(actual), expected, rtol=rtol, atol=atol * scale)


def reference(
    config: RopeConfig, q: Any, k: Any, positions: Any, *, inverse: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference of one call at ``positions`` (broadcast to ``[B, T]``)."""
    return Spec.of(config).rotate_qk(f64(q), f64(k), positions, inverse=inverse)


def arange_positions(batch: int, tokens: int, offset: int = 0) -> np.ndarray:
    return np.broadcast_to(np.arange(offset, offset + tokens), (batch, tokens))
