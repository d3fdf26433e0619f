"""Components: one module per component and its config."""

from __future__ import annotations

from mila_py.components.attention import AttentionConfig, GroupedQueryAttention
from mila_py.components.linear import Linear, LinearConfig
from mila_py.components.llama import Llama, LlamaBlock, LlamaConfig
from mila_py.components.residual import Residual, ResidualConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.rope import Rope
from mila_py.components.rope_config import RopeConfig, RopeLayout
from mila_py.components.rope_scaling import RopeType, register_rope_type, registered_rope_types
from mila_py.components.rope_table import RopeTable, clear_rope_cache, get_rope
from mila_py.components.softmax_cross_entropy import (
    SoftmaxCrossEntropy,
    SoftmaxCrossEntropyConfig,
)
from mila_py.components.swiglu import SwiGLU, SwiGLUConfig
from mila_py.components.token_embedding import TokenEmbedding, TokenEmbeddingConfig

__all__ = [
    "AttentionConfig",
    "GroupedQueryAttention",
    "Linear",
    "LinearConfig",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
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
