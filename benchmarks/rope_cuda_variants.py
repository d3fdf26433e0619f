"""The RoPE kernel's tuning settings timed against each other on one GPU (needs CuPy and a GPU).

``rope_cuda.py`` measured the in-place forward at 85-93% of a device-to-device copy on an H100,
tied with Liger-Kernel at fp32 B=4 T=4096 (both at 93%). The kernel has knobs that change no
result bit (:class:`mila_py.ops.cuda.rope.RopeKernelTuning`: threads per block, pair groups a
thread holds in flight, streaming cache hints, loads issued before the block's barrier, blocks
per multiprocessor; ``tests/test_rope_cuda_emulated.py`` checks settings against the one in use). This times :data:`VARIANTS` on the forward launch the op makes
for each prefill shape and dtype, with the op's own arguments: each variant's output must equal
the kernel in use's bit for bit before it is timed. CUDA events; each round times every variant
in turn (``--calls`` launches), the median of ``--repeats`` rounds is kept. In the same run: the
copy ceiling and, when importable, Liger-Kernel's forward on the same shape (the peer of the tie).

    python benchmarks/rope_cuda_variants.py [--calls 20] [--repeats 15]
    python benchmarks/rope_cuda_variants.py --backward    # the out-of-place backward launch
    python benchmarks/rope_cuda_variants.py --registers   # no GPU: nvcc's register counts

Per case it prints each variant's time, its % of the copy, ``in use / variant`` (> 1: the
variant is faster), the spread of the kernel in use's rounds, and ``x Liger`` (Liger's time over
the variant's); at the end, each variant's worst and geometric-mean ratio over the cases. A
setting is a candidate for :data:`mila_py.ops.cuda.rope.ROPE_TUNING` only where it wins on every
case by more than the spread. The library itself is unchanged by this script.

``--backward`` times the launch ``Rope.backward`` makes instead: out of place, ``R^T`` of dQ
and dK into the component's gradient buffers (the bits compared are those buffers'). It reads
and writes different memory, as the copy ceiling does; Liger is not timed there.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.devices.cuda import cuda_device_count
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda.rope import ROPE_TUNING, RopeKernelTuning, kernel_name, rope_source

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rope_cuda import TorchTimer, copy_ceiling, load_peers, peer_tables, torch_dtype

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 8192), (4, 4096)]

#: the settings timed, the one in use first, then its neighbours; the one in use (batch 4 with
#: streaming hints) replaced batch 1 without hints after this script's H100 run of 2026-11-26
VARIANTS: dict[str, RopeKernelTuning] = {
    "in use": ROPE_TUNING,
    "batch 1 (before)": RopeKernelTuning(batch=1, streaming=False),
    "batch 4, no hints": RopeKernelTuning(batch=4, streaming=False),
    "batch 2, streaming": RopeKernelTuning(batch=2, streaming=True),
    "batch 8, streaming": RopeKernelTuning(batch=8, streaming=True),
    "batch 4, str., 256 thr.": RopeKernelTuning(batch=4, streaming=True, threads=256),
    "batch 4, str., early": RopeKernelTuning(batch=4, streaming=True, early=True),
    "batch 4, str., 8 blocks/SM": RopeKernelTuning(batch=4, streaming=True, min_blocks=8),
    "batch 1, str., 16 bl./SM": RopeKernelTuning(batch=1, streaming=True, min_blocks=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--adopt", metavar="PATH",
        help="write the setting the rule picks (its MILA_ROPE_TUNING value) to PATH; empty: none",
    )  # fmt: skip
    parser.add_argument(
        "--backward", action="store_true",
        help="time Rope.backward's launch (out of place, into the gradient buffers), not the "
        "in-place forward's; Liger is not timed",
    )  # fmt: skip
    parser.add_argument(
        "--registers", action="store_true",
        help="no GPU: registers per thread of each variant's prefill kernels (nvcc, sm_90)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.backward and args.adopt:  # ROPE_TUNING drives the forward kernel too
        parser.error("--adopt picks a setting from the forward cases: not with --backward")
    if args.registers:
        print_registers()
        return
    if cuda_device_count() == 0:
        raise SystemExit("rope_cuda_variants.py needs an NVIDIA GPU and CuPy (none seen)")
    import cupy

    liger = None if args.backward else load_liger()
    cfg = RopeConfig(channels=HEADS * HEAD_DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                     max_seq_len=8192)  # fmt: skip
    rng = np.random.default_rng(0)
    copy, copy_fn, copy_timer = copy_ceiling(cupy)
    copy_bw = copy.nbytes / copy_timer.median_seconds(copy_fn, calls=args.calls,
                                                      repeats=args.repeats)  # fmt: skip
    del copy_fn  # its 2 GiB of buffers go
    props = cupy.cuda.runtime.getDeviceProperties(0)
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"{device}, CuPy {cupy.__version__}; copy ceiling: {copy_bw / 1e9:.0f} GB/s (bytes read + written); "
          f"Liger: {'timed' if liger else 'not importable'}")  # fmt: skip
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    x_liger: dict[str, list[float]] = {name: [] for name in VARIANTS}
    spreads: list[float] = []
    for precision in (Precision.FP32, Precision.BF16):
        for n_b, n_t in SHAPES:
            case = measure_case(cupy, cfg, precision, n_b, n_t, rng, copy_bw, liger, args)
            for name, (ratio, over_liger) in case.ratios.items():
                ratios[name].append(ratio)
                if over_liger is not None:
                    x_liger[name].append(over_liger)
            spreads.append(case.spread)
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"\n{'variant':26} {'worst':>7} {'geomean':>8} {'worst x Liger':>14}"
          "  (in use / variant, over the cases)")  # fmt: skip
    for name, values in ratios.items():
        if values:
            geo = math.exp(sum(map(math.log, values)) / len(values))
            vs = f"{min(x_liger[name]):14.3f}" if x_liger[name] else f"{'-':>14}"
            print(f"{name:26} {min(values):7.3f} {geo:8.3f} {vs}")
    n_cases = len(spreads)
    pick = adoption(ratios, x_liger, max(spreads), n_cases)
    print(f"\nrule: worst ratio > 1 + the largest in-use spread ({max(spreads):.3f}) on all "
          f"{n_cases} cases, Liger slower on every case where it ran: "
          + (f"adopt {pick!r} (MILA_ROPE_TUNING={VARIANTS[pick].spec})" if pick else "keep the setting in use"))  # fmt: skip
    if args.adopt:
        Path(args.adopt).write_text(VARIANTS[pick].spec if pick else "")


def adoption(ratios: dict[str, list[float]], x_liger: dict[str, list[float]], spread: float,
             n_cases: int) -> str | None:  # fmt: skip
    """The variant to adopt: of those timed on all ``n_cases`` whose worst ``in use / variant``
    beats 1 by more than ``spread`` and that Liger never beats, the one with the best worst
    ratio; None where none qualifies."""
    fit = [
        name for name, values in ratios.items()
        if name != "in use" and len(values) == n_cases and min(values) > 1 + spread
        and all(x > 1 for x in x_liger[name])
    ]  # fmt: skip
    return max(fit, key=lambda name: min(ratios[name]), default=None)


class Case(NamedTuple):
    """One case's figures: per variant timed, ``(in use / variant, Liger / variant or None)``;
    and the in-use rounds' interquartile range over their median."""

    ratios: dict[str, tuple[float, float | None]]
    spread: float


