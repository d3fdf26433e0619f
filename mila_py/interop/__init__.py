"""Interop with Hugging Face: ``config.json`` and safetensors checkpoints (:mod:`.hf`), the
RoPE families and per-class defaults of ``config.json`` (:mod:`.hf_rope`,
:mod:`.hf_rope_defaults`), tokenizers (:mod:`.tokenizer`), chat templates (:mod:`.chat_template`)
and generation defaults (:mod:`.generation_config`).

The top of the model stack: interop imports models, components and the layers below them;
none of those imports interop, except :meth:`mila_py.models.Llama.from_pretrained`, which reads
a checkpoint through :mod:`mila_py.interop.hf` from inside the method. The modules here are
attributes of this package, imported on first access (``mila_py.interop.hf`` after
``import mila_py``), as the subpackages of :mod:`mila_py` are.
"""

from __future__ import annotations

from mila_py._lazy import lazy_submodules
from mila_py.interop.chat_template import ChatTemplateError, render_chat_template
from mila_py.interop.generation_config import GenerationDefaults
from mila_py.interop.tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "ChatTemplateError",
    "GenerationDefaults",
    "StreamDecoder",
    "Tokenizer",
    "render_chat_template",
]

__getattr__, __dir__ = lazy_submodules(__name__, __path__, lambda: globals())
