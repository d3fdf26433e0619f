"""Small tokenizers built with the ``tokenizers`` trainers, in the two layouts Llama-family
checkpoints use, written as Hugging Face tokenizer folders for the tokenizer tests.

- ``byte_level``: a byte-level BPE like GPT-2 and Llama 3 (every byte is a symbol, spaces are
  ``Ġ``), with Llama 3's split pattern, its special tokens and a BOS post-processor.
- ``sentencepiece``: a BPE with byte fallback and the ``▁`` metaspace, laid out as transformers'
  ``LlamaConverter`` lays out Llama 2 (``<unk>``, ``<s>``, ``</s>``, then the 256 ``<0xXX>`` byte
  pieces, then the merged pieces), with the BOS post-processor of Llama 2's ``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

#: training text: mostly English, with a little CJK and emoji so some of them merge and the rest
#: falls back to bytes
CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "It's a lovely day; isn't it? Yes -- it is!",
    "Numbers 12345 and 3.14159 and 2024-01-01.",
    "你好，世界！我们在测试。",
    "日本語のテキストです。",
    "emoji 😀 🎉 👍 test",
    "  spaces   and\ttabs\nnew lines  ",
] * 40

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]


def byte_level_tokenizer(vocab_size: int = 600) -> Tokenizer:
    """A Llama-3-style byte-level BPE: BOS ``<|begin_of_text|>`` added by its post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in BYTE_LEVEL_SPECIALS]
    )
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )
    return tok


def sentencepiece_tokenizer(vocab_size: int = 500, *, legacy: bool = False) -> Tokenizer:
    """A Llama-2-style BPE with byte fallback: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the byte pieces
    ``<0x00>``.. ``<0xFF>`` 3..258, then the trained pieces. ``legacy`` lays the metaspace out as
    transformers' legacy converter did (a normalizer that prepends ``▁`` and replaces spaces);
    otherwise as its current one (a ``Metaspace`` pre-tokenizer, ``prepend_scheme="first"``)."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=70,
        show_progress=False,
    )
    trained = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # trained on words (split=True), as SentencePiece learns pieces; run without splitting
    trained.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=True
    )
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    if legacy:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def write_folder(
    folder: Path, tok: Tokenizer, config: dict[str, Any], *, post_processor: bool = True
) -> Path:
    """``tokenizer.json`` (without its post-processor where ``post_processor`` is False) and
    ``tokenizer_config.json`` (``config``, read by transformers as a plain fast tokenizer)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(tok.to_str())
    if not post_processor:
        data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False), encoding="utf-8"
    )
    return folder