def measure_case(cupy: Any, cfg: RopeConfig, precision: Precision, n_b: int, n_t: int,
                 rng: np.random.Generator, copy_bw: float, liger: Any,
                 args: argparse.Namespace) -> Case:  # fmt: skip
    """Print one case's table and return its figures."""
    direction = "backward" if args.backward else "forward"
    mode = RuntimeMode.TRAINING if args.backward else RuntimeMode.INFERENCE
    rope = Rope("rope", cfg, device="CUDA:0", precision=precision)
    rope.build(BuildContext((n_b, n_t, cfg.channels), mode))
    ctx = rope.execution_context
    shape_q, shape_k = (n_b, n_t, cfg.channels), (n_b, n_t, cfg.kv_channels)
    q_host = rng.standard_normal(shape_q, dtype=np.float32)
    k_host = rng.standard_normal(shape_k, dtype=np.float32)
    q = ctx.to_device(q_host.astype(precision.numpy_dtype))
    k = ctx.to_device(k_host.astype(precision.numpy_dtype))
    # the arrays the launch writes: Q and K in place, or the gradient buffers backward returns
    written: list[Any] = [q, k]
    if args.backward:
        launch = capture_launch(lambda: written.__setitem__(slice(None), rope.backward(q, k)))
    else:
        launch = capture_launch(lambda: rope.forward(q, k))
    names = launch["kw"].get("name_expressions", ())
    device = ctx.device_id.index
    grid, shared = launch["grid"], launch["kw"]["shared_mem"]
    nbytes = 2 * (q.nbytes + k.nbytes) + n_t * (cfg.head_dim // 2) * 8
    q0, k0 = q.copy(), k.copy()

    def runner(tuning: RopeKernelTuning) -> Any:
        fn = _kernels.kernel(rope_source(tuning), launch["name"], device, names)
        threads = (tuning.threads,)
        return lambda: fn(grid, threads, launch["args"], shared_mem=shared, stream=ctx.stream)

    runners, outputs = {}, {}
    for name, tuning in VARIANTS.items():  # the same function of the same input, bit for bit
        q.view(cupy.uint8)[...] = q0.view(cupy.uint8)
        k.view(cupy.uint8)[...] = k0.view(cupy.uint8)
        if args.backward:  # so a variant that writes nothing cannot pass for the one in use
            for out in written:
                out.view(cupy.uint8)[...] = 0
        runners[name] = runner(tuning)
        runners[name]()
        ctx.synchronize()
        outputs[name] = tuple(cupy.asnumpy(out.view(cupy.uint8)) for out in written)
    base = outputs["in use"]
    differ = [n for n, out in outputs.items() if not all(map(np.array_equal, out, base))]
    timed = {n: fn for n, fn in runners.items() if n not in differ}
    times = interleaved_us(cupy, ctx.stream, timed, args)
    dtype = "fp32" if precision is Precision.FP32 else "bf16"
    liger_us = liger_forward_us(liger, q_host, k_host, rope, precision, args) if liger else None
    mine = statistics.median(times["in use"])
    q1, q3 = np.percentile(times["in use"], [25, 75])
    spread = (q3 - q1) / mine
    print(f"\n{direction} B={n_b} T={n_t} {dtype} (kernel {launch['name']}, in-use rounds' "
          f"IQR {100 * spread:.1f}%"
          + (f"; Liger {liger_us:.1f} us" if liger_us else "") + ")")  # fmt: skip
    print(f"  {'variant':24} {'us':>8} {'% copy':>7} {'in use/variant':>15} {'x Liger':>8}")
    ratios = {}
    for name, rounds in times.items():
        us = statistics.median(rounds)
        ratios[name] = (mine / us, liger_us / us if liger_us else None)
        pct = 100 * nbytes / (us * 1e-6) / copy_bw
        x_liger = f"{liger_us / us:8.3f}" if liger_us else f"{'-':>8}"
        print(f"  {name:24} {us:8.1f} {pct:6.1f}% {mine / us:15.3f} {x_liger}")
    for name in differ:
        print(f"  {name:24} output differs from the kernel in use: not timed")
    return Case(ratios, spread)


def interleaved_us(cupy: Any, stream: Any, runners: dict[str, Any],
                   args: argparse.Namespace) -> dict[str, list[float]]:  # fmt: skip
    """Microseconds per launch of each runner, one value per round; every round times each
    runner in turn, so drift of the GPU's clocks reaches all of them alike."""
    for fn in runners.values():
        for _ in range(3):
            fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            fn()  # an untimed lead call, as rope_cuda.py's timers make (see its CupyTimer)
            start.record(stream)
            for _ in range(args.calls):
                fn()
            end.record(stream)
            end.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.calls)
    return times


