"""Generation speed: mila_py INFERENCE builds vs Hugging Face ``generate`` on the same weights.

For a ~10M and a ~100M parameter Llama and the shape of Llama-3.2-1B (vocab 128256, dim 2048,
16 layers, 32/8 heads, hidden 8192, tied embeddings), each with random weights made by
transformers and copied into a mila_py build, fp32, in one run on the CPU or, with
``--device CUDA:0``, both on that GPU:

- prefill tokens/s: a 256-token prompt (mila_py: ``prefill``; HF: one forward with its cache);
- decode ms per token at B=1 and B=8 (``--batch``): ``generate(new)`` minus ``generate(1)``
  over the ``new - 1`` decode steps that separate them, greedy, on both sides (mila_py: the
  whole loop, the step replayed from its CUDA graph on a GPU and the token chosen on the
  device, one ``[B]`` readback per step; HF: its eager ``generate``);
- a check that both produce the same greedy tokens;
- the weight-streaming floor of decode, measured in the same run: the bytes of every weight
  matrix one token multiplies by (the same arrays a decode step reads; a packed SwiGLU's gate
  and up as one, the tied head once) over the device's bandwidth, measured as a copy of that
  many bytes from one buffer to another (bandwidth = bytes read + bytes written over its
  time). Decode of a small batch reads every weight once per token, so no implementation
  beats it; ``x floor`` is mila_py's ms per token over it. The ``gemv`` column is the time of
  the matrix-vector products of one row through the same weights (the BLAS floor of B=1).

Each side runs once to warm caches, allocators and graphs, then ``--repeat`` times; the best
run counts. ``HF / mila`` above 1 means mila_py is faster.

Needs torch and transformers (test-only references). Run: ``python benchmarks/generate.py
[--device CUDA:0] [--sizes ~10M ~100M 1B]`` (on a GPU, CuPy too; every timed region ends with a
device synchronize). The 1B shape needs ~10 GB of memory for the two models (~20 GB on a GPU,
with the copy floor's buffers): it runs by default on a GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.components import Linear, SwiGLU
from mila_py.devices import DeviceId, DeviceType
from mila_py.interop.hf import llama_config_from_hf, load_hf_weights
from mila_py.models import Llama

SIZES = {
    "~10M": dict(
        vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    "~100M": dict(
        vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "1B": dict(  # Llama-3.2-1B's shape and RoPE
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    ),
}  # fmt: skip
#: the sizes a run takes by default on the CPU (the 1B shape is slow there)
CPU_SIZES = ("~10M", "~100M")


def mila_decode(model: Llama, prompt: np.ndarray, new: int) -> tuple[float, np.ndarray]:
    """(decode seconds per token, greedy tokens) of mila_py's ``generate``: the time of
    ``new`` tokens minus that of one (both prefill and choose a first token), per step."""
    first = timed(model.synchronize, lambda: model.generate(prompt, 1))[0]
    total, out = timed(model.synchronize, lambda: model.generate(prompt, new))
    return (total - first) / (new - 1), np.asarray(out)[:, prompt.shape[1] :]


def mila_prefill(model: Llama, prompt: np.ndarray) -> float:
    return timed(model.synchronize, lambda: model.prefill(prompt))[0]


def timed(sync: Any, call: Any) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    result = call()
    sync()
    return time.perf_counter() - start, result


def decode_weights(model: Llama) -> list[Any]:
    """The weight matrices of one decode step, as its plan multiplies by them: every Linear's,
    a packed SwiGLU's gate and up as one ``[2 hidden, dim]`` matrix, the (tied) output head."""
    weights: list[Any] = []
    packed_halves: set[int] = set()
    for component in model._walk():
        if isinstance(component, SwiGLU):
            packed = component._packed_weight()
            if packed is not None:
                weights.append(packed)
                packed_halves |= {id(component.gate_proj), id(component.up_proj)}
        elif isinstance(component, Linear) and id(component) not in packed_halves:
            weights.append(component.weight)
    if model.lm_head is None:
        weights.append(model.embed_tokens.weight)
    return weights


