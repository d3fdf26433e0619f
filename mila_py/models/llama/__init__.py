"""The Llama-style decoder: :class:`LlamaConfig` (its shape), :class:`LlamaBlock` (one
pre-norm decoder block) and :class:`Llama` (the network: build, forward, backward, prefill,
decode, generation, Hugging Face loading)."""

from __future__ import annotations

from mila_py.models.llama.block import LlamaBlock
from mila_py.models.llama.config import LlamaConfig
from mila_py.models.llama.network import Llama

__all__ = ["Llama", "LlamaBlock", "LlamaConfig"]