def load_liger() -> Any:
    """torch and ``rope_cuda.py``'s Liger forward ``fn(q4, k4, cos, sin)``, or None where torch,
    a GPU for it, or Liger-Kernel is missing."""
    try:
        import torch
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    liger = load_peers(torch, use_compile=False).get("Liger")
    return None if liger is None else (torch, liger)


def liger_forward_us(liger: Any, q_host: np.ndarray, k_host: np.ndarray, rope: Rope,
                     precision: Precision, args: argparse.Namespace) -> float:  # fmt: skip
    """Liger's forward on the same shape and the same table rows, called as ``rope_cuda.py``
    calls it, median microseconds per call."""
    torch, fn = liger
    dtype = torch_dtype(torch, precision)
    n_b, n_t = q_host.shape[:2]
    tq = torch.from_numpy(q_host).cuda().to(dtype).view(n_b, n_t, HEADS, HEAD_DIM)
    tk = torch.from_numpy(k_host).cuda().to(dtype).view(n_b, n_t, KV_HEADS, HEAD_DIM)
    cos, sin = peer_tables(torch, rope, slice(0, n_t), precision)
    seconds = TorchTimer(torch).median_seconds(
        lambda: fn(tq, tk, cos, sin), calls=args.calls, repeats=args.repeats
    )
    return seconds * 1e6


