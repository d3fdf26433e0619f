"""An experiment for the RoPE kernel, run beside the kernel in use (needs an NVIDIA GPU and CuPy).

``rope_cuda.py`` measured the in-place forward at 85-93% of a device-to-device copy on an H100,
tied with Liger-Kernel at fp32 B=4 T=4096 (both at 93%). This times, on the same arguments, the
kernel as compiled for the op and a variant of its source whose 16-byte Q/K loads and stores
carry streaming cache hints (``__ldcs``/``__stcs``: evict first, each byte is touched once).
The variant's output must equal the kernel's bit for bit before it is timed. CUDA events, median
of ``--repeats`` rounds of ``--calls`` launches, each case on fresh buffers:

    python benchmarks/rope_cuda_variants.py [--calls 20] [--repeats 15]

Prints, per dtype and shape, the kernel's time, the variant's, and kernel / variant (> 1: the
variant is faster). A variant that wins here is a candidate for ``ROPE_CUDA_SOURCE``; the
library itself is unchanged by this script.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.devices.cuda import cuda_device_count
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda.rope import ROPE_CUDA_SOURCE

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 8192), (4, 4096)]

#: loads and stores of whole 16-byte packs with streaming hints; narrower packs unchanged
STREAMING_HELPERS = r"""
template <typename P> __device__ __forceinline__ P mila_load(const P* p) {
    if constexpr (sizeof(P) == 16) {
        const int4 v = __ldcs(reinterpret_cast<const int4*>(p));
        return *reinterpret_cast<const P*>(&v);
    } else {
        return *p;
    }
}
template <typename P> __device__ __forceinline__ void mila_store(P* p, const P& v) {
    if constexpr (sizeof(P) == 16) {
        __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
    } else {
        *p = v;
    }
}
"""


def streaming_variant(source: str) -> str:
    """``source`` with every ``Pack`` load and store routed through :data:`STREAMING_HELPERS`."""
    loads = re.compile(r"\*reinterpret_cast<const Pack<T, VEC>\*>\(([^;]*?)\);")
    stores = re.compile(r"\*reinterpret_cast<Pack<T, VEC>\*>\(([^;]*?)\) = (\w+);")
    out, n_loads = loads.subn(r"mila_load(reinterpret_cast<const Pack<T, VEC>*>(\1));", source)
    out, n_stores = stores.subn(r"mila_store(reinterpret_cast<Pack<T, VEC>*>(\1), \2);", out)
    if n_loads != 3 or n_stores != 3:  # the kernel's three pack loads and three pack stores
        raise SystemExit(f"the kernel's source changed: {n_loads} loads, {n_stores} stores matched")
    anchor = "template <typename T, int VEC> struct alignas"
    head, sep, tail = out.partition(anchor)
    return head + STREAMING_HELPERS + sep + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    variant_source = streaming_variant(ROPE_CUDA_SOURCE)
    if cuda_device_count() == 0:
        raise SystemExit("rope_cuda_variants.py needs an NVIDIA GPU and CuPy (none seen)")
    import cupy

    cfg = RopeConfig(channels=HEADS * HEAD_DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                     max_seq_len=8192)  # fmt: skip
    rng = np.random.default_rng(0)
    print(f"{'case':24} {'dtype':5} {'kernel us':>10} {'variant us':>11} {'kernel/variant':>15}")
    for precision in (Precision.FP32, Precision.BF16):
        for n_b, n_t in SHAPES:
            print(
                measure_case(cupy, cfg, precision, n_b, n_t, rng, variant_source, args), flush=True
            )
            cupy.get_default_memory_pool().free_all_blocks()


def measure_case(cupy: Any, cfg: RopeConfig, precision: Precision, n_b: int, n_t: int,
                 rng: np.random.Generator, variant_source: str, args: argparse.Namespace) -> str:  # fmt: skip
    """One table line: the op's forward kernel and the variant on the same arguments."""
    rope = Rope("rope", cfg, device="CUDA:0", precision=precision)
    rope.build(BuildContext((n_b, n_t, cfg.channels), RuntimeMode.INFERENCE))
    ctx = rope.execution_context
    shape_q, shape_k = (n_b, n_t, cfg.channels), (n_b, n_t, cfg.kv_channels)
    q = ctx.to_device(rng.standard_normal(shape_q, dtype=np.float32).astype(precision.numpy_dtype))
    k = ctx.to_device(rng.standard_normal(shape_k, dtype=np.float32).astype(precision.numpy_dtype))
    launch = capture_launch(lambda: rope.forward(q, k))
    names = launch["kw"].get("name_expressions", ())
    device = ctx.device_id.index
    kernel = _kernels.kernel(launch["source"], launch["name"], device, names)
    variant = _kernels.kernel(variant_source, launch["name"], device, names)
    grid, block, shared = launch["grid"], (launch["block"],), launch["kw"]["shared_mem"]
    q0, k0 = q.copy(), k.copy()

    def run(fn: Any) -> None:
        fn(grid, block, launch["args"], shared_mem=shared, stream=ctx.stream)

    results = []
    for fn in (kernel, variant):  # the same function of the same input, bit for bit
        q.view(cupy.uint8)[...] = q0.view(cupy.uint8)
        k.view(cupy.uint8)[...] = k0.view(cupy.uint8)
        run(fn)
        ctx.synchronize()
        results.append((cupy.asnumpy(q.view(cupy.uint8)), cupy.asnumpy(k.view(cupy.uint8))))
    dtype = "fp32" if precision is Precision.FP32 else "bf16"
    case = f"forward B={n_b} T={n_t}"
    if not all(np.array_equal(a, b) for a, b in zip(*results, strict=True)):
        return f"{case:24} {dtype:5} variant output differs: not timed"
    mine, other = (
        median_us(cupy, ctx.stream, lambda fn=fn: run(fn), args) for fn in (kernel, variant)
    )
    return f"{case:24} {dtype:5} {mine:10.1f} {other:11.1f} {mine / other:15.3f}"


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


def median_us(cupy: Any, stream: Any, fn: Any, args: argparse.Namespace) -> float:
    for _ in range(3):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(args.repeats):
        start.record(stream)
        for _ in range(args.calls):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.calls)
    return statistics.median(times)


if __name__ == "__main__":
    main()
