"""Decode products on a GPU: ``linear.cu``'s ``linear_rows`` against ``cupy.matmul`` and a copy.

The experiment that decides whether the decode product kernel stays. A decode step's products
(a few rows, one per sequence) are one ``linear_rows`` launch each (what
``CudaLinearOp.bind_forward`` binds, so that the step can be captured as a CUDA graph; CuPy
refuses cuBLAS calls during a capture). That is worth it only if the kernel streams the weights
at close to the memory's bandwidth: a Llama-3.2-1B-shaped decode step reads ~4.9 GB of fp32
weights, ~1.2 ms at 4.2 TB/s. This script measures, for the 1B shape's products (per layer:
qkv 2048->3072, o 2048->2048, gate and up 2048->8192 each (two launches: CUDA builds do not
pack them), down 8192->2048; once: the tied head 2048->128256), at B in ``--batches`` (1, 8)
rows and in ``--precisions`` (fp32, bf16):

- ``ours``: the bound ``linear_rows`` launch, in µs per call and GB/s of weight read;
- ``matmul``: ``cupy.matmul`` (cuBLAS) of the same operands into the same output;
- ``floor``: the weight's bytes over the bandwidth of a device-to-device copy of those bytes
  (``cudaMemcpyAsync``; bandwidth = bytes read + bytes written over its time), measured in the
  same run: no kernel reads a weight faster. ``x floor`` is ours over it; ``matmul/ours`` above
  1 means the kernel is faster than cuBLAS.

A final table adds the products of one decode step (16 layers and the head) per precision and
batch: the figure to hold against the targets (B=1 within 1.5x of the floor, B=8 within 2x).

Timing: each figure is the median over ``--rounds`` rounds of ``--calls`` back-to-back calls
between two CUDA events. Every round starts with an untimed lead copy that keeps the GPU busy
while the host enqueues the timed calls, so the events time the GPU's work, not the host's
launch rate (a round whose enqueueing took longer than the lead is flagged ``host-bound``).
Each call reads the next of several copies of its weight (together larger than ``--rotate-mb``)
so that no weight stays in L2 between calls, as in a decode step that streams the whole model.
Before timing, the kernel's output is checked against the matmul's.

Run: ``python benchmarks/decode_products.py [--device CUDA:0] [--batches 1 8]
[--precisions fp32 bf16]``. Without CuPy or a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py import Precision
from mila_py.components import LinearConfig
from mila_py.devices import DeviceId, create_execution_context
from mila_py.devices.cuda import cuda_device_count
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda.linear import CudaLinearOp

#: (name, in, out, launches per decode step) of the Llama-3.2-1B shape's products
SHAPES = (
    ("qkv", 2048, 3072, 16),
    ("o", 2048, 2048, 16),
    ("gate/up", 2048, 8192, 32),
    ("down", 8192, 2048, 16),
    ("head", 2048, 128256, 1),
)
PRECISIONS = {"fp32": Precision.FP32, "bf16": Precision.BF16, "fp16": Precision.FP16}
#: bytes the lead copy moves each way before a round's timed calls
LEAD_BYTES = 2 << 30


@dataclass
class Row:
    name: str
    precision: str
    batch: int
    nbytes: int
    per_step: int
    ours: float  # seconds per call
    matmul: float
    floor: float
    host_bound: bool


class Timer:
    """CUDA-event timing of back-to-back calls behind a lead copy (see the module docstring)."""

    def __init__(self, cupy: Any, ctx: Any, rounds: int, calls: int) -> None:
        self.cupy, self.ctx, self.rounds, self.calls = cupy, ctx, rounds, calls
        self.stream = ctx.stream
        self.lead_src = cupy.empty(LEAD_BYTES, cupy.uint8)
        self.lead_dst = cupy.empty_like(self.lead_src)
        self.lead_seconds = self._events(self._lead, 1)[0]

    def _lead(self) -> None:
        copy_bytes(self.cupy, self.lead_dst, self.lead_src, self.stream)

    def _events(self, call: Callable[[], Any], n: int) -> tuple[float, float]:
        """(GPU seconds of ``n`` calls, host seconds of enqueueing them), after a lead copy."""
        cupy = self.cupy
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        with self.ctx.activate():
            self._lead()
            start.record(self.stream)
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            host = time.perf_counter() - t0
            end.record(self.stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3, host

    def per_call(self, calls: Sequence[Callable[[], Any]]) -> tuple[float, bool]:
        """(median GPU seconds per call, whether any round was host-bound): ``self.calls``
        calls per round, cycling through ``calls``."""
        n = max(self.calls, len(calls))
        cycle = [calls[i % len(calls)] for i in range(n)]

        def run() -> None:
            for c in cycle:
                c()

        run()  # warm-up: compile, caches, cuBLAS workspaces
        self.stream.synchronize()
        times, host_bound = [], False
        for _ in range(self.rounds):
            gpu, host = self._events(run, 1)
            times.append(gpu / n)
            host_bound |= host > self.lead_seconds
        return statistics.median(times), host_bound


def copy_bytes(cupy: Any, dst: Any, src: Any, stream: Any) -> None:
    """One device-to-device ``cudaMemcpyAsync`` of ``src``'s bytes into ``dst``."""
    kind = cupy.cuda.runtime.memcpyDeviceToDevice
    cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, kind, stream.ptr)


