"""Generation speed by storage precision: mila_py INFERENCE builds in fp32, bf16 and fp16 vs Hugging Face ``generate``.

For a ~10M and a ~100M parameter Llama (random weights saved by transformers and loaded with
``Llama.from_pretrained``), in one run, fp32 on the CPU or, with ``--device CUDA:0``, both on
that GPU; ``--precision bf16`` (or ``fp16``, or both) adds rows for those storage precisions,
each model and HF's converted from the same fp32 weights, and a column with each row's decode
tokens/s over the fp32 row's of the same size in the same run (fp32 is always measured):

- prefill tokens/s: a 256-token prompt (mila_py: ``prefill``; HF: one forward with its cache);
- decode tokens/s and ms per token: 64 greedy tokens after the prompt (mila_py: ``decode`` per
  token, the 64th included though its token is never used; HF: ``generate(max_new_tokens=64)``
  minus ``generate(max_new_tokens=1)`` in the same run, both greedy, over the 63 decode steps
  that separate them);
- a check that both produce the same greedy tokens;
- the weight-streaming floor of decode: the matrix-vector products of one token through every
  weight matrix of the model (the same arrays, nothing else; a packed SwiGLU's gate and up
  weights as the one product its decode step runs), timed in the same run. Decode of one
  sequence reads every weight once per token, so no fp32 implementation with these BLAS calls
  beats it. 16-bit rows on the CPU time the decode step's own products (the Numba kernels that
  read the 16-bit weights) the same way.

Each side runs once to warm caches and allocators, then ``--repeat`` times; the best run counts.

Needs torch and transformers (test-only references). Run: ``python benchmarks/generate_precision.py
[--device CUDA:0] [--precision bf16]`` (on a GPU, CuPy too; every timed region ends with a
device synchronize).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import tempfile
import time
from typing import Any

import numpy as np
from generate import CPU_SIZES, SIZES, decode_weights  # the sibling script: the same models

from mila_py import Precision, RuntimeMode
from mila_py.devices import DeviceId, DeviceType
from mila_py.models import Llama
from mila_py.ops.cpu import _fused_linear


def run_mila(model: Llama, prompt: np.ndarray, new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds per token, greedy tokens) of one mila_py generation.

    The greedy choice is made on the model's device; ``int()`` brings one id to the host per
    token, as a serving loop would.
    """
    start = time.perf_counter()
    logits = model.prefill(prompt)
    model.synchronize()
    prefill = time.perf_counter() - start
    tokens = []
    start = time.perf_counter()
    for i in range(new):
        token = logits.argmax(axis=-1)
        tokens.append(int(token[0]))
        logits = model.decode(token, prompt.shape[1] + i)
    model.synchronize()
    return prefill, (time.perf_counter() - start) / new, tokens


def gemv_floor(model: Llama, repeat: int) -> float:
    """Seconds of one row through every weight of :func:`decode_weights` (best of runs): BLAS
    (cuBLAS on a GPU) products, or on the CPU for 16-bit weights the decode step's own
    kernels."""
    weights = decode_weights(model)
    ctx = model.execution_context
    xp = ctx.xp
    activate = getattr(ctx, "activate", contextlib.nullcontext)
    with activate():  # on a GPU: its device and the model's stream
        rows = [xp.ones((1, w.shape[1]), w.dtype) for w in weights]
        outs = [xp.empty((1, w.shape[0]), w.dtype) for w in weights]
        if xp is np and model.precision.is_reduced:
            products = [
                _fused_linear.bind(x, w, None, y)
                for x, w, y in zip(rows, weights, outs, strict=True)
            ]
        else:
            products = [
                functools.partial(xp.matmul, x, w.T, out=y)
                for x, w, y in zip(rows, weights, outs, strict=True)
            ]
        best = float("inf")
        for _ in range(repeat + 2):
            ctx.synchronize()
            start = time.perf_counter()
            for product in products:
                product()
            ctx.synchronize()
            best = min(best, time.perf_counter() - start)
    return best


