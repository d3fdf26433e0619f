"""Models built from mila_py's components: the Llama-style decoder (:mod:`.llama`) and the
generation loops its ``generate`` and ``stream`` run (:mod:`.generation`), and the sampling
processors (:mod:`.sampling`)."""

from __future__ import annotations

from mila_py.models.llama import Llama, LlamaBlock, LlamaConfig

__all__ = ["Llama", "LlamaBlock", "LlamaConfig"]