def matmul_call(cupy: Any, x: Any, w: Any, out: Any) -> Callable[[], None]:
    """``out [B, 1, N] = x [B, 1, K] @ w [N, K]^T`` by ``cupy.matmul`` (cuBLAS), bound."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    return lambda: _kernels.matmul(cupy, x2, w.T, out2)


def copy_call(cupy: Any, dst: Any, src: Any, stream: Any) -> Callable[[], None]:
    """A copy of ``src``'s bytes into ``dst``, bound."""
    return lambda: copy_bytes(cupy, dst, src, stream)


def measure(
    cupy: Any, ctx: Any, timer: Timer, precision: Precision, batch: int, rotate_bytes: int
) -> list[Row]:
    """The rows of one precision and batch size, every product of :data:`SHAPES`."""
    dtype = precision.numpy_dtype
    rng = np.random.default_rng(0)
    rows = []
    for name, k_in, n_out, per_step in SHAPES:
        nbytes = n_out * k_in * dtype.itemsize
        copies = max(1, math.ceil(rotate_bytes / nbytes))
        host_w = (0.02 * rng.standard_normal((n_out, k_in))).astype(dtype)
        weights = [ctx.to_device(host_w) for _ in range(copies)]
        x = ctx.to_device(rng.standard_normal((batch, 1, k_in)).astype(dtype))
        out = ctx.allocate((batch, 1, n_out), dtype)
        want = ctx.allocate((batch, 1, n_out), dtype)
        op = CudaLinearOp(ctx, LinearConfig(k_in, n_out), precision)
        if op._bind_rows(x, weights[0], None, out) is None:
            raise SystemExit(f"decode_products: {name} is not bound to linear_rows")
        ours = [op.bind_forward(x, w, None, out) for w in weights]

        theirs = [matmul_call(cupy, x, w, want) for w in weights]
        with ctx.activate():
            ours[0]()
            theirs[0]()
        got = ctx.to_host(out).astype(np.float64)
        ref = ctx.to_host(want).astype(np.float64)
        scale = np.abs(ref).max()
        tol = 1e-4 if precision is Precision.FP32 else 2e-2
        if np.abs(got - ref).max() > tol * scale:
            raise SystemExit(
                f"decode_products: {name} {precision.name} B={batch}: the kernel's "
                f"output differs from cupy.matmul's by {np.abs(got - ref).max():.3g}"
            )
        t_ours, bound_ours = timer.per_call(ours)
        t_theirs, bound_theirs = timer.per_call(theirs)
        dst = cupy.empty_like(weights[0])
        copies_calls = [copy_call(cupy, dst, w, ctx.stream) for w in weights]
        t_copy, _ = timer.per_call(copies_calls)
        floor = nbytes / (2 * nbytes / t_copy)  # reading the bytes once at the copy's pace
        rows.append(
            Row(name, precision.name.lower(), batch, nbytes, per_step, t_ours, t_theirs, floor,
                bound_ours or bound_theirs)
        )  # fmt: skip
        del weights, dst, ours, theirs, copies_calls
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def print_rows(rows: list[Row]) -> None:
    head = (
        f"{'product':>8} {'prec':>5} {'B':>3} {'MB':>8} {'ours us':>9} {'ours GB/s':>10} "
        f"{'matmul us':>10} {'matmul GB/s':>12} {'floor us':>9} {'x floor':>8} "
        f"{'matmul/ours':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        flag = "  host-bound" if r.host_bound else ""
        print(
            f"{r.name:>8} {r.precision:>5} {r.batch:>3} {r.nbytes / 1e6:>8.1f} "
            f"{r.ours * 1e6:>9.1f} {r.nbytes / r.ours / 1e9:>10.0f} {r.matmul * 1e6:>10.1f} "
            f"{r.nbytes / r.matmul / 1e9:>12.0f} {r.floor * 1e6:>9.1f} {r.ours / r.floor:>8.2f} "
            f"{r.matmul / r.ours:>12.2f}{flag}"
        )


def print_steps(rows: list[Row]) -> None:
    print("\none decode step's products (16 layers and the head)")
    head = (
        f"{'prec':>5} {'B':>3} {'GB':>6} {'ours ms':>8} {'matmul ms':>10} {'floor ms':>9} "
        f"{'x floor':>8} {'matmul/ours':>12}"
    )
    print(head)
    print("-" * len(head))
    keys = sorted({(r.precision, r.batch) for r in rows})
    for precision, batch in keys:
        group = [r for r in rows if (r.precision, r.batch) == (precision, batch)]
        nbytes = sum(r.nbytes * r.per_step for r in group)
        ours = sum(r.ours * r.per_step for r in group)
        theirs = sum(r.matmul * r.per_step for r in group)
        floor = sum(r.floor * r.per_step for r in group)
        print(
            f"{precision:>5} {batch:>3} {nbytes / 1e9:>6.2f} {ours * 1e3:>8.3f} "
            f"{theirs * 1e3:>10.3f} {floor * 1e3:>9.3f} {ours / floor:>8.2f} "
            f"{theirs / ours:>12.2f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="CUDA:0")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--precisions", nargs="+", choices=sorted(PRECISIONS), default=["fp32", "bf16"]
    )
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per figure")
    parser.add_argument("--calls", type=int, default=40, help="calls per round")
    parser.add_argument(
        "--rotate-mb", type=int, default=256, help="weight copies per product at least this large"
    )
    args = parser.parse_args(argv)
    if any(not 1 <= b <= 16 for b in args.batches):
        parser.error(f"--batches: decode products take 1 to 16 rows, got {args.batches}")
    if cuda_device_count() == 0:
        print(
            "decode_products: no CUDA GPU / CuPy found, nothing measured. Run it on a machine "
            'with an NVIDIA GPU after `pip install -e ".[cuda12]"` (or [cuda13]) in the checkout.'
        )
        return 0
    import cupy

    device = DeviceId.parse(args.device)
    ctx: Any = create_execution_context(device)
    props = cupy.cuda.runtime.getDeviceProperties(device.index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name} ({device}), CuPy {cupy.__version__}")
    timer = Timer(cupy, ctx, args.rounds, args.calls)
    rows: list[Row] = []
    for key in args.precisions:
        for batch in args.batches:
            rows += measure(cupy, ctx, timer, PRECISIONS[key], batch, args.rotate_mb << 20)
    print_rows(rows)
    print_steps(rows)
    print(
        "\nfloor: the weight's bytes over a device-to-device copy's bandwidth (bytes read + "
        "written over its time); x floor: ours over it; matmul/ours > 1: the kernel is faster"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
