"""Components: one module per layer and its config.

The RoPE config names (from :mod:`mila_py.rope`) are re-exported here for convenience; the
models built from these components live in :mod:`mila_py.models`.
"""

from __future__ import annotations

from mila_py.components.attention import AttentionConfig, GroupedQueryAttention
from mila_py.components.linear import Linear, LinearConfig
from mila_py.components.residual import Residual, ResidualConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.rope import Rope
from mila_py.components.softmax_cross_entropy import (
    SoftmaxCrossEntropy,
    SoftmaxCrossEntropyConfig,
)
from mila_py.components.swiglu import SwiGLU, SwiGLUConfig
from mila_py.components.token_embedding import TokenEmbedding, TokenEmbeddingConfig
from mila_py.rope import (
    RopeConfig,
    RopeLayout,
    RopeTable,
    RopeType,
    clear_rope_cache,
    get_rope,
    register_rope_type,
    registered_rope_types,
)

__all__ = [
    "AttentionConfig",
    "GroupedQueryAttention",
    "Linear",
    "LinearConfig",
    "Residual",
    "ResidualConfig",
    "RmsNorm",
    "RmsNormConfig",
    "Rope",
    "RopeConfig",
    "RopeLayout",
    "RopeTable",
    "RopeType",
    "SoftmaxCrossEntropy",
    "SoftmaxCrossEntropyConfig",
    "SwiGLU",
    "SwiGLUConfig",
    "TokenEmbedding",
    "TokenEmbeddingConfig",
    "clear_rope_cache",
    "get_rope",
    "register_rope_type",
    "registered_rope_types",
]
