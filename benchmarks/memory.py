"""Memory of a Llama-3.2-1B-shaped INFERENCE build: mila_py's prediction, its real build, and
the peak of Hugging Face ``generate`` in the same setting.

The shape is ``generate.py``'s 1B (vocab 128256, dim 2048, 16 layers, 32/8 heads, hidden 8192,
tied embeddings), built for B sequences of a ``--prompt``-token prompt and ``--new`` new tokens
(context ``prompt + new``, prefill chunk ``prompt``), in FP32 and BF16:

- predicted: ``Llama.required_memory`` by category and dtype (no allocation: a twin is built
  through a sizing context, so it runs anywhere, for a build too large for the machine too);
- on a GPU (``--device CUDA:0``, with CuPy and torch's CUDA): the bytes CuPy's memory pool
  holds after a real build (``used_bytes``, before any call) against the build's
  ``get_memory_stats()``; then transformers' ``LlamaForCausalLM`` of the same config with
  random weights in the same dtype, ``attn_implementation`` "eager" and "sdpa": the peak of
  ``torch.cuda.max_memory_allocated`` over building it and ``generate(prompt,
  max_new_tokens=new)`` (greedy, every token generated), and the ratio of mila_py's
  prediction to it (below 1: mila_py holds less than HF's peak).

Run: ``python benchmarks/memory.py [--device CUDA:0] [--batch 8] [--prompt 512] [--new 64]``.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

from generate import SIZES  # the sibling script: the same 1B shape

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.devices import DeviceId, DeviceType
from mila_py.interop.hf import llama_config_from_hf
from mila_py.memory import MemoryStats
from mila_py.models import Llama, LlamaConfig

PRECISIONS = {"fp32": Precision.FP32, "bf16": Precision.BF16}


def config(context: int) -> LlamaConfig:
    """The 1B shape with a ``context``-token window, as ``llama_config_from_hf`` reads it."""
    fields = dict(SIZES["1B"], model_type="llama", max_position_embeddings=context)
    return llama_config_from_hf(fields, context=context)


def build_context(args: Any) -> BuildContext:
    return BuildContext(
        (args.batch, args.prompt + args.new), RuntimeMode.INFERENCE, prefill_size=args.prompt
    )


def predicted(cfg: LlamaConfig, precision: Precision, args: Any, device: DeviceId) -> MemoryStats:
    """``required_memory`` of the build on ``device`` (a CPU build has two small buffers a
    GPU build has not: its packed SwiGLU's ``gate_up`` rows and the decode scores)."""
    model = Llama("llama", cfg, device=str(device), precision=precision)
    return model.required_memory(build_context(args))


def gpu_build(cfg: LlamaConfig, precision: Precision, args: Any, device: DeviceId) -> tuple:
    """(CuPy pool bytes a real build holds, its ``get_memory_stats().device_total_bytes``)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    with cupy.cuda.Device(device.index):
        before = pool.used_bytes()
        model = Llama("llama", cfg, device=str(device), precision=precision)
        model.build(build_context(args), check_memory=False)
        model.synchronize()
        held = pool.used_bytes() - before
        counted = model.get_memory_stats().device_total_bytes
        del model
        gc.collect()
        pool.free_all_blocks()
    return held, counted


def hf_peak(precision: Precision, args: Any, device: DeviceId, attention: str) -> int:
    """Peak bytes torch allocates for a random-weight ``LlamaForCausalLM`` of the shape and
    its greedy ``generate`` of ``args.new`` tokens after a ``[B, prompt]`` prompt."""
    import torch
    import transformers

    dtype = torch.float32 if precision is Precision.FP32 else torch.bfloat16
    torch_device = f"cuda:{device.index}"
    hf_cfg = transformers.LlamaConfig(**SIZES["1B"], max_position_embeddings=args.prompt + args.new)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(torch_device)
    start = torch.cuda.memory_allocated(torch_device)
    with torch.device(torch_device):
        model = transformers.LlamaForCausalLM._from_config(
            hf_cfg, attn_implementation=attention, dtype=dtype
        ).eval()
    ids = torch.randint(0, hf_cfg.vocab_size, (args.batch, args.prompt), device=torch_device)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    torch.cuda.synchronize(torch_device)
    assert out.shape == (args.batch, args.prompt + args.new)
    peak = torch.cuda.max_memory_allocated(torch_device) - start
    del model, out, ids
    gc.collect()
    torch.cuda.empty_cache()
    return int(peak)


def gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="CPU", help="CPU (prediction only) or CUDA:N")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=PRECISIONS)
    args = parser.parse_args()
    if min(args.batch, args.prompt, args.new) < 1:
        parser.error("--batch, --prompt and --new must be >= 1")
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    cfg = config(args.prompt + args.new)
    print(
        f"Llama-3.2-1B shape, INFERENCE build: B={args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens (context {args.prompt + args.new}, prefill chunk {args.prompt})"
    )
    stats = {name: predicted(cfg, PRECISIONS[name], args, device) for name in args.precisions}
    print(f"\npredicted by required_memory for {device} (GB = 1e9 bytes)")
    print(f"{'precision':<9} {'parameters':>10} {'state':>8} {'total':>8}  by dtype")
    for name, s in stats.items():
        dtypes = ", ".join(f"{k} {v:,} B" for k, v in sorted(s.by_dtype.items()))
        print(
            f"{name:<9} {gb(s.parameter_bytes):>10} {gb(s.state_bytes):>8} "
            f"{gb(s.total_bytes):>8}  {dtypes}"
        )
    kv = 2 * cfg.n_layers * args.batch * (args.prompt + args.new) * cfg.n_kv_heads
    kv *= cfg.dim // cfg.n_heads
    print(f"of the state, the KV cache: {gb(kv * 4)} GB fp32, {gb(kv * 2)} GB bf16")
    if not on_gpu:
        print("\n(--device CUDA:0 adds the real build's pool and Hugging Face's peak)")
        return
    try:
        import cupy  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"the GPU part needs CuPy, torch and transformers: {exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("the GPU part needs torch with CUDA")
    name_of = torch.cuda.get_device_name(device.index)
    print(f"\n{device} ({name_of})")
    print(
        f"{'precision':<9} {'predicted':>9} {'pool':>8} {'stats':>8} {'pool/stats':>10} | "
        f"{'HF eager':>8} {'pred/HF':>7} | {'HF sdpa':>8} {'pred/HF':>7}"
    )
    for name, s in stats.items():
        precision = PRECISIONS[name]
        held, counted = gpu_build(cfg, precision, args, device)
        eager = hf_peak(precision, args, device, "eager")
        sdpa = hf_peak(precision, args, device, "sdpa")
        total = s.total_bytes
        print(
            f"{name:<9} {gb(total):>9} {gb(held):>8} {gb(counted):>8} {held / counted:>10.4f} | "
            f"{gb(eager):>8} {total / eager:>7.3f} | {gb(sdpa):>8} {total / sdpa:>7.3f}"
        )


if __name__ == "__main__":
    main()