def gemv_floor(model: Llama, repeat: int) -> float:
    """Seconds of one row through every weight of :func:`decode_weights` (best of runs)."""
    weights = decode_weights(model)
    ctx = model.execution_context
    xp = ctx.xp
    activate = getattr(ctx, "activate", contextlib.nullcontext)
    with activate():  # on a GPU: its device and the model's stream
        rows = [xp.ones((1, w.shape[1]), w.dtype) for w in weights]
        outs = [xp.empty((1, w.shape[0]), w.dtype) for w in weights]
        best = float("inf")
        for _ in range(repeat + 2):
            ctx.synchronize()
            start = time.perf_counter()
            for x, w, y in zip(rows, weights, outs, strict=True):
                xp.matmul(x, w.T, out=y)
            ctx.synchronize()
            best = min(best, time.perf_counter() - start)
    return best


def copy_floor(model: Llama, repeat: int) -> tuple[float, float, int]:
    """``(seconds, bandwidth in bytes/s, weight bytes)``: the weight bytes of one decode step
    over the bandwidth of a copy of as many bytes between two buffers of the model's device
    (bytes read plus bytes written over the copy's best time)."""
    nbytes = sum(int(w.nbytes) for w in decode_weights(model))
    ctx = model.execution_context
    xp = ctx.xp
    activate = getattr(ctx, "activate", contextlib.nullcontext)
    with activate():
        src = xp.ones(nbytes // 4, dtype=np.float32)
        dst = xp.empty_like(src)
        best = float("inf")
        for _ in range(repeat + 2):
            ctx.synchronize()
            start = time.perf_counter()
            xp.copyto(dst, src)
            ctx.synchronize()
            best = min(best, time.perf_counter() - start)
        del src, dst
    bandwidth = 2 * nbytes / best
    return nbytes / bandwidth, bandwidth, nbytes


def hf_runs(
    torch: Any, hf: Any, prompt: np.ndarray, new: int, device: str
) -> tuple[float, float, np.ndarray]:
    """HF's (prefill seconds, decode seconds per token, greedy tokens): a cached forward, and
    the time of ``generate`` for ``new`` tokens minus that for one, per step."""
    ids = torch.from_numpy(prompt).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def generate(n: int) -> Any:
        return hf.generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    with torch.no_grad():
        prefill = timed(sync, lambda: hf(ids[:1], use_cache=True))[0]
        first = timed(sync, lambda: generate(1))[0]
        total, out = timed(sync, lambda: generate(new))
    return prefill, (total - first) / (new - 1), out[:, prompt.shape[1] :].cpu().numpy()


def build(torch: Any, transformers: Any, fields: dict, device: DeviceId, args: Any) -> Any:
    """``(hf model, mila_py model)`` with the same random weights, on the device."""
    on_gpu = device.device_type is DeviceType.CUDA
    torch_device = f"cuda:{device.index}" if on_gpu else "cpu"
    context = args.prompt + args.new
    hf_cfg = transformers.LlamaConfig(**fields, max_position_embeddings=context)
    with torch.device(torch_device):  # initialized where it runs
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = llama_config_from_hf(hf_cfg.to_dict(), context=context)
    model = Llama("llama", cfg, device=str(device))
    model.build(
        BuildContext(
            (max(args.batch), context),
            RuntimeMode.INFERENCE,
            initialize_parameters=False,
            prefill_size=args.prompt,
        )
    )
    ctx = model.execution_context
    with torch.no_grad():
        tensors = {
            name: ctx.as_device_array(t) if on_gpu else t.numpy()
            for name, t in hf.state_dict().items()
            if not (cfg.tie_embeddings and name == "lm_head.weight")  # the embedding's
        }
        load_hf_weights(model, tensors)
        ctx.release_foreign()
    return hf, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    parser.add_argument("--sizes", nargs="*", default=None, choices=list(SIZES))
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (mila_py and HF both)")
    args = parser.parse_args()
    if args.new < 2 or args.repeat < 1 or not args.batch or min(args.batch) < 1:
        parser.error(
            "--new must be >= 2 (decode is generate(new) - generate(1)), --repeat >= 1, "
            "--batch sizes >= 1"
        )
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    sizes = args.sizes or (list(SIZES) if on_gpu else list(CPU_SIZES))
    torch_device = f"cuda:{device.index}" if on_gpu else "cpu"
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise SystemExit(f"this benchmark compares with Hugging Face: {exc}") from None
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs on both sides
    rng = np.random.default_rng(0)
    rows = []
    for name in sizes:
        hf, model = build(torch, transformers, SIZES[name], device, args)
        params = sum(p.numel() for p in hf.parameters())
        vocab = SIZES[name]["vocab_size"]
        prompts = rng.integers(0, vocab, size=(max(args.batch), args.prompt))
        decode: dict[int, tuple[float, float, bool]] = {}
        prefill_m = prefill_h = float("inf")
        for n_b in args.batch:
            prompt = prompts[:n_b]
            # one warm-up run each (caches, allocators, graphs), then the timed runs
            runs_m = [mila_decode(model, prompt, args.new) for _ in range(args.repeat + 1)][1:]
            runs_h = [
                hf_runs(torch, hf, prompt, args.new, torch_device) for _ in range(args.repeat + 1)
            ]
            runs_h = runs_h[1:]
            same = bool(np.array_equal(runs_m[0][1], runs_h[0][2]))
            decode[n_b] = (min(r[0] for r in runs_m), min(r[1] for r in runs_h), same)
            prefill_h = min(prefill_h, *(r[0] for r in runs_h))
        for _ in range(args.repeat + 1):
            prefill_m = min(prefill_m, mila_prefill(model, prompts[:1]))
        floor, bandwidth, nbytes = copy_floor(model, 5)
        gemv = gemv_floor(model, 5)
        rows.append((name, params, nbytes, floor, bandwidth, gemv, decode, prefill_m, prefill_h))
        del hf, model
        if on_gpu:
            torch.cuda.empty_cache()

    where = f"{device} ({torch.cuda.get_device_name(device.index)})" if on_gpu else "CPU"
    print(f"\nfp32 {where}, prompt {args.prompt} tokens, {args.new} greedy new tokens")
    header = (
        f"{'model':<6} {'params':>7} {'weights':>8} {'floor':>7} {'gemv':>7} | "
        f"{'B':>2} {'ms/token mila':>13} {'HF':>7} {'HF/mila':>7} {'x floor':>7} "
        f"{'same':>5} | {'prefill tok/s mila':>18} {'HF':>8} {'HF/mila':>7}"
    )
    print(header)
    print("-" * len(header))
    # floor and gemv in ms per token; bandwidth in GB/s below the table
    for name, params, nbytes, floor, _bandwidth, gemv, decode, pm, ph in rows:
        for i, (n_b, (md, hd, same)) in enumerate(decode.items()):
            lead = (
                f"{name:<6} {params / 1e6:6.1f}M {nbytes / 1e9:7.2f}G {floor * 1e3:7.2f} "
                f"{gemv * 1e3:7.2f}"
                if i == 0
                else " " * 40
            )
            tail = (
                f"{args.prompt / pm:18,.0f} {args.prompt / ph:8,.0f} {ph / pm:7.2f}"
                if i == 0
                else ""
            )
            print(
                f"{lead} | {n_b:>2} {md * 1e3:13.2f} {hd * 1e3:7.2f} {hd / md:7.2f} "
                f"{md / floor:7.2f} {same!s:>5} | {tail}"
            )
    print(
        "floor: weight bytes / copy bandwidth ("
        + ", ".join(f"{r[0]} {r[4] / 1e9:,.0f} GB/s" for r in rows)
        + "); gemv: one row through every weight matrix"
    )


if __name__ == "__main__":
    main()
