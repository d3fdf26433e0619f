"""LlamaConfig: the frozen, validated shape of a Llama-style decoder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mila_py.components._layer import check_finite, check_sizes, is_bool
from mila_py.components.attention import AttentionConfig

__all__ = ["LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder.

    Args:
        vocab_size, dim, n_layers, n_heads, n_kv_heads, hidden_dim (SwiGLU width), max_seq_len.
        rope_base, rope_scaling: RoPE theta and a Hugging Face scaling dict (or None).
        norm_eps: RMSNorm epsilon. tie_embeddings: the output head reuses the embedding matrix.
        head_dim: per-head width (default ``dim // n_heads``).
        qkv_bias, out_bias: biases on the attention's QKV and output projections (Qwen2 has the
            first; Hugging Face Llama's ``attention_bias`` means both).
        qk_norm: RMS-normalize each head of Q and K before RoPE (Qwen3), with ``norm_eps``.
        mlp_bias: biases on the SwiGLU projections (Hugging Face Llama's ``mlp_bias``).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    max_seq_len: int
    rope_base: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_sizes(self, "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim")
        for name in ("tie_embeddings", "qkv_bias", "out_bias", "qk_norm", "mlp_bias"):
            if not is_bool(getattr(self, name)):
                raise TypeError(f"LlamaConfig: {name} must be a bool, got {getattr(self, name)!r}")
        check_finite(self, "norm_eps", positive=True)
        self.attention_config()

    def attention_config(self) -> AttentionConfig:
        return AttentionConfig(
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            max_seq_len=self.max_seq_len,
            head_dim=self.head_dim,
            rope_base=self.rope_base,
            rope_scaling=self.rope_scaling,
            qkv_bias=self.qkv_bias,
            out_bias=self.out_bias,
            qk_norm=self.qk_norm,
            qk_norm_eps=self.norm_eps,
        )
