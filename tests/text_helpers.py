"""A tiny chat model folder for the text, CLI and server tests, trained on nothing: a random
Llama whose vocabulary is a byte-level BPE tokenizer trained here on a short text, saved as a
Hugging Face folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML template, ``generation_config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizer_helpers import byte_level_tokenizer

from mila_py import BuildContext, RuntimeMode
from mila_py.interop import Tokenizer
from mila_py.interop.hf import save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig

#: a ChatML template: one block per message, then the assistant's header
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "<|im_end|>"
CONTEXT = 192


def make_model_folder(folder: Path, *, seed: int = 0, eos: bool = True) -> Path:
    """Write the tiny model into ``folder``. Its weights are random (``seed``) and scaled up
    so that each step's most likely token leads clearly (greedy choices then do not hang on
    rounding). With ``eos``, ``generation_config.json`` names the end-of-turn token as EOS.
    """
    backend = byte_level_tokenizer(vocab_size=400)
    tok = Tokenizer(
        backend, bos_token="<|begin_of_text|>", eos_token=EOS, chat_template=CHAT_TEMPLATE
    )
    cfg = LlamaConfig(
        vocab_size=len(tok), dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
        max_seq_len=CONTEXT,
    )  # fmt: skip
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING, initialize_parameters=False))
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight" or "_norm." in name:
            p[...] = 1.0
        else:
            p[...] = rng.normal(0.0, 1.0 / np.sqrt(p.shape[-1]), p.shape) * _scale(name)
    save_hf_checkpoint(model, folder)
    tok.save_pretrained(folder)
    generation: dict[str, Any] = {"do_sample": False}
    if eos:
        generation["eos_token_id"] = tok.token_to_id(EOS)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def _scale(name: str) -> float:
    return 4.0 if name.startswith("embed_tokens") or name.startswith("lm_head") else 1.0
