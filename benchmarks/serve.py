"""Serving overhead: the OpenAI-compatible server against ``model.stream_text`` on the same
model and prompt, in one run.

- direct: ``model.stream_text(prompt, temperature=0)`` in this process;
- server: ``mila-py serve`` on the same folder, in its own process on 127.0.0.1, read with the
  official ``openai`` client (``completions.create(stream=True)``) from this process.

Each side times the first text piece after the call (time to first token: the prompt's
prefill, the first decode step and, for the server, the request, the queue and the first
server-sent event) and the time per output token after it ((end - first piece) / (tokens - 1),
tokens counted by the generation: ``completion_tokens``). Both are greedy on the same prompt, so
they generate the same text (checked, round by round). The server's times include the
client's own reading and parsing of each event, as a user of the client feels them. Each side
has one warm-up call, then ``--repeat`` rounds, each timing both sides, which goes first
alternating from round to round; the medians count.

The models: ``--model DIR`` (a Hugging Face folder with ``tokenizer.json``), or random Llamas
of ``--sizes`` (those of ``benchmarks/generate.py``, default ~10M and ~100M), each with a
byte-level BPE of the size's vocabulary trained here on mila_py's own source (nothing is
downloaded). A larger model's slower tokens show the server's fixed cost per event smaller.

Needs the ``serve`` extra and ``openai``. Run: ``python benchmarks/serve.py [--device CUDA:0]
[--sizes ~10M ~100M]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from generate import CPU_SIZES, SIZES  # the sibling script: the same models

ROOT = Path(__file__).resolve().parents[1]
PROMPT = (
    "A component is constructed, given an execution context once, built once for one input "
    "shape and one runtime mode, and then run. Construction validates the config and "
    "allocates nothing; build allocates everything the component will use."
)

#: one side's figures: (seconds to the first text, seconds per token after it, text, tokens)
Times = tuple[float, float, str, int]


def random_model(folder: Path, device: str, size: str) -> None:
    """A random Llama of ``SIZES[size]`` with a byte-level BPE of mila_py's source, saved."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from mila_py import BuildContext, RuntimeMode
    from mila_py.interop import Tokenizer
    from mila_py.interop.hf import save_hf_checkpoint
    from mila_py.models import Llama, LlamaConfig

    spec = SIZES[size]
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "mila_py").rglob("*.py"))]
    trainer = trainers.BpeTrainer(
        vocab_size=spec["vocab_size"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    tokenizer = Tokenizer(backend)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), dim=spec["hidden_size"], n_layers=spec["num_hidden_layers"],
        n_heads=spec["num_attention_heads"], n_kv_heads=spec["num_key_value_heads"],
        hidden_dim=spec["intermediate_size"], max_seq_len=1024,
        tie_embeddings=spec["tie_word_embeddings"],
    )  # fmt: skip
    model = Llama("llama", cfg, device=device)
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    save_hf_checkpoint(model, folder)
    tokenizer.save_pretrained(folder)


def time_direct(model: Any, new: int) -> Times:
    """(seconds to the first piece, seconds per token after it, text, tokens)."""
    start = time.perf_counter()
    first = None
    pieces = []
    stream = model.stream_text(PROMPT, max_new_tokens=new, temperature=0)
    for piece in stream:
        if first is None:
            first = time.perf_counter() - start
        pieces.append(piece)
    total = time.perf_counter() - start
    tokens = stream.completion_tokens
    assert first is not None, "no text was generated"
    return first, (total - first) / max(tokens - 1, 1), "".join(pieces), tokens


def time_server(client: Any, name: str, new: int) -> Times:
    """As :func:`time_direct`, through the server and the openai client."""
    start = time.perf_counter()
    first = None
    pieces = []
    tokens = 0
    chunks = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=new, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            if first is None:
                first = time.perf_counter() - start
            pieces.append(chunk.choices[0].text)
    total = time.perf_counter() - start
    assert first is not None, "no text was generated"
    return first, (total - first) / max(tokens - 1, 1), "".join(pieces), tokens


def start_server(folder: Path, device: str, name: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mila_py", "serve", str(folder), "--port", str(port),
               "--device", device, "--model-name", name]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=5) as response:
                json.loads(response.read())
            return server, url
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                err = server.stderr.read().decode() if server.stderr else ""
                sys.exit(f"mila-py serve did not start: {err}")
            time.sleep(0.2)


def measure(
    folder: Path, device: str, new: int, repeat: int
) -> tuple[Any, list[Times], list[Times]]:
    """(the model, the direct side's rounds, the server's rounds) for the model in ``folder``."""
    import openai

    from mila_py.models import Llama

    model = Llama.from_pretrained(folder, device=device)
    name = "bench"
    server, url = start_server(folder, device, name)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        sides = [lambda: time_direct(model, new), lambda: time_server(client, name, new)]
        for side in sides:  # warm-up: compiled kernels, plans, connections
            side()
        direct, served = [], []
        for r in range(repeat):
            # the side that goes second may find the other's threads still spinning down
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                (direct, served)[i].append(sides[i]())
    finally:
        server.terminate()
        server.wait(timeout=60)
    for d, s in zip(direct, served, strict=True):
        if d[2] != s[2]:
            sys.exit(f"the server's text differs from stream_text's: {s[2]!r} vs {d[2]!r}")
    return model, direct, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder with tokenizer.json")
    parser.add_argument(
        "--sizes", nargs="*", default=list(CPU_SIZES), choices=list(SIZES),
        help="random models of benchmarks/generate.py's sizes (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds (default: %(default)s)")
    args = parser.parse_args()

    print("| model | what | stream_text ms | server ms | server / stream_text |")
    print("| --- | --- | ---: | ---: | ---: |")
    notes = []
    for size in [None] if args.model else args.sizes:
        with tempfile.TemporaryDirectory() as work:
            folder = Path(args.model) if size is None else Path(work) / "model"
            if size is not None:
                random_model(folder, args.device, size)
            model, direct, served = measure(folder, args.device, args.new_tokens, args.repeat)
        label = f"{size or folder.name} ({model.parameter_count() / 1e6:.1f}M)"
        notes.append(
            f"{label}: prompt {len(model.tokenizer.encode(PROMPT))} tokens, "
            f"{direct[0][3]} new tokens (greedy)"
        )
        for what, i in (("time to first token", 0), ("time per output token", 1)):
            a = statistics.median(d[i] for d in direct) * 1e3
            b = statistics.median(s[i] for s in served) * 1e3
            print(f"| {label} | {what} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)
    print(f"\n{args.device}; median of {args.repeat} rounds; " + "; ".join(notes))


if __name__ == "__main__":
    main()