def run_hf(
    torch: Any, hf: Any, prompt: np.ndarray, new: int, device: str = "cpu"
) -> tuple[float, float, list[int]]:
    """The same for Hugging Face: a cached forward (prefill), and the decode steps as the time
    of ``generate`` for ``new`` tokens minus that for one (both prefill and pick a first token),
    per step."""
    ids = torch.from_numpy(prompt).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(call: Any) -> tuple[float, Any]:
        sync()
        start = time.perf_counter()
        result = call()
        sync()
        return time.perf_counter() - start, result

    def generate(n: int) -> Any:
        return hf.generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    with torch.no_grad():
        prefill, _ = timed(lambda: hf(ids, use_cache=True))
        first, _ = timed(lambda: generate(1))
        total, out = timed(lambda: generate(new))
    return prefill, (total - first) / (new - 1), out[0, prompt.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    parser.add_argument("--sizes", nargs="*", default=list(CPU_SIZES))
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (mila_py and HF both)")
    parser.add_argument(
        "--precision",
        nargs="*",
        default=["fp32"],
        help="storage precisions to time (fp32, bf16, fp16); fp32 is always timed too",
    )
    args = parser.parse_args()
    if args.new < 2 or args.repeat < 1:
        parser.error(
            "--new must be >= 2 (HF's decode is generate(new) - generate(1)), --repeat >= 1"
        )
    try:
        asked = [Precision.parse(p) for p in args.precision]
    except ValueError as exc:
        parser.error(str(exc))
    precisions = [Precision.FP32] + [p for p in dict.fromkeys(asked) if p is not Precision.FP32]
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    torch_device = f"cuda:{device.index}" if on_gpu else "cpu"
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise SystemExit(f"this benchmark compares with Hugging Face: {exc}") from None
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs on both sides
    torch_dtypes = {
        Precision.FP32: torch.float32,
        Precision.BF16: torch.bfloat16,
        Precision.FP16: torch.float16,
    }
    rows = []
    for name in args.sizes:
        hf_cfg = transformers.LlamaConfig(
            **{"rope_theta": 10000.0, **SIZES[name]}, max_position_embeddings=1024
        )
        hf_fp32 = transformers.LlamaForCausalLM(hf_cfg).eval()
        params = sum(p.numel() for p in hf_fp32.parameters())
        prompt = np.random.default_rng(0).integers(0, hf_cfg.vocab_size, size=(1, args.prompt))
        with tempfile.TemporaryDirectory() as tmp:
            hf_fp32.save_pretrained(tmp, safe_serialization=True)
            models = {
                precision: Llama.from_pretrained(
                    tmp,
                    device=str(device),
                    runtime_mode=RuntimeMode.INFERENCE,
                    batch_size=1,
                    prefill_size=None,
                    precision=precision,
                )
                for precision in precisions
            }
        # every mila_py run before any HF one: torch's threads keep spinning for a while after
        # its calls, which would slow the mila_py runs that follow
        timed_m = {}
        for precision, model in models.items():
            # one warm-up run each (caches, allocators, lazy initialisation), then the timed runs
            runs_m = [run_mila(model, prompt, args.new) for _ in range(args.repeat + 1)][1:]
            timed_m[precision] = runs_m, gemv_floor(model, 5)
        fp32_decode = min(r[1] for r in timed_m[Precision.FP32][0])
        for precision, (runs_m, floor) in timed_m.items():
            hf = copy.deepcopy(hf_fp32).to(torch_dtypes[precision]).to(torch_device)
            runs_h = [
                run_hf(torch, hf, prompt, args.new, torch_device) for _ in range(args.repeat + 1)
            ][1:]
            del hf
            mila_prefill = min(r[0] for r in runs_m)
            mila_decode = min(r[1] for r in runs_m)
            hf_prefill = min(r[0] for r in runs_h)
            hf_decode = min(r[1] for r in runs_h)
            if hf_decode <= 0:
                raise SystemExit(f"HF decode timed <= 0 ({hf_decode} s): too noisy; run again")
            same = runs_h[0][2] == runs_m[0][2]
            rows.append(
                (name, str(precision), params, mila_prefill, hf_prefill, mila_decode, hf_decode,
                 fp32_decode / mila_decode, same, floor)
            )  # fmt: skip

    where = f"{device} ({torch.cuda.get_device_name(device.index)})" if on_gpu else "CPU"
    print(f"\n{where}, prompt {args.prompt} tokens, {args.new} greedy new tokens")
    header = (
        f"{'model':<7} {'prec':<4} {'params':>7} | {'prefill tok/s mila':>18} {'HF':>8} "
        f"{'x':>6} | {'decode tok/s mila':>17} {'HF':>7} {'x':>6} {'floor':>7} "
        f"{'vs fp32':>7} | {'ms/token mila':>13} {'HF':>6} | same tokens"
    )
    print(header)
    print("-" * len(header))
    # floor: tokens/s if decode did nothing but stream every weight matrix once per token;
    # md, hd: decode seconds per token; vs fp32: mila decode tok/s over the fp32 row's
    for name, prec, params, mp, hp, md, hd, speedup, same, floor in rows:
        print(
            f"{name:<7} {prec:<4} {params / 1e6:6.1f}M | {args.prompt / mp:18,.0f} "
            f"{args.prompt / hp:8,.0f} {hp / mp:6.2f} | {1 / md:17,.0f} {1 / hd:7,.0f} "
            f"{hd / md:6.2f} {1 / floor:7,.0f} {speedup:7.2f} | {md * 1e3:13.2f} "
            f"{hd * 1e3:6.2f} | {same}"
        )


if __name__ == "__main__":
    main()
