"""LlamaBlock and the Llama network: a decoder built from mila_py components.

Tree (names follow the component tree, dotted in ``named_parameters`` and safetensors files)::

    Llama
      embed_tokens              TokenEmbedding   [vocab, dim]
      layer0 .. layer{N-1}      LlamaBlock
        input_layernorm         RmsNorm
        self_attn               GroupedQueryAttention (qkv_proj, rope, o_proj)
        post_attention_layernorm RmsNorm
        mlp                     SwiGLU (gate_proj, up_proj, down_proj)
      norm                      RmsNorm
      lm_head                   Linear [vocab, dim]   (absent with tie_embeddings)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mila_py.build_context import BuildContext
from mila_py.components.attention import AttentionConfig, GroupedQueryAttention
from mila_py.components.linear import Linear, LinearConfig
from mila_py.components.rms_norm import RmsNorm, RmsNormConfig
from mila_py.components.swiglu import SwiGLU, SwiGLUConfig
from mila_py.components.token_embedding import TokenEmbedding, TokenEmbeddingConfig
from mila_py.composite import CompositeComponent, Network
from mila_py.devices import DeviceLike
from mila_py.precision import Precision

__all__ = ["Llama", "LlamaBlock", "LlamaConfig"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder.

    Args:
        vocab_size, dim, n_layers, n_heads, n_kv_heads, hidden_dim (SwiGLU width), max_seq_len.
        rope_base, rope_scaling: RoPE theta and a Hugging Face scaling dict (or None).
        norm_eps: RMSNorm epsilon. tie_embeddings: the output head reuses the embedding matrix.
        head_dim: per-head width (default ``dim // n_heads``).
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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive int, got {value!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"LlamaConfig: norm_eps must be > 0, got {self.norm_eps!r}")
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
        )


class LlamaBlock(CompositeComponent):
    """Pre-norm decoder block: ``h = x + attn(norm1(x))``, ``y = h + mlp(norm2(h))``."""

    def __init__(
        self,
        name: str,
        config: LlamaConfig,
        *,
        device: DeviceLike | None = None,
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        self.config = config
        self.input_layernorm = RmsNorm(
            "input_layernorm", RmsNormConfig(config.dim, config.norm_eps), precision=precision
        )
        self.self_attn = GroupedQueryAttention(
            "self_attn", config.attention_config(), precision=precision
        )
        self.post_attention_layernorm = RmsNorm(
            "post_attention_layernorm",
            RmsNormConfig(config.dim, config.norm_eps),
            precision=precision,
        )
        self.mlp = SwiGLU("mlp", SwiGLUConfig(config.dim, config.hidden_dim), precision=precision)
        for child in (
            self.input_layernorm,
            self.self_attn,
            self.post_attention_layernorm,
            self.mlp,
        ):
            self.add_component(child)

    def _on_building(self, build_context: BuildContext) -> None:
        shape = build_context.input_shape
        if len(shape) != 3 or shape[2] != self.config.dim:
            raise ValueError(
                f"{self._describe()}: build shape must be [B, T, dim={self.config.dim}], got {shape}"
            )
        super()._on_building(build_context)
        self._add_state("hidden", self._allocate(shape))
        self._add_state("output", self._allocate(shape))
        if build_context.is_training:
            self._add_state("dhidden", self._allocate(shape))
            self._add_state("dinput", self._allocate(shape))

    def forward(self, x: Any) -> Any:
        """``x [B, T, dim] -> [B, T, dim]`` (a view of the block's output buffer)."""
        xp = self.execution_context.xp
        n_b, n_t = x.shape[0], x.shape[1]
        h = self._state["hidden"][:n_b, :n_t]
        xp.add(x, self.self_attn.forward(self.input_layernorm.forward(x)), out=h)
        out = self._state["output"][:n_b, :n_t]
        xp.add(h, self.mlp.forward(self.post_attention_layernorm.forward(h)), out=out)
        return out

    def backward(self, dy: Any) -> Any:
        """``dy [B, T, dim] -> dx [B, T, dim]``; accumulates every parameter gradient."""
        xp = self.execution_context.xp
        n_b, n_t = dy.shape[0], dy.shape[1]
        dh = self._state["dhidden"][:n_b, :n_t]
        xp.add(dy, self.post_attention_layernorm.backward(self.mlp.backward(dy)), out=dh)
        dx = self._state["dinput"][:n_b, :n_t]
        xp.add(dh, self.input_layernorm.backward(self.self_attn.backward(dh)), out=dx)
        return dx


class Llama(Network):
    """A Llama-style decoder network that owns its execution context.

    ``build(BuildContext((B, T), mode))`` takes the token shape. ``forward(tokens [B, T] int)``
    returns logits ``[B, T, vocab]``; ``backward(dlogits)`` fills every parameter gradient
    (aligned with ``get_parameters()``).
    """

    def __init__(
        self,
        name: str,
        config: LlamaConfig,
        *,
        device: DeviceLike = "CPU",
        precision: Precision = Precision.FP32,
    ) -> None:
        super().__init__(name, device=device, precision=precision)
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"{name}: config must be a LlamaConfig, got {config!r}")
        self.config = config
        self.embed_tokens = TokenEmbedding(
            "embed_tokens", TokenEmbeddingConfig(config.vocab_size, config.dim), precision=precision
        )
        self.add_component(self.embed_tokens)
        self.layers = [
            LlamaBlock(f"layer{i}", config, precision=precision) for i in range(config.n_layers)
        ]
        for block in self.layers:
            self.add_component(block)
        self.norm = RmsNorm("norm", RmsNormConfig(config.dim, config.norm_eps), precision=precision)
        self.add_component(self.norm)
        self.lm_head: Linear | None = None
        if not config.tie_embeddings:
            self.lm_head = Linear(
                "lm_head", LinearConfig(config.dim, config.vocab_size), precision=precision
            )
            self.add_component(self.lm_head)
        self._hidden: Any = None

    def _on_building(self, build_context: BuildContext) -> None:
        shape = build_context.input_shape
        if len(shape) != 2:
            raise ValueError(f"{self._describe()}: build shape must be tokens [B, T], got {shape}")
        n_b, n_t = shape
        if n_t > self.config.max_seq_len:
            raise ValueError(
                f"{self._describe()}: T = {n_t} exceeds max_seq_len = {self.config.max_seq_len}"
            )
        hidden = build_context.with_shape((n_b, n_t, self.config.dim))
        self.embed_tokens.build(build_context)
        for block in self.layers:
            block.build(hidden)
        self.norm.build(hidden)
        if self.lm_head is not None:
            self.lm_head.build(hidden)
        else:
            self._add_state("logits", self._allocate((n_b, n_t, self.config.vocab_size)))
            if build_context.is_training:
                self._add_state("dnorm", self._allocate((n_b, n_t, self.config.dim)))

    def forward(self, tokens: Any) -> Any:
        """``tokens [B, T] -> logits [B, T, vocab]`` (a view of an owned buffer)."""
        if not self.is_built:
            raise RuntimeError(f"{self._describe()}: forward() needs a built network")
        h = self.embed_tokens.forward(tokens)
        for block in self.layers:
            h = block.forward(h)
        h = self.norm.forward(h)
        if self.lm_head is not None:
            return self.lm_head.forward(h)
        self._hidden = h
        n_b, n_t = h.shape[0], h.shape[1]
        logits = self._state["logits"][:n_b, :n_t]
        weight = self.embed_tokens._parameters["weight"]  # [vocab, dim]
        self.execution_context.xp.matmul(h, weight.T, out=logits)
        return logits

    def backward(self, dlogits: Any) -> None:
        """Backpropagate ``dlogits [B, T, vocab]``; accumulates every parameter gradient."""
        if not self.is_built or not self.build_context.is_training:
            raise RuntimeError(f"{self._describe()}: backward() needs a TRAINING build")
        xp = self.execution_context.xp
        if self.lm_head is not None:
            dh = self.lm_head.backward(dlogits)
        else:
            if self._hidden is None:
                raise RuntimeError(f"{self._describe()}: backward() before forward()")
            h = self._hidden
            weight = self.embed_tokens._parameters["weight"]
            grad = self.embed_tokens._gradients["weight"]
            dim, vocab = self.config.dim, self.config.vocab_size
            grad += dlogits.reshape(-1, vocab).T @ h.reshape(-1, dim)
            n_b, n_t = h.shape[0], h.shape[1]
            dh = self._state["dnorm"][:n_b, :n_t]
            xp.matmul(dlogits, weight, out=dh)
        dh = self.norm.backward(dh)
        for block in reversed(self.layers):
            dh = block.backward(dh)
        self.embed_tokens.backward(dh)