#: the Itanium-mangled prefixes of ``rope_qk<float, 4, false>`` and ``rope_qk<mila_bf16, 8, false>``
MANGLED = ("_Z7rope_qkIfLi4ELb0E", "_Z7rope_qkI9mila_bf16Li8ELb0E")


def print_registers() -> None:
    """Registers per thread (and spills) of each variant's widest prefill kernels, by nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("--registers needs nvcc")
    names = [kernel_name(Precision.FP32, 4, False), kernel_name(Precision.BF16, 8, False)]
    print(f"{'variant':24} " + " ".join(f"{n:>28}" for n in names) + "  (registers, spill bytes)")
    with tempfile.TemporaryDirectory() as tmp:
        for label, tuning in VARIANTS.items():
            path = Path(tmp) / "rope.cu"
            instances = ", ".join(f"(void*)&{n}" for n in names)
            path.write_text(
                f"{_kernels.CUDA_PRELUDE}{rope_source(tuning)}\n"
                f"void* const instances[] = {{{instances}}};\n"
            )
            out = subprocess.run(
                [nvcc, "-std=c++17", "-arch=sm_90", "--resource-usage", "-c", str(path),
                 "-o", str(Path(tmp) / "rope.o")],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            report = out.stdout + out.stderr
            cells = []
            for mangled in MANGLED:  # nvcc names each entry by its mangled name
                found = re.search(
                    rf"Compiling entry function '{mangled}[^']*'.*?"
                    r"(\d+) bytes spill stores.*?Used (\d+) registers",
                    report,
                    re.S,
                )
                cells.append(f"{found[2]} regs, {found[1]} spill" if found else "?")
            print(f"{label:24} " + " ".join(f"{c:>28}" for c in cells))


def capture_launch(call: Any) -> dict[str, Any]:
    """The arguments of the one kernel launch ``call()`` makes (it still launches)."""
    captured: dict[str, Any] = {}
    real = _kernels.launch

    def capture(c: Any, source: str, name: str, grid: Any, block: Any, a: Any, **kw: Any) -> None:
        captured.update(source=source, name=name, grid=grid, block=block, args=a, kw=kw)
        real(c, source, name, grid, block, a, **kw)

    _kernels.launch = capture  # type: ignore[assignment]
    try:
        call()
    finally:
        _kernels.launch = real  # type: ignore[assignment]
    return captured


if __name__ == "__main__":
    main()
