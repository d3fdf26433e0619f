"""CUDA RoPE benchmark: mila_py against the copy ceiling and the peer libraries, in one run.

Measures on one GPU, with CUDA events. Every case is set up first (its buffers kept), then timed
in rounds (``--rounds``): each round times every figure of the table in turn (mila_py's, each
peer's, the decode rows' host wall time), starting at a different figure each round, and a
figure is the median over its rounds, so one slow stretch of the GPU or the host cannot set a
row. The ``spread`` column is mila_py's slowest round over its fastest. The table is printed
after every round. Each run of back-to-back calls is timed after an untimed lead call, so the
GPU is busy while the first timed call does its host work: a GPU-bound row is its steady-state
time per call, a host-bound one (decode) the host's pace. Measured:

- the ceiling: a large device-to-device copy (``cudaMemcpyAsync``), counting bytes read + written;
- mila_py ``Rope.forward`` and ``Rope.backward`` (whole component calls), fp32 and bf16, for
  ``B=1 T=8192`` and ``B=4 T=4096`` with 32 query / 8 key heads of 128; bytes counted are Q and K
  read and written once plus the cos/sin rows of the distinct positions;
- mila_py M-RoPE ``Rope.rotate`` (Qwen2-VL sections) on the same shapes at host positions
  ``[3, B, T]`` of a 64-wide image grid (the whole call: host checks and the positions' upload);
- ``Rope.decode`` for ``B=1`` and ``B=64`` (whole component calls, validation included), in
  microseconds per call, timed over many back-to-back calls so host work is included; at one
  position for all, and (``B=64``) at a position per sequence (uploaded with each call);
- peers, each only when importable: Hugging Face ``apply_rotary_pos_emb`` in torch eager and
  under ``torch.compile``, Liger-Kernel's rope, flash-attention's Triton rotary. Peers get their
  own layouts (HF and Liger ``[B, H, T, D]`` views of ``[B, T, H*D]``; flash-attention
  ``[B, T, H, D]``) and precomputed cos/sin ``[1, T, D]`` (half-width for flash-attention); backward is
  ``torch.autograd.grad`` of their forward (no gradient accumulation).

Ratios: ``% copy`` is achieved bandwidth over the copy's; ``x PEER`` is the peer's time over
mila_py's (above 1: mila_py is faster). Before timing, mila_py's output is checked against the
peers' on the same input.

Run: ``python benchmarks/rope_cuda.py`` (``--help`` for options; ``--json PATH`` keeps the raw
numbers, each figure's round medians included; ``--quick`` is a smoke run on small shapes).
Without CuPy or a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.devices.cuda import cuda_device_count

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_SHAPES = ((1, 8192), (4, 4096))
DECODE_BATCHES = (1, 64)
MAX_SEQ = 8192
MROPE_SECTION = (16, 24, 24)  # Qwen2-VL: temporal, height, width frequencies of head_dim 128


@dataclass
class Row:
    case: str
    dtype: str
    nbytes: int
    seconds: float = math.nan  # mila_py's, median over the rounds (NaN until a round timed it)
    peers: dict[str, float] = field(default_factory=dict)  # peer name -> seconds
    note: str = ""
    spread: float = math.nan  # mila_py's slowest round over its fastest, minus 1
    host_wall: float = math.nan  # decode rows: host wall seconds per call


# ---------------------------------------------------------------------------------- timing


class CupyTimer:
    """Per-call seconds from CUDA events recorded on one CuPy stream.

    Each run is one untimed lead call, then ``start``, ``calls`` timed calls and ``end``. The
    lead call keeps the GPU busy while the first timed call does its host work (checks,
    arguments), so that work is not timed as GPU idle time: without it, ~45 us of host work
    before the first of 10 calls would add ~4.5 us to each. A host-bound call (decode) runs at
    the host's pace either way. :class:`TorchTimer` does the same for the peers."""

    def __init__(self, cupy: Any, stream: Any) -> None:
        self.cupy, self.stream = cupy, stream

    def samples(self, fn: Callable[[], object], *, calls: int, repeats: int) -> list[float]:
        """Seconds per call of each of ``repeats`` runs of ``calls`` back-to-back calls."""
        cupy = self.cupy
        warm_up(fn, self.stream.synchronize)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(repeats):
            fn()  # the lead call (see the class's docstring)
            start.record(self.stream)
            for _ in range(calls):
                fn()
            end.record(self.stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls)
        return times

    def median_seconds(self, fn: Callable[[], object], *, calls: int, repeats: int) -> float:
        return statistics.median(self.samples(fn, calls=calls, repeats=repeats))


