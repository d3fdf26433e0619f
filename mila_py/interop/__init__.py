"""Hugging Face interop: tokenizers, chat templates and generation defaults of checkpoints."""

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
