"""mila_py end to end: train a small Llama, then serve it with a KV cache.

1. TRAINING build of a byte-level Llama; a short AdamW run on the Python standard library's own
   source (or ``--data PATH``), with a progress bar.
2. EVAL mode: the held-out loss, without touching gradients.
3. An INFERENCE build with the trained weights (saved and loaded through safetensors): chunked
   prefill of a prompt, then token-by-token decode; prints the text and decode tokens/s.
4. The memory tables of both builds, side by side, and the predicted inference footprint.
5. The trained model saved as a Hugging Face folder (``--out``, default ``./mila-demo``) with a
   byte-level tokenizer (``tokenizer.json``: id i is byte i, as the model was trained), a
   minimal chat template and the sampling settings used above, ready for
   ``mila-py chat ./mila-demo`` and ``mila-py serve ./mila-demo``.

Run: ``python examples/train_and_generate.py`` (under a minute on 2 CPU cores; ``--help``).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import build_or_exit, check_positive, load_corpus, prepare

from mila_py import BuildContext, RuntimeMode
from mila_py.files import atomic_write
from mila_py.interop import Tokenizer
from mila_py.interop.hf import save_hf_checkpoint
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, ConstantSchedule
from mila_py.train import evaluate, train


def side_by_side(left: str, right: str, titles: tuple[str, str]) -> str:
    a, b = left.splitlines(), right.splitlines()
    width = max(len(line) for line in a)
    rows = [f"{titles[0]:<{width}}    {titles[1]}"]
    rows += [f"{x:<{width}}    {y}" for x, y in zip(a, b, strict=True)]
    return "\n".join(rows)


#: the sampling of the generation step, saved as the folder's generation defaults
TEMPERATURE, TOP_K = 0.8, 40
#: a minimal chat template: each turn a Python comment, which a model of Python source continues
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}"
)


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer whose id i is byte i (the model's vocabulary): a BPE without
    merges over the 256 symbols of the byte-level alphabet (GPT-2's: printable bytes stand for
    themselves, the others for the characters from U+0100 on), with its pre-tokenizer and
    decoder."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    symbol_of = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    assert sorted(symbol_of.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={s: b for b, s in symbol_of.items()}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, chat_template=CHAT_TEMPLATE)


def save_demo(model: Llama, folder: str, temperature: float, top_k: int, new_tokens: int) -> None:
    """``model`` as a Hugging Face folder with the byte tokenizer, the chat template and the
    sampling settings as ``generation_config.json``."""
    save_hf_checkpoint(model, folder)
    byte_tokenizer().save_pretrained(folder)
    settings = {
        "do_sample": True,
        "temperature": temperature,
        "top_k": top_k,
        "max_new_tokens": new_tokens,
    }
    text = json.dumps(settings, indent=2) + "\n"
    atomic_write(
        Path(folder) / "generation_config.json", lambda p: p.write_text(text), who="save_demo"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", help="a text file (default: the Python standard library source)")
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (%(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (%(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (%(default)s)")
    parser.add_argument("--prompt", default="def __init__(self", help="text to continue")
    parser.add_argument(
        "--new-tokens", type=int, default=120, help="bytes to generate (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="batches and sampling (%(default)s)")
    parser.add_argument(
        "--out", default="mila-demo", help="the Hugging Face folder to save (%(default)s)"
    )
    args = parser.parse_args()
    context = 512  # the model's max_seq_len: the INFERENCE build's KV cache
    check_positive(parser, args, "steps", "batch", "seq")
    if not 1 <= args.seq <= context:
        parser.error(f"--seq must be in [1, {context}], got {args.seq}")
    prompt_bytes = os.fsencode(args.prompt)  # the bytes as given, whatever their encoding
    if not 1 <= len(prompt_bytes) <= context:
        parser.error(f"--prompt must have 1 to {context} bytes, got {len(prompt_bytes)}")
    room = context - len(prompt_bytes) + 1
    if not 0 <= args.new_tokens <= room:
        parser.error(f"--new-tokens must be in [0, {room}] for this prompt, got {args.new_tokens}")

    corpus = load_corpus(args.data, 4_000_000)
    work = tempfile.TemporaryDirectory()
    train_data, held_out = prepare(corpus, None, Path(work.name), args.seq, args.batch, args.seed)
    cfg = LlamaConfig(
        vocab_size=256,
        dim=128,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=384,
        max_seq_len=context,
    )

    # 1. train
    train_ctx = BuildContext((args.batch, args.seq), RuntimeMode.TRAINING)

    def build() -> Llama:
        model = Llama("llama", cfg, device=args.device)
        model.build(train_ctx)
        return model

    model = build_or_exit(parser, build)
    opt = AdamW(model, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"Llama: {model.parameter_count():,} parameters; corpus {len(corpus):,} bytes")
    # warmup over 30 steps, clipping (a step whose gradients hold inf or NaN is skipped)
    train(model, opt, train_data, steps=args.steps, clip=1.0, schedule=ConstantSchedule(opt, 30))

    # 2. evaluate in EVAL mode (evaluate switches the model to EVAL and back)
    print(
        f"held-out loss after {args.steps} steps: {evaluate(model, held_out, 4):.3f} "
        f"(uniform guess: {np.log(256):.3f})"
    )
    work.cleanup()

    # 3. serve: an INFERENCE build with the trained weights
    infer_ctx = BuildContext((1, cfg.max_seq_len), RuntimeMode.INFERENCE, prefill_size=64)
    server = Llama("llama", cfg, device=args.device)
    predicted = server.required_memory(infer_ctx)
    server.build(infer_ctx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama.safetensors")
        model.save(path)
        server.load(path)
    prompt = np.frombuffer(prompt_bytes, dtype=np.uint8).astype(np.int64)
    server.generate(prompt, 1)  # warm-up: first-call costs (compiled kernels, plans) untimed
    print(f"\nprompt {args.prompt!r}, chunked prefill (chunks of {server.chunk_size}) + decode:\n")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # characters span bytes
    sys.stdout.write(text.decode(prompt_bytes))
    generated = []
    start = time.perf_counter()
    for token in server.stream(
        prompt, max_new_tokens=args.new_tokens, temperature=TEMPERATURE, top_k=TOP_K, seed=args.seed
    ):
        generated.append(int(token[0]))
        sys.stdout.write(text.decode(bytes([generated[-1]])))
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write(text.decode(b"", final=True))
    rate = f"{len(generated) / elapsed:,.0f} tokens/s" if generated else "nothing asked for"
    print(f"\n\n{len(generated)} tokens in {elapsed:.2f} s: {rate} (prefill included)")
    steps = 200
    token = np.array([generated[-1] if generated else 32])
    # on from the cached text (rewound if the context has no room for the steps)
    first = min(server.cached_lengths[0], server.context_length - steps)
    start = time.perf_counter()
    for i in range(steps):
        server.decode(token, first + i)
    print(f"decode alone: {steps / (time.perf_counter() - start):,.0f} tokens/s")

    # 4. memory of both builds
    print("\nmemory of the two builds of the same model:")
    print(
        side_by_side(
            str(model.get_memory_stats()),
            str(server.get_memory_stats()),
            (f"TRAINING {train_ctx.input_shape}", f"INFERENCE {infer_ctx.input_shape}"),
        )
    )
    print(
        f"\nrequired_memory(INFERENCE) predicted before building: {predicted.total_bytes:,} bytes; "
        f"after building: {server.get_memory_stats().total_bytes:,} bytes"
    )

    # 5. save as a Hugging Face folder, with a tokenizer, for mila-py chat / serve
    save_demo(server, args.out, TEMPERATURE, TOP_K, max(args.new_tokens, 1))
    print(
        f"\nsaved to {args.out} (safetensors, byte-level tokenizer.json, chat template); try:\n"
        f"  mila-py chat {args.out}\n  mila-py serve {args.out}"
    )


if __name__ == "__main__":
    main()
