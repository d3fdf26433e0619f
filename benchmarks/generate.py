"""Generation speed by storage precision: mila_py INFERENCE builds vs Hugging Face on the same weights.

For a ~10M and a ~100M parameter Llama and the shape of Llama-3.2-1B (vocab 128256, dim 2048,
16 layers, 32/8 heads, hidden 8192, tied embeddings), each with random weights made by
transformers in fp32 and copied into a mila_py build of every storage precision asked for
(``--precision``, fp32 by default; bf16 and fp16 round the same fp32 weights to nearest even,
as HF's ``.to(dtype)`` does), in one run on the CPU or, with ``--device CUDA:0``, both on that
GPU. HF runs eager (no ``torch.compile``) with ``attn_implementation="sdpa"``. Per size,
precision and batch size ``B`` (``--batch``, one table row each):

- prefill tokens/s of ``B`` prompts of ``--prompt`` tokens (mila_py: ``prefill``; HF: one
  cached forward with ``logits_to_keep=1``, the last position's logits as mila_py's);
- decode ms per step (one token for each of the ``B`` sequences) and tokens/s:
  ``generate(new)`` minus ``generate(1)`` over the ``new - 1`` decode steps that separate
  them, greedy, on both sides (mila_py: the whole loop, the step replayed from its CUDA graph
  on a GPU and the token chosen on the device, one ``[B]`` readback per step; HF: its eager
  ``generate``);
- how many of the greedy tokens agree (the shortest common prefix over the ``B`` sequences):
  fp32 should agree throughout; 16-bit rounding differs between the libraries, and random
  weights give near-uniform logits, so bf16/fp16 may part after a few tokens;
- the weight-streaming floor of decode, measured in the same run: the bytes of every weight
  matrix one step multiplies by (the same arrays a decode step reads, in the row's precision;
  a packed SwiGLU's gate and up as one, the tied head once) over the device's bandwidth,
  measured as a copy of that many bytes from one buffer to another (bandwidth = bytes read +
  bytes written over its time). Decode of a small batch reads every weight once per step, so
  no implementation beats it; ``x floor`` is mila_py's ms per step over it. The ``gemv`` figure
  (below the table) is the time of one row through the same weights (BLAS or cuBLAS; on the
  CPU, 16-bit weights through the decode step's own Numba kernels);
- ``vs fp32`` (when fp32 is among the precisions): mila_py's decode tokens/s over the fp32
  row's of the same size and ``B``.

Each side runs once to warm caches, allocators and graphs, then ``--repeat`` times; the best
run counts. Every ratio is mila_py over HF (or over the floor): above 1 means mila_py is faster,
except ``x floor`` (1 is the floor). For the 1B shape in bf16, the lines below the table check
the targets that the run measures: prefill of B=8 prompts of 512 tokens >= 1.0x HF's tokens/s,
decode at B=1 <= 1.5x the floor, decode at B=8 >= 2x HF's tokens/s.

Needs torch and transformers (test-only references). Run: ``python benchmarks/generate.py
[--device CUDA:0] [--sizes ~10M ~100M 1B] [--precision fp32 bf16 fp16] [--batch 1 8]``; the
BF16 targets: ``--device CUDA:0 --sizes 1B --batch 1 8 --prompt 512 --precision bf16``. On a
GPU, CuPy too; every timed region ends with a device synchronize. The 1B shape needs ~10 GB of
memory for the fp32 models (~20 GB on a GPU with the copy floor's buffers; a 16-bit precision
adds its models): it runs by default on a GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import time
from typing import Any, NamedTuple

import numpy as np

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Linear, SwiGLU
from mila_py.devices import DeviceId, DeviceType
from mila_py.interop.hf import llama_config_from_hf, load_hf_weights
from mila_py.models import Llama
from mila_py.ops.cpu import _fused_linear

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
#: the BF16 targets of the 1B shape: prefill of B=8 prompts of 512 tokens at least 1.0x HF's
#: tokens/s; decode at B=1 at most 1.5x the floor's ms per step; decode at B=8 at least 2x
#: HF's tokens/s
PREFILL_VS_HF, DECODE_VS_FLOOR, DECODE_VS_HF = 1.0, 1.5, 2.0


class Row(NamedTuple):
    """One row of the table: seconds (prefill of the batch, decode per step)."""

    model: str
    precision: Precision
    batch: int
    prefill_mila: float
    prefill_hf: float
    decode_mila: float
    floor: float
    decode_hf: float
    decode_fp32: float | None  # mila_py's fp32 row's of the same size and batch, when timed
    agree: int  # leading greedy tokens equal in every sequence


def timed(sync: Any, call: Any) -> tuple[float, Any]:
    sync()
    start = time.perf_counter()
    result = call()
    sync()
    return time.perf_counter() - start, result


def mila_runs(model: Llama, prompt: np.ndarray, new: int) -> tuple[float, float, np.ndarray]:
    """mila_py's (prefill seconds, decode seconds per step, greedy new tokens ``[B, new]``):
    a ``prefill`` of the prompt, and the time of ``generate`` for ``new`` tokens minus that for
    one (both prefill and choose a first token), per step."""
    sync = model.synchronize

    def generate(n: int) -> Any:
        return model.generate(prompt, n, temperature=0.0, eos_token_id=None)

    prefill = timed(sync, lambda: model.prefill(prompt))[0]
    first = timed(sync, lambda: generate(1))[0]
    total, out = timed(sync, lambda: generate(new))
    return prefill, (total - first) / (new - 1), np.asarray(out)[:, prompt.shape[1] :]


def hf_runs(
    torch: Any, hf: Any, prompt: np.ndarray, new: int, device: str
) -> tuple[float, float, np.ndarray]:
    """The same for Hugging Face: a cached forward that keeps the last position's logits
    (prefill), and ``generate`` for ``new`` tokens minus that for one, per step."""
    ids = torch.from_numpy(prompt).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def generate(n: int) -> Any:
        return hf.generate(
            ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    with torch.no_grad():
        prefill = timed(sync, lambda: hf(ids, use_cache=True, logits_to_keep=1))[0]
        first = timed(sync, lambda: generate(1))[0]
        total, out = timed(sync, lambda: generate(new))
    return prefill, (total - first) / (new - 1), out[:, prompt.shape[1] :].cpu().numpy()


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


def build_hf(torch: Any, transformers: Any, fields: dict, torch_device: str, context: int) -> Any:
    """The fp32 Hugging Face model of ``fields``, random weights made on its device, eager
    with SDPA attention."""
    hf_cfg = transformers.LlamaConfig(
        **fields, max_position_embeddings=context, attn_implementation="sdpa"
    )
    with torch.device(torch_device):  # initialized where it runs
        return transformers.LlamaForCausalLM(hf_cfg).eval()


def build_mila(hf: Any, precision: Precision, device: DeviceId, args: Any) -> Llama:
    """A mila_py INFERENCE build of ``hf``'s config in ``precision``, its fp32 weights cast
    on load (rounded to nearest even)."""
    on_gpu = device.device_type is DeviceType.CUDA
    context = args.prompt + args.new
    cfg = llama_config_from_hf(hf.config.to_dict(), context=context)
    model = Llama("llama", cfg, device=str(device), precision=precision)
    model.build(
        BuildContext(
            (max(args.batch), context),
            RuntimeMode.INFERENCE,
            initialize_parameters=False,
            prefill_size=args.prompt,
        )
    )
    ctx = model.execution_context
    tensors = {
        name: ctx.as_device_array(t) if on_gpu else t.detach().numpy()
        for name, t in hf.state_dict().items()
        if not (cfg.tie_embeddings and name == "lm_head.weight")  # the embedding's
    }
    load_hf_weights(model, tensors)
    ctx.release_foreign()
    return model


def agreement(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens equal in every row of ``a`` and ``b`` ``[B, n]``."""
    differ = np.flatnonzero((a != b).any(axis=0))
    return int(differ[0]) if differ.size else int(a.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    parser.add_argument("--sizes", nargs="*", default=None, choices=list(SIZES))
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="batch sizes")
    parser.add_argument("--device", default="CPU", help="CPU or CUDA:N (mila_py and HF both)")
    parser.add_argument(
        "--precision",
        nargs="*",
        default=["fp32"],
        help="storage precisions to time, in this order (fp32, bf16, fp16; default fp32)",
    )
    args = parser.parse_args()
    if args.new < 2 or args.repeat < 1 or not args.batch or min(args.batch) < 1:
        parser.error(
            "--new must be >= 2 (decode is generate(new) - generate(1)), --repeat >= 1, "
            "--batch sizes >= 1"
        )
    if args.prompt < 1:
        parser.error(f"--prompt must be >= 1, got {args.prompt}")
    try:
        precisions = list(dict.fromkeys(Precision.parse(p) for p in args.precision or ["fp32"]))
    except ValueError as exc:
        parser.error(str(exc))
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    sizes = args.sizes or (list(SIZES) if on_gpu else list(CPU_SIZES))
    batches = list(dict.fromkeys(args.batch))
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
    unknown = [p for p in precisions if p not in torch_dtypes]
    if unknown:
        parser.error(f"--precision takes fp32, bf16 or fp16, got {unknown[0]}")
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    sums: list[tuple[Any, ...]] = []  # per size and precision: weights, floor, bandwidth, gemv
    for name in sizes:
        hf32 = build_hf(torch, transformers, SIZES[name], torch_device, args.prompt + args.new)
        params = sum(p.numel() for p in hf32.parameters())
        vocab = SIZES[name]["vocab_size"]
        prompts = rng.integers(0, vocab, size=(max(batches), args.prompt))
        fp32_decode: dict[int, float] = {}
        for precision in precisions:
            model = build_mila(hf32, precision, device, args)
            # every mila_py run before any HF one: on the CPU torch's threads keep spinning
            # for a while after its calls, which would slow the mila_py runs that follow
            runs_m = {
                n_b: [mila_runs(model, prompts[:n_b], args.new) for _ in range(args.repeat + 1)]
                for n_b in batches
            }
            floor, bandwidth, nbytes = copy_floor(model, 5)
            gemv = gemv_floor(model, 5)
            sums.append((name, params, str(precision), nbytes, floor, bandwidth, gemv))
            del model
            hf = hf32 if precision is Precision.FP32 else copy.deepcopy(hf32)
            hf = hf.to(torch_dtypes[precision])
            runs_h = {
                n_b: [
                    hf_runs(torch, hf, prompts[:n_b], args.new, torch_device)
                    for _ in range(args.repeat + 1)
                ]
                for n_b in batches
            }
            if hf is not hf32:
                del hf
            for n_b in batches:
                ms, hs = runs_m[n_b][1:], runs_h[n_b][1:]  # the first of each warmed up
                pm, dm = min(r[0] for r in ms), min(r[1] for r in ms)
                ph, dh = min(r[0] for r in hs), min(r[1] for r in hs)
                if dm <= 0 or dh <= 0:
                    raise SystemExit(
                        f"{name} {precision} B={n_b}: a decode timed <= 0 s (mila_py {dm}, HF "
                        f"{dh}): generate(1) and generate({args.new}) too close; raise --new"
                    )
                if precision is Precision.FP32:
                    fp32_decode[n_b] = dm
                agree = agreement(ms[0][2], hs[0][2])
                rows.append(
                    Row(name, precision, n_b, pm, ph, dm, floor, dh, fp32_decode.get(n_b), agree)
                )
            if on_gpu:
                torch.cuda.empty_cache()
        del hf32
        if on_gpu:
            torch.cuda.empty_cache()

    where = f"{device} ({torch.cuda.get_device_name(device.index)})" if on_gpu else "CPU"
    print(
        f"\n{where}, torch {torch.__version__}, transformers {transformers.__version__}; prompt "
        f"{args.prompt} tokens, {args.new} greedy new tokens; HF eager, sdpa; best of "
        f"{args.repeat}"
    )
    header = (
        f"{'model':<6} {'prec':<4} {'B':>2} | {'prefill tok/s mila':>18} {'HF':>9} {'x':>5} | "
        f"{'decode ms/step mila':>19} {'floor':>6} {'x floor':>7} | "
        f"{'decode tok/s mila':>17} {'HF':>8} {'x':>5} {'vs fp32':>7} | {'agree':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, prec, n_b, pm, ph, dm, floor, dh, d32, agree in rows:
        n_tok = n_b * args.prompt
        vs32 = f"{d32 / dm:7.2f}" if d32 is not None else f"{'-':>7}"
        print(
            f"{name:<6} {prec!s:<4} {n_b:>2} | {n_tok / pm:18,.0f} {n_tok / ph:9,.0f} "
            f"{ph / pm:5.2f} | {dm * 1e3:19.3f} {floor * 1e3:6.3f} {dm / floor:7.2f} | "
            f"{n_b / dm:17,.0f} {n_b / dh:8,.0f} {dh / dm:5.2f} {vs32} | "
            f"{agree:>3}/{args.new:<3}"
        )
    print(
        "x: mila_py over HF (above 1: mila_py faster); floor: weight bytes / copy bandwidth, ms "
        "per step; agree: leading greedy tokens equal in every sequence"
    )
    for name, params, prec, nbytes, floor, bandwidth, gemv in sums:
        print(
            f"{name} {prec}: {params / 1e6:.1f}M parameters, decode weights "
            f"{nbytes / 1e9:.3f} GB, copy {bandwidth / 1e9:,.0f} GB/s, floor "
            f"{floor * 1e3:.3f} ms, gemv (one row through every weight) {gemv * 1e3:.3f} ms"
        )
    checks = target_checks(rows, args.prompt)
    if checks:
        print("\nBF16 targets, 1B shape")
        for text, met in checks:
            print(f"  {'met    ' if met else 'NOT MET'} {text}")


def target_checks(rows: list[Row], prompt: int) -> list[tuple[str, bool]]:
    """``(what, met)`` for each BF16 target of the 1B shape that ``rows`` measure: prefill and
    decode against HF at B=8 (prefill with ``prompt == 512`` only), decode at B=1 against the
    floor."""
    mine = {r.batch: r for r in rows if r.model == "1B" and r.precision is Precision.BF16}
    checks = []
    eight = mine.get(8)
    if eight is not None and prompt == 512:
        ratio = eight.prefill_hf / eight.prefill_mila
        checks.append(
            (
                f"prefill B=8, prompt 512: mila/HF {ratio:.2f} >= {PREFILL_VS_HF}",
                ratio >= PREFILL_VS_HF,
            )
        )
    one = mine.get(1)
    if one is not None:
        ratio = one.decode_mila / one.floor
        checks.append(
            (
                f"decode B=1: {one.decode_mila * 1e3:.3f} ms / floor {one.floor * 1e3:.3f} ms "
                f"= {ratio:.2f} <= {DECODE_VS_FLOOR}",
                ratio <= DECODE_VS_FLOOR,
            )
        )
    if eight is not None:
        ratio = eight.decode_hf / eight.decode_mila
        checks.append(
            (f"decode B=8: tok/s mila/HF {ratio:.2f} >= {DECODE_VS_HF}", ratio >= DECODE_VS_HF)
        )
    return checks


if __name__ == "__main__":
    main()