class TorchTimer:
    """Per-call seconds from CUDA events on torch's current stream, each run after an untimed
    lead call as :class:`CupyTimer`'s."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def samples(self, fn: Callable[[], object], *, calls: int, repeats: int) -> list[float]:
        torch = self.torch
        warm_up(fn, torch.cuda.synchronize)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeats):
            fn()  # the lead call (see CupyTimer)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return times

    def median_seconds(self, fn: Callable[[], object], *, calls: int, repeats: int) -> float:
        return statistics.median(self.samples(fn, calls=calls, repeats=repeats))


class HostTimer:
    """Per-call seconds of host wall time: ``calls`` back-to-back calls, then ``sync()``."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync

    def samples(self, fn: Callable[[], object], *, calls: int, repeats: int) -> list[float]:
        warm_up(fn, self.sync)
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            times.append((time.perf_counter() - begin) / calls)
        return times


def warm_up(fn: Callable[[], object], sync: Callable[[], None], seconds: float = 0.05) -> None:
    """Call ``fn`` back to back for ``seconds`` of wall time (3 calls at least) before it is
    timed: a few calls reach the GPU's steady state, but a host-bound call (decode) measured
    right after the GPU-bound prefill cases ran up to 1.7x slower until the
    host had been busy for a while (a B=1 decode slower than the B=64 one timed next)."""
    begin, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - begin < seconds:
        fn()
        n += 1
        if n % 20 == 0:  # a GPU-bound call queues no more than 20 calls' work past the end
            sync()
    sync()


#: ``Timing.what`` of a decode row's host wall time (its note, not a column)
HOST_WALL = "host wall"


@dataclass
class Timing:
    """One figure of the table, timed once in every round: mila_py's time of ``row``
    (``what`` empty), a peer's (``what`` its name) or a decode row's host wall time
    (:data:`HOST_WALL`)."""

    row: Row
    what: str
    fn: Callable[[], object]
    timer: Any  # CupyTimer, TorchTimer or HostTimer
    calls: int
    rounds: list[float] = field(default_factory=list)  # median seconds per call, each round
    failed: str = ""


def run_round(timings: list[Timing], repeats: int, first: int) -> None:
    """One round: every timing that has not failed, in turn from index ``first`` (each round
    starts elsewhere, so no figure always follows the same one), its median of ``repeats``
    appended to its rounds. One that raises is noted on its row and left out from then on."""
    n = len(timings)
    for i in range(n):
        t = timings[(first + i) % n]
        if t.failed:
            continue
        try:
            t.rounds.append(statistics.median(t.timer.samples(t.fn, calls=t.calls,
                                                              repeats=repeats)))  # fmt: skip
        except Exception as exc:
            t.failed = type(exc).__name__
            t.row.note += f" {t.what or 'mila_py'} failed: {t.failed}: {exc};"


def settle(timings: list[Timing]) -> None:
    """Each figure as the median over its rounds so far (a slow round does not set it), into
    its row; mila_py's spread over the rounds (slowest / fastest - 1) into ``row.spread``."""
    for t in timings:
        if not t.rounds:
            continue
        seconds = statistics.median(t.rounds)
        if t.what == HOST_WALL:
            t.row.host_wall = seconds
        elif t.what:
            t.row.peers[t.what] = seconds
        else:
            t.row.seconds = seconds
            t.row.spread = max(t.rounds) / min(t.rounds) - 1


# ---------------------------------------------------------------------------------- peers


