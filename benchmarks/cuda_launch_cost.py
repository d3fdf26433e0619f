"""Where the host time of one CUDA ``Rope.decode`` call goes (needs an NVIDIA GPU and CuPy).

``benchmarks/rope_cuda.py`` measured a B=1 decode call at ~25 us on an H100 with the host wall
time equal to the event time: the call is host-bound, and the Rope issue asks for <= 10 us.
This splits the call into its layers, each timed as host wall time per call over many calls
(the stream synchronized once at the end; the median of rounds that take every row in turn, so
a slow stretch of the host shows in the spread column rather than in one row):

- ``Rope.decode`` on the buffers it decoded the call before (the component's fast path: identity,
  shape and position checks, then the op's bound launch), with the default launch and with the
  other one (CuPy's launch or the packed ``cuLaunchKernel`` one, ``PACKED_DECODE``);
- ``Rope._decode_at`` (what a parent that checked its arrays calls: the op and the launch);
- ``CudaRopeOp.apply`` and ``CudaRopeOp._launch``;
- the compiled kernel called with the exact argument tuple ``_launch`` builds (CuPy alone);
- the same kernel launched by ``cuLaunchKernel`` with its parameters packed once (the floor of
  any Python launch; its output checked equal to the op's first), and the op's own packed
  launcher (``CudaRopeOp.packed_launcher``, the same launch plus its position's write);
- toy kernels that do nothing: no arguments, the rope kernel's 27 (7 pointers, 20 scalars),
  9 (8 pointers and one ``long long``: the 20 scalars moved to a device block), and 8 pointers
  plus the 20 scalars as one struct passed by value (a NumPy structured scalar);
- ``cupy.cuda.runtime.getDevice()`` and ``ctx.activate()``.

The toy rows say what a launch with fewer scalar arguments would cost; the difference between
the component and the raw launch is the Python the component adds.

    python benchmarks/cuda_launch_cost.py [--calls 3000] [--rounds 5] [--torch]

``--torch`` first initializes torch in the process, as ``rope_cuda.py`` does for its peers (a
CUDA op and a CPU matmul), so that the two scripts' decode figures can be compared. The kernel's
own GPU time per launch is printed too (launches queued back to back behind a long copy): a
call is host-bound where its host time is longer than that.
    python benchmarks/cuda_launch_cost.py --stub-cuda   # no GPU: the Python of the calls
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.devices.cuda import cuda_device_count
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda import rope as cuda_rope

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_plan import stubbed_cuda
from rope_cuda import HostTimer, Row, Timing, fast_path_with_other_launch, run_round
from rope_cuda_variants import capture_launch

TOY_SOURCE = r"""
struct Scalars {
    int use_positions; long long offset; int n_t, n_heads, n_kv_heads, head_dim, n_freq;
    long long q_sb, q_st, k_sb, k_st, qo_sb, qo_st, ko_sb, ko_st;
    float sign; int copy_rest, mrope, mrope_a, mrope_b;
};
extern "C" __global__ void toy0() {}
extern "C" __global__ void toy27(
    const float* a, float* b, const float* c, float* d, const float* e, const float* f,
    const long long* g, int h, long long i, int j, int k, int l, int m, int n,
    long long o, long long p, long long q, long long r, long long s, long long t, long long u,
    long long v, float w, int x, int y, int z, int zz)
{ if (threadIdx.x > 4096) b[0] = h + i + zz; }
extern "C" __global__ void toy9(
    const float* a, float* b, const float* c, float* d, const float* e, const float* f,
    const long long* g, const long long* params, long long offset)
{ if (threadIdx.x > 4096) b[0] = params[0] + offset; }
extern "C" __global__ void toy_struct(
    const float* a, float* b, const float* c, float* d, const float* e, const float* f,
    const long long* g, Scalars s)
{ if (threadIdx.x > 4096) b[0] = s.offset; }
"""

SCALARS = [
    ("use_positions", np.int32), ("offset", np.int64), ("n_t", np.int32),
    ("n_heads", np.int32), ("n_kv_heads", np.int32), ("head_dim", np.int32),
    ("n_freq", np.int32), ("q_sb", np.int64), ("q_st", np.int64), ("k_sb", np.int64),
    ("k_st", np.int64), ("qo_sb", np.int64), ("qo_st", np.int64), ("ko_sb", np.int64),
    ("ko_st", np.int64), ("sign", np.float32), ("copy_rest", np.int32), ("mrope", np.int32),
    ("mrope_a", np.int32), ("mrope_b", np.int32),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--stub-cuda", action="store_true",
        help="no GPU: the component's calls on CUDA:0 with launches stubbed (Python only)",
    )  # fmt: skip
    parser.add_argument(
        "--torch", action="store_true",
        help="initialize torch in this process first (a CUDA op and a CPU matmul), as rope_cuda.py does",
    )  # fmt: skip
    args = parser.parse_args()
    if args.stub_cuda:
        with stubbed_cuda():
            rope, q, k = decode_rope()
            rows = component_rows(rope, q, k)
            emulated = _kernels.launch
            # launch() itself does nothing (no argument packing, no kernel)
            _kernels.launch = lambda *a, **kw: None  # type: ignore[assignment]
            try:
                print(f"host time per call, CUDA:0 with launch() a no-op (the Python alone, no "
                      f"CuPy); median of {args.rounds} interleaved rounds of {args.calls}")  # fmt: skip
                report(rows, lambda: None, args.calls, args.rounds)
            finally:
                _kernels.launch = emulated  # type: ignore[assignment]
        return
    if cuda_device_count() == 0:
        raise SystemExit("cuda_launch_cost.py needs an NVIDIA GPU and CuPy (none seen)")
    import cupy

    if args.torch:
        import torch

        x = torch.ones(1 << 20, device="cuda")
        float((x * 2).sum())  # torch's CUDA state made and used
        y = torch.randn(512, 512)
        float((y @ y).sum())  # and its CPU thread pool
        print(f"torch {torch.__version__} initialized in this process (a CUDA op, a CPU matmul)")
    rope, q, k = decode_rope()
    ctx = rope.execution_context
    op = rope._op  # type: ignore[attr-defined]
    tables = op.table.tables_for(4001)

    captured = capture_launch(lambda: rope.decode(q, k, 4000))  # a checked call: launch()
    kw = captured["kw"]
    function = _kernels.kernel(
        captured["source"], captured["name"], ctx.device_id.index, kw.get("name_expressions", ())
    )
    raw_args, grid, block = captured["args"], captured["grid"], (captured["block"],)
    shared, stream = kw.get("shared_mem", 0), ctx.stream

    toys = cupy.RawModule(code=TOY_SOURCE)
    toy0, toy27 = toys.get_function("toy0"), toys.get_function("toy27")
    toy9, toy_struct = toys.get_function("toy9"), toys.get_function("toy_struct")
    ptrs = (q, q, k, k, tables[0], tables[1], _kernels.NULL)
    scalars = tuple(t(1) for _, t in SCALARS)
    params = cupy.zeros(len(SCALARS), dtype=cupy.int64)
    struct_dtype = np.dtype(SCALARS, align=True)
    struct = np.zeros((), dtype=struct_dtype)[()]

    sync = ctx.synchronize

    def activate() -> None:
        with ctx.activate():
            pass

    rows = [
        *component_rows(rope, q, k),
        (
            f"rope kernel, prebuilt args ({len(raw_args)})",
            lambda: function(grid, block, raw_args, shared_mem=shared, stream=stream),
        ),
        driver_row(cupy, rope, q, k, captured),
        packed_row(cupy, rope, q, k),
        other_launch_decode_row(cupy),
        ("toy kernel, 0 args", lambda: toy0((1,), (128,), (), stream=stream)),
        (
            "toy kernel, 27 args (7 ptr + 20 scalars)",
            lambda: toy27((1,), (128,), (*ptrs, *scalars), stream=stream),
        ),
        (
            "toy kernel, 9 args (8 ptr + int64)",
            lambda: toy9((1,), (128,), (*ptrs, params, np.int64(4000)), stream=stream),
        ),
        (
            "toy kernel, 7 ptr + 1 struct",
            lambda: toy_struct((1,), (128,), (*ptrs, struct), stream=stream),
        ),
        ("cupy.cuda.runtime.getDevice()", cupy.cuda.runtime.getDevice),
        ("with ctx.activate(): pass", activate),
    ]
    props = cupy.cuda.runtime.getDeviceProperties(ctx.device_id.index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"host wall per call, median of {args.rounds} interleaved rounds of {args.calls}; {name}, "
          f"CuPy {cupy.__version__}")  # fmt: skip
    report(rows, sync, args.calls, args.rounds)
    gpu_us = gpu_us_per_launch(cupy, function, grid, block, raw_args, shared, stream)
    print("rope decode kernel on the GPU: "
          + (f"{gpu_us:.2f} us per launch" if gpu_us is not None else "not measured (the copies "
             "ran out before the launches were queued)")
          + ", launches queued back to back (a call is host-bound where its host time is "
          "longer)")  # fmt: skip


def gpu_us_per_launch(cupy: Any, function: Any, grid: Any, block: Any, args: Any, shared: int,
                      stream: Any, launches: int = 50) -> float | None:  # fmt: skip
    """The GPU's own time per launch of ``function``: ``launches`` launches are queued behind
    copies that outlast their host time, so the events around them time the GPU alone (events
    around one launch would also time the host's launch of it). A round counts only where the
    copies were still running once every launch was queued; the median of those (of 20), or
    None where none counted."""
    src = cupy.empty(1 << 28, dtype=cupy.uint8)  # 256 MiB: ~180 us a copy on an H100
    dst = cupy.empty_like(src)
    start, end, queued = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    with stream:
        for _ in range(20):
            for _ in range(8):  # ~1.4 ms of copies (H100) ahead of the launches
                dst[...] = src
            queued.record(stream)  # done when the copies are
            start.record(stream)
            for _ in range(launches):
                function(grid, block, args, shared_mem=shared, stream=stream)
            busy = not queued.done  # the GPU never waited on the host for a launch
            end.record(stream)
            end.synchronize()
            if busy:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / launches)
    return statistics.median(times) if times else None


def driver_row(
    cupy: Any, rope: Rope, q: Any, k: Any, captured: dict[str, Any]
) -> tuple[str, Callable[[], Any]]:
    """The rope kernel launched by ``cuLaunchKernel`` itself (``_kernels.bind_packed_launch``:
    CuPy's driver binding, its 27 parameters packed once as C values, the position fixed): the
    floor of any Python launch of it. Checked first: its output equals the op's on the same
    input, bit for bit."""
    op = rope._op  # type: ignore[attr-defined]
    position = _kernels.ScalarSlot(cupy, np.int64)
    position(4000)
    kw = captured["kw"]
    launch = _kernels.bind_packed_launch(
        op.context, captured["source"], captured["name"], captured["grid"], captured["block"],
        op.launch_values(q, k, position), shared_mem=kw.get("shared_mem", 0),
        name_expressions=kw.get("name_expressions", ()),
    )  # fmt: skip
    label = f"rope kernel, cuLaunchKernel, packed ({same_as_decode(cupy, rope, q, k, launch)})"
    return label, launch


def packed_row(cupy: Any, rope: Rope, q: Any, k: Any) -> tuple[str, Callable[[], Any]]:
    """The op's own packed launcher (``CudaRopeOp.packed_launcher``: what the decode fast path
    calls with ``PACKED_DECODE``), checked bit for bit against ``Rope.decode``."""
    rotate_at = rope._op.packed_launcher(q, k)  # type: ignore[attr-defined]

    def launch() -> None:
        rotate_at(q, k, 4000)

    return f"CudaRopeOp.packed_launcher ({same_as_decode(cupy, rope, q, k, launch)})", launch


def other_launch_decode_row(cupy: Any) -> tuple[str, Callable[[], Any]]:
    """``Rope.decode`` on the buffers it decoded the call before, its fast path made with the
    other launch than the default (``PACKED_DECODE`` flipped while it is made; a component of
    its own, so the other rows keep theirs), checked bit for bit against the op's checked
    path."""
    rope, q, k = decode_rope()
    q0, k0 = q.copy(), k.copy()
    launch, made = fast_path_with_other_launch(rope, q, k, 4000)
    q[...], k[...] = q0, k0

    def decode() -> None:
        rope.decode(q, k, 4000)

    made_text = "fast path made" if made else f"NO {launch.upper()} FAST PATH"
    return (f"Rope.decode, same buffers, {launch} launch ({made_text}, "
            f"{same_as_decode(cupy, rope, q, k, decode)})", decode)  # fmt: skip


def same_as_decode(cupy: Any, rope: Rope, q: Any, k: Any, launch: Callable[[], Any]) -> str:
    """'same bits' where ``launch()`` leaves Q, K as a checked decode at 4000 does (the op's
    ``apply`` on copies: no component's fast path is touched), else 'DIFFERS'; Q and K keep
    their values."""
    q0, k0 = q.copy(), k.copy()
    expected = q.copy(), k.copy()
    rope._op.apply(*expected, offset=4000, seq_len=4001)  # type: ignore[attr-defined]
    launch()
    rope.execution_context.synchronize()
    same = all(bool((a.view(cupy.uint32) == b.view(cupy.uint32)).all())
               for a, b in zip((q, k), expected, strict=True))  # fmt: skip
    q[...], k[...] = q0, k0
    return "same bits" if same else "DIFFERS"


def decode_rope() -> tuple[Rope, Any, Any]:
    """A B=1 decode Rope on CUDA:0 (32/8 heads of 128, fp32) and its Q, K ``[1, 1, width]``."""
    cfg = RopeConfig(channels=32 * 128, n_heads=32, n_kv_heads=8, max_seq_len=8192)
    rope = Rope("rope", cfg, device="CUDA:0", precision=Precision.FP32)
    rope.build(BuildContext((1, 1, cfg.channels), RuntimeMode.INFERENCE))
    ctx = rope.execution_context
    rng = np.random.default_rng(0)
    q = ctx.to_device(rng.standard_normal((1, 1, cfg.channels)).astype(np.float32))
    k = ctx.to_device(rng.standard_normal((1, 1, cfg.kv_channels)).astype(np.float32))
    return rope, q, k


def component_rows(rope: Rope, q: Any, k: Any) -> list[tuple[str, Callable[[], Any]]]:
    """The component's and the op's calls of one decode step at position 4000."""
    op = rope._op  # type: ignore[attr-defined]
    tables = op.table.tables_for(4001)
    other = q.copy(), k.copy()
    turn = [0]

    def alternating() -> None:  # two buffer pairs taking turns: every call checked
        turn[0] ^= 1
        rope.decode(*((q, k) if turn[0] else other), 4000)

    each = np.array([4000])  # a position per sequence (one sequence)

    def alternating_each() -> None:  # checked calls, the positions in the launch
        turn[0] ^= 1
        rope.decode(*((q, k) if turn[0] else other), each)

    def uploaded() -> None:  # checked calls, the positions uploaded (no by-value kernel)
        with _kernels.positions_uploaded():
            alternating_each()

    launch = "packed" if cuda_rope.PACKED_DECODE else "CuPy"
    return [
        (
            f"Rope.decode, same buffers (fast path, {launch} launch)",
            lambda: rope.decode(q, k, 4000),
        ),
        ("Rope.decode, alternating buffers (checked)", alternating),
        ("Rope.decode, positions [B], same buffers (fast path)", lambda: rope.decode(q, k, each)),
        ("Rope.decode, positions [B], alternating (by value)", alternating_each),
        ("Rope.decode, positions [B], alternating (uploaded)", uploaded),
        ("Rope._decode_at (no checks)", lambda: rope._decode_at(q, k, 4000)),
        ("CudaRopeOp.apply", lambda: op.apply(q, k, offset=4000, seq_len=4001)),
        ("CudaRopeOp._launch", lambda: op._launch(q, k, q, k, *tables, None, 4000, False)),
    ]


def report(rows: list[tuple[str, Callable[[], Any]]], sync: Callable[[], None], calls: int,
           rounds: int) -> None:  # fmt: skip
    """Host wall time per call of each row (``calls`` calls, then ``sync()``), timed in
    ``rounds`` rounds that take every row in turn (``rope_cuda.py``'s rounds), so that a slow
    stretch of the host shows in every row's spread rather than setting one row: the median
    over the rounds and the spread (slowest / fastest - 1). A row that raises is reported as
    failed (a variant CuPy refuses is a finding)."""
    timer = HostTimer(sync)
    timings = [Timing(Row(label, "-", 0), "", fn, timer, calls) for label, fn in rows]
    for r in range(rounds):
        run_round(timings, 1, r * len(timings) // rounds)
    print(f"{'what':56} {'us/call':>8} {'spread':>7}")
    for t in timings:
        if t.failed:
            print(f"{t.row.case:56}   {t.row.note.strip()}", flush=True)
            continue
        spread = max(t.rounds) / min(t.rounds) - 1
        print(f"{t.row.case:56} {statistics.median(t.rounds) * 1e6:8.2f} {spread:6.1%}", flush=True)


if __name__ == "__main__":
    main()
