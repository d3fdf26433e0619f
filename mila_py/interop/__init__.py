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

import importlib
import pkgutil
from types import ModuleType

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


def __getattr__(name: str) -> ModuleType:
    """``mila_py.interop.<name>`` for a module not imported yet (PEP 562): imports and returns it.

    Raises:
        AttributeError: ``name`` is private or names no module of ``mila_py.interop``.
    """
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise  # the module exists but one of its own imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """This package's names and its public modules, imported or not (for completion)."""
    modules = (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return sorted({*globals(), *modules})