def load_peers(torch: Any, use_compile: bool) -> dict[str, Callable[..., Any]]:
    """Peer forward functions ``fn(q4, k4, cos, sin) -> (q, k)`` by name, where importable.

    ``q4`` is ``[B, T, H, D]`` in and out; each wrapper presents it in the layout its library
    expects through transposed views (free), as a model's attention code does.
    """
    peers: dict[str, Callable[..., Any]] = {}
    try:  # torch.compile keeps one graph per shape and dtype: let it keep them all
        import torch._dynamo

        for limit in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
    except Exception:
        pass
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except Exception as exc:  # transformers missing or changed
        print(f"peer HF eager: not importable ({type(exc).__name__}: {exc})")
    else:

        def hf(q4: Any, k4: Any, cos: Any, sin: Any) -> Any:
            # HF: q, k [B, H, T, D] (a transpose view of the projection), cos, sin [1, T, D]
            q, k = apply_rotary_pos_emb(q4.transpose(1, 2), k4.transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        peers["HF eager"] = hf
        if use_compile:
            peers["HF compile"] = torch.compile(hf, dynamic=False)
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:
        print(f"peer Liger: not importable ({type(exc).__name__})")
    else:

        def liger(q4: Any, k4: Any, cos: Any, sin: Any) -> Any:
            q, k = liger_rotary_pos_emb(q4.transpose(1, 2), k4.transpose(1, 2), cos, sin)
            return q.transpose(1, 2), k.transpose(1, 2)

        peers["Liger"] = liger
    try:
        from flash_attn.layers.rotary import apply_rotary_emb
    except Exception as exc:
        print(f"peer flash-attn triton: not importable ({type(exc).__name__})")
    else:
        halves: dict[int, tuple[Any, Any, Any]] = {}  # id(cos) -> (cos, cos half, sin half)

        def flash(q4: Any, k4: Any, cos: Any, sin: Any) -> Any:
            # flash-attention: x [B, T, H, D], cos/sin [T, D/2], its own half-width tables
            # (made once per table, outside the timed calls after the first)
            entry = halves.get(id(cos))
            if entry is None or entry[0] is not cos:
                half = cos.shape[-1] // 2
                entry = (cos, cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
                halves[id(cos)] = entry
            _, c, s = entry
            return apply_rotary_emb(q4, c, s), apply_rotary_emb(k4, c, s)

        peers["flash-attn"] = flash
    return peers


def flat_numpy(x: Any) -> np.ndarray:
    """A torch ``[B, T, H, D]`` tensor as float32 NumPy ``[B, T, H*D]``."""
    return x.float().reshape(x.shape[0], x.shape[1], -1).cpu().numpy()


# ---------------------------------------------------------------------------------- cases


@dataclass
class Bench:
    """What every case needs: the modules, the peers and the timing options."""

    cupy: Any
    torch: Any
    peers: dict[str, Callable[..., Any]]
    repeats: int
    calls: int
    decode_calls: int
    rng: np.random.Generator
    checks: list[str] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)

    def time(self, row: Row, what: str, fn: Callable[[], object], timer: Any, calls: int) -> None:
        """Time ``fn`` as ``row``'s figure ``what`` in every round (see :class:`Timing`)."""
        self.timings.append(Timing(row, what, fn, timer, calls))


def row_dtype(precision: Precision) -> str:
    """The table's name of ``precision``: fp32, else bf16 (the two the table times)."""
    return "fp32" if precision is Precision.FP32 else "bf16"


def torch_dtype(torch: Any, precision: Precision) -> Any:
    """The torch dtype the peers get for ``precision`` (fp32, else bf16)."""
    return torch.float32 if precision is Precision.FP32 else torch.bfloat16


def copy_ceiling(cupy: Any) -> tuple[Row, Callable[[], None], CupyTimer]:
    """The ceiling: a 1 GiB device-to-device copy (bytes read + written): its row, the copy
    and the timer of its stream."""
    stream = cupy.cuda.Stream(non_blocking=False)
    with stream:
        src = cupy.arange(2**28, dtype=cupy.float32)  # 1 GiB of non-zero data
        dst = cupy.empty_like(src)

    def copy() -> None:
        dst.data.copy_from_device_async(src.data, src.nbytes, stream)

    return Row("copy 1 GiB (ceiling)", "-", 2 * src.nbytes), copy, CupyTimer(cupy, stream)


def peer_tables(torch: Any, rope: Rope, rows: slice, precision: Precision) -> Any:
    """HF-style cos/sin ``[1, T, D]`` (contiguous, broadcast over the batch) made from mila_py's
    own table rows, so every library computes the same function; in the peer's dtype as HF does.
    """
    ctx = rope.execution_context
    cos = torch.from_numpy(ctx.to_host(rope.table.cos)[rows]).cuda()
    sin = torch.from_numpy(ctx.to_host(rope.table.sin)[rows]).cuda()
    dtype = torch_dtype(torch, precision)
    cos = torch.cat([cos, cos], -1)[None].to(dtype).contiguous()
    sin = torch.cat([sin, sin], -1)[None].to(dtype).contiguous()
    return cos, sin


def bench_prefill(
    bench: Bench, cfg: RopeConfig, precision: Precision, n_b: int, n_t: int
) -> list[Row]:
    """Forward and backward of one prefill shape, mila_py and each peer (checked against
    mila_py's output here), and M-RoPE: their rows, timed in the rounds."""
    cupy, torch = bench.cupy, bench.torch
    dtype_name = row_dtype(precision)
    case = f"B={n_b} T={n_t}"
    rope = Rope("rope", cfg, device="CUDA:0", precision=precision)
    rope.build(BuildContext((n_b, n_t, cfg.channels), RuntimeMode.TRAINING))
    ctx = rope.execution_context
    q_host = bench.rng.standard_normal((n_b, n_t, cfg.channels), dtype=np.float32)
    k_host = bench.rng.standard_normal((n_b, n_t, cfg.kv_channels), dtype=np.float32)
    q = ctx.to_device(q_host.astype(precision.numpy_dtype))
    k = ctx.to_device(k_host.astype(precision.numpy_dtype))
    nbytes = 2 * (q.nbytes + k.nbytes) + n_t * (cfg.head_dim // 2) * 8
    timer = CupyTimer(cupy, ctx.stream)
    forward = Row(f"forward {case}", dtype_name, nbytes)
    backward = Row(f"backward {case}", dtype_name, nbytes)
    mrope_row = Row(f"M-RoPE rotate {case}", dtype_name, nbytes)
    # forward in place on the same buffers (a rotation keeps the values bounded); backward:
    # R^T of (dq, dk) into the component's gradient buffers
    bench.time(forward, "", lambda: rope.forward(q, k), timer, bench.calls)
    bench.time(backward, "", lambda: rope.backward(q, k), timer, bench.calls)
    # M-RoPE (Qwen2-VL sections) at host positions [3, B, T]: the component checks them on the
    # host and the op uploads them, so this row includes that upload
    mrope = Rope("mrope", replace(cfg, mrope_section=MROPE_SECTION), device="CUDA:0",
                 precision=precision)  # fmt: skip
    mrope.build(BuildContext((n_b, n_t, cfg.channels), RuntimeMode.INFERENCE))
    grid = np.broadcast_to(np.arange(n_t), (n_b, n_t))
    per_axis = np.stack([grid, grid % 64, grid // 64])
    ctx.synchronize()  # q, k are ready before another stream (the component's own) uses them
    bench.time(mrope_row, "", lambda: mrope.rotate(q, k, per_axis),
               CupyTimer(cupy, mrope.execution_context.stream), bench.calls)  # fmt: skip
    if bench.peers:
        tdtype = torch_dtype(torch, precision)
        tq = torch.from_numpy(q_host).cuda().to(tdtype).view(n_b, n_t, HEADS, HEAD_DIM)
        tk = torch.from_numpy(k_host).cuda().to(tdtype).view(n_b, n_t, KV_HEADS, HEAD_DIM)
        cos, sin = peer_tables(torch, rope, slice(0, n_t), precision)
        # the same function? mila_py forward on the same input against each peer
        check_q = ctx.to_device(flat_numpy(tq).astype(precision.numpy_dtype))
        check_k = ctx.to_device(flat_numpy(tk).astype(precision.numpy_dtype))
        rope.forward(check_q, check_k)
        mine = ctx.to_host(check_q).astype(np.float32)
        del check_q, check_k
        ttimer = TorchTimer(torch)
        for name, fn in bench.peers.items():
            try:
                out_q, _ = fn(tq.clone(), tk.clone(), cos, sin)
                diff = float(np.max(np.abs(flat_numpy(out_q) - mine)))
                bench.checks.append(f"{dtype_name} {case} {name}: max |diff| {diff:.2e}")
                bench.time(forward, name, lambda fn=fn: fn(tq, tk, cos, sin), ttimer, bench.calls)
            except Exception as exc:
                forward.note += f" {name} forward failed: {type(exc).__name__};"
            try:
                bench.time(backward, name, peer_backward(torch, fn, tq, tk, cos, sin), ttimer,
                           bench.calls)  # fmt: skip
            except Exception as exc:
                backward.note += f" {name} backward failed: {type(exc).__name__};"
    return [forward, backward, mrope_row]


def peer_backward(
    torch: Any, fn: Callable[..., Any], tq: Any, tk: Any, cos: Any, sin: Any
) -> Callable[[], Any]:
    """A peer's backward alone: autograd.grad of one recorded forward (no accumulation)."""
    gq = tq.detach().clone().requires_grad_()
    gk = tk.detach().clone().requires_grad_()
    out_q, out_k = fn(gq, gk, cos, sin)
    up_q, up_k = torch.randn_like(out_q), torch.randn_like(out_k)

    def grad() -> Any:
        return torch.autograd.grad((out_q, out_k), (gq, gk), (up_q, up_k), retain_graph=True)

    grad()  # it runs (a failure is the peer's, noted on the row)
    return grad


def bench_decode(bench: Bench, cfg: RopeConfig, precision: Precision, n_b: int) -> list[Row]:
    """Whole ``Rope.decode`` calls, one token per sequence (events and host wall time), and
    each peer on the same shape: their rows, timed in the rounds."""
    torch = bench.torch
    dtype_name = row_dtype(precision)
    rope = decode_component(cfg, precision, n_b)
    ctx = rope.execution_context
    q = ctx.to_device(
        bench.rng.standard_normal((n_b, 1, cfg.channels)).astype(precision.numpy_dtype)
    )
    k = ctx.to_device(
        bench.rng.standard_normal((n_b, 1, cfg.kv_channels)).astype(precision.numpy_dtype)
    )
    variants: list[tuple[str, Any, int]] = [("pos int", 4000, 1)]
    if n_b > 1:
        variants.append(("pos per seq", bench.rng.integers(0, MAX_SEQ, size=n_b), n_b))
    rows = []
    for label, position, distinct in variants:

        def call(position: Any = position) -> None:
            rope.decode(q, k, position)

        nbytes = 2 * (q.nbytes + k.nbytes) + distinct * (cfg.head_dim // 2) * 8
        row = Row(f"decode B={n_b} ({label})", dtype_name, nbytes)
        time_decode(bench, row, call, ctx)
        if bench.peers and label == "pos int":
            tdtype = torch_dtype(torch, precision)
            tq = torch.randn(n_b, 1, HEADS, HEAD_DIM, device="cuda", dtype=tdtype)
            tk = torch.randn(n_b, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=tdtype)
            cos, sin = peer_tables(torch, rope, slice(4000, 4001), precision)
            ttimer = TorchTimer(torch)
            for name, fn in bench.peers.items():
                bench.time(row, name, lambda fn=fn, tq=tq, tk=tk, cos=cos, sin=sin:
                           fn(tq, tk, cos, sin), ttimer, bench.decode_calls)  # fmt: skip
        rows.append(row)
    return rows


def decode_component(cfg: RopeConfig, precision: Precision, n_b: int) -> Rope:
    """A CUDA Rope built for decode steps of ``n_b`` sequences (INFERENCE)."""
    rope = Rope("rope", cfg, device="CUDA:0", precision=precision)
    rope.build(BuildContext((n_b, 1, cfg.channels), RuntimeMode.INFERENCE))
    return rope


def time_decode(bench: Bench, row: Row, call: Callable[[], object], ctx: Any) -> None:
    """``row``'s decode ``call`` timed in the rounds: by CUDA events on ``ctx``'s stream, and
    as host wall time (the row's note)."""
    bench.time(row, "", call, CupyTimer(bench.cupy, ctx.stream), bench.decode_calls)
    bench.time(row, HOST_WALL, call, HostTimer(ctx.synchronize), bench.decode_calls)


# ---------------------------------------------------------------------------------- main


def table(rows: list[Row], peers: list[str]) -> str:
    """The table of ``rows`` (the first is the copy ceiling): time, bandwidth, share of the
    copy's, mila_py's spread over the rounds, each peer's time over mila_py's (``-`` where not
    timed), notes."""

    def num(x: float, spec: str, width: int, unit: str = "") -> str:
        return f"{'-':>{width + len(unit)}}" if math.isnan(x) else f"{x:{width}{spec}}{unit}"

    copy_bw = rows[0].nbytes / rows[0].seconds
    header = f"{'case':<38} {'dtype':<5} {'time':>10} {'GB/s':>7} {'% copy':>7} {'spread':>7}"
    header += "".join(f" {'x ' + p:>12}" for p in peers)
    lines = [f"copy ceiling: {num(copy_bw / 1e9, '.0f', 0)} GB/s (bytes read + written)",
             header, "-" * len(header)]  # fmt: skip
    for r in rows:
        bw = r.nbytes / r.seconds
        line = f"{r.case:<38} {r.dtype:<5} {num(r.seconds * 1e6, '.1f', 8, 'us')}"
        line += f" {num(bw / 1e9, '.0f', 7)} {num(100 * bw / copy_bw, '.1f', 6, '%')}"
        line += f" {num(100 * r.spread, '.1f', 6, '%')}"
        for p in peers:
            line += f" {num(r.peers.get(p, math.nan) / r.seconds, '.2f', 12)}"
        note = r.note.strip()
        if not math.isnan(r.host_wall):
            note = f"host wall {r.host_wall * 1e6:.1f} us/call; {note}".strip()
        lines.append(line + (f"  {note}" if note else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=5,
        help="rounds, each timing every figure of the table in turn; a figure is the median "
        "over its rounds",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=6, help="timed repeats per round")
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per repeat")
    parser.add_argument("--decode-calls", type=int, default=200)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--peer", action="append", default=None, metavar="NAME",
        help="time only this peer (repeatable): 'HF eager', 'HF compile', 'Liger', 'flash-attn'",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the raw numbers to this file")
    parser.add_argument(
        "--quick", action="store_true", help="small shapes and few repeats: a smoke run only"
    )
    args = parser.parse_args()
    prefill_shapes = ((1, 256), (2, 128)) if args.quick else PREFILL_SHAPES
    if args.quick:
        args.rounds, args.repeats, args.calls, args.decode_calls = 2, 2, 2, 5

    if cuda_device_count() == 0:
        print(
            "rope_cuda: no CUDA GPU / CuPy found, nothing measured. Run it on a machine with an "
            'NVIDIA GPU after `pip install -e ".[cuda12]"` (or [cuda13]) in the checkout.'
        )
        return 0

    import cupy

    torch: Any = None
    if not args.no_peers:
        try:
            import torch as torch_module

            torch = torch_module if torch_module.cuda.is_available() else None
        except Exception as exc:
            print(f"peers: torch not importable ({type(exc).__name__}); timing mila_py alone")
    peers = load_peers(torch, not args.no_compile) if torch is not None else {}
    if args.peer:
        missing = [name for name in args.peer if name not in peers]
        if missing:
            print(f"peers asked for but not available: {', '.join(missing)}")
        peers = {name: fn for name, fn in peers.items() if name in args.peer}
    bench = Bench(
        cupy, torch, peers, args.repeats, args.calls, args.decode_calls, np.random.default_rng(0)
    )

    props = cupy.cuda.runtime.getDeviceProperties(0)  # before the timings: names the GPU
    device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    versions = f"CuPy {cupy.__version__}" + (f", torch {torch.__version__}" if torch else "")
    print(f"device: {device}; {versions}; peers: {', '.join(peers) or 'none'}")

    copy, copy_fn, copy_timer = copy_ceiling(cupy)
    bench.time(copy, "", copy_fn, copy_timer, bench.calls)
    rows = [copy]
    cfg = RopeConfig(
        channels=HEADS * HEAD_DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, max_seq_len=MAX_SEQ
    )
    begin = time.perf_counter()

    def set_up(made: list[Row]) -> list[Row]:  # a line per case: setup compiles the peers
        print(f"set up {', '.join(f'{r.case} {r.dtype}' for r in made)}: {len(bench.timings)} "
              f"figures so far ({time.perf_counter() - begin:.0f} s)", flush=True)  # fmt: skip
        return made

    for precision in (Precision.FP32, Precision.BF16):  # every case's buffers stay made
        for n_b, n_t in prefill_shapes:
            rows += set_up(bench_prefill(bench, cfg, precision, n_b, n_t))
        for n_b in DECODE_BATCHES:
            rows += set_up(bench_decode(bench, cfg, precision, n_b))
    for line in bench.checks:
        print("check:", line)
    timings = bench.timings
    print(f"{len(rows)} rows, {len(timings)} figures, timed in {args.rounds} rounds", flush=True)
    begin = time.perf_counter()
    for r in range(args.rounds):
        run_round(timings, bench.repeats, r * len(timings) // args.rounds)
        settle(timings)
        # the table so far after every round (a run cut short still shows what it measured)
        print(f"\nafter round {r + 1} of {args.rounds} ({time.perf_counter() - begin:.0f} s):")
        print(table(rows, list(peers)), flush=True)
    print(
        "\ntargets: prefill >= 85% of copy; every 'x PEER' > 1 (mila_py faster); "
        "decode B=1 <= 10 us per component call"
    )
    if args.json:
        with open(args.json, "w") as fh:
            payload = {
                "device": device,
                "copy_bytes_per_second": rows[0].nbytes / rows[0].seconds,
                "checks": bench.checks,
                "rows": [asdict(r) for r in rows],
                "figures": [
                    {"case": t.row.case, "dtype": t.row.dtype, "what": t.what or "mila_py",
                     "seconds_per_round": t.rounds, "failed": t.failed}
                    for t in timings
                ],
            }  # fmt: skip
            json.dump(payload, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
