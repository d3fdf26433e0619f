"""Data parallelism: what averaging the gradients costs a training step, on CPUs or on a GPU.

Every rank runs a training step (forward, cross-entropy, backward, AdamW) of a Llama (``--size
small``: the ~10M model of ``train_step.py``; ``medium``: ~120M) on its own ``--batch``
sequences, so N ranks train on N times the batch of one. Rounds are interleaved (each row once
per round, after a warm-up round); each figure is the median over the rounds, a step's time the
slowest rank's.

``--device CPU`` (the default): two ranks over MPI on one machine. Rows:

- ``1 rank alone``: rank 0's step while rank 1 waits: one process on the machine.
- ``2 ranks, no all-reduce``: both ranks step at once without talking: what sharing the
  machine's cores and memory costs, before any communication.
- ``2 ranks, blocking all-reduce``: :class:`~mila_py.distributed.GradientAllReduce` after
  backward, with no block hooks (``overlap=False``).
- ``2 ranks, overlapped all-reduce``: the buckets launched from the block hooks during
  backward (nonblocking ``Iallreduce``), the rest at the call.
- ``all-reduce alone``: the call with nothing launched before it (all buckets: the copies,
  the transfer, the scaling), no compute around it.
- ``pack + unpack alone``: the two copies between the gradients and the flat buckets.

The summary says how much of the all-reduce's time the overlapped step hides behind backward.
It starts itself under ``mpirun -n 2`` (``--ranks``) with ``OMP_NUM_THREADS`` = cores / ranks
unless set; ``--async-progress`` sets ``MPIR_CVAR_ASYNC_PROGRESS=1``: MPICH's progress thread,
which moves a nonblocking all-reduce along while the rank computes.

``--device CUDA:0``: the NCCL path on GPUs. One process by default: a one-rank world with
``backend="nccl"``; under ``mpirun -n N`` (or ``--ranks N``) on a node of N GPUs, rank r on
``CUDA:r``. Rows: no all-reduce, blocking, overlapped, and the call alone, with the step's wall
time (to a synchronized end), its span on the model's stream (CUDA events), the time the
all-reduce's own stream was busy (events around each bucket's pack + all-reduce and around the
unpack), and how much of that ran before the model's stream finished backward: the part of
the all-reduce that overlaps backward. On one rank NCCL's in-place sum returns without work
(NCCL short-cuts a one-rank communicator: a copy out of place, nothing in place), so one GPU
times everything around the transfer (the bucket copies, the scaling, the hand-offs between
the streams, the host's launches in the block hooks), not the transfer itself.

Run: ``python benchmarks/allreduce.py [--device CPU|CUDA:0] [--steps 8] [--bucket-mib 25]
[--size small|medium] [--async-progress]``, or ``mpirun -n 2 python benchmarks/allreduce.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.devices import DeviceId, DeviceType
from mila_py.devices.cuda import cuda_device_count
from mila_py.distributed import GradientAllReduce, World, broadcast_parameters, init_world, is_main
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

SIZES = {
    "small": LlamaConfig(
        vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024,
        max_seq_len=256,
    ),
    "medium": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2048,
        max_seq_len=512,
    ),
}  # fmt: skip
_LAUNCHED = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def relaunch(args: argparse.Namespace, ranks: int) -> int:
    """Start this script under ``mpirun -n ranks`` and return its exit status."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        print("needs an MPI launcher (mpirun): pip install mpi4py mpich", file=sys.stderr)
        return 1
    env = dict(os.environ)
    # Open MPI refuses to run as root (containers) without this consent; MPICH ignores it
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("NUMBA_NUM_THREADS", env["OMP_NUM_THREADS"])
    if args.async_progress:
        env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
    command = [mpirun, "-n", str(ranks), sys.executable, *sys.argv]
    return subprocess.run(command, env=env).returncode


class Replica:
    """One rank's model, loss and optimizer on ``device``, with an all-reduce or none."""

    def __init__(
        self,
        world: World,
        cfg: LlamaConfig,
        device: str,
        n_b: int,
        n_t: int,
        overlap: bool | None,
        bucket_bytes: int,
        backend: str = "auto",
    ) -> None:
        self.model = Llama("llama", cfg, device=device)
        self.model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
        broadcast_parameters(self.model, world)
        self.loss_fn = SoftmaxCrossEntropy(
            "loss", SoftmaxCrossEntropyConfig(cfg.vocab_size), device=device
        )
        self.loss_fn.build(BuildContext((n_b, n_t, cfg.vocab_size), RuntimeMode.TRAINING))
        self.opt = AdamW(self.model, lr=1e-4, weight_decay=0.1)
        self.allreduce = (
            None
            if overlap is None
            else GradientAllReduce(
                self.model, world, bucket_bytes, overlap=overlap, backend=backend
            )
        )
        #: seconds of the last step in the block hooks (during backward) and in the call after
        self.in_hooks, self.in_call = 0.0, 0.0
        #: called between backward and the all-reduce (the GPU rows mark the model's stream)
        self.after_backward: Callable[[], None] = lambda: None
        hooks = self.model.block_backward_hooks
        hooks[:] = [self._timed(hook) for hook in hooks]

    def _timed(self, hook: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(block: Any) -> None:
            start = time.perf_counter()
            hook(block)
            self.in_hooks += time.perf_counter() - start

        return run

    def step(self, tokens: Any, targets: Any) -> None:
        self.in_hooks = 0.0
        self.loss_fn.forward(self.model.forward(tokens), targets)
        self.model.backward(self.loss_fn.backward())
        self.after_backward()
        start = time.perf_counter()
        if self.allreduce is not None:
            self.allreduce(self.model)
        self.in_call = time.perf_counter() - start
        self.opt.step()
        self.model.zero_gradients()


def pack_unpack(grads: list[Any]) -> Callable[[], None]:
    """The all-reduce's two copies, gradients -> one flat buffer -> gradients, without MPI."""
    flat = np.empty(sum(g.size for g in grads), np.float32)
    offsets = np.cumsum([0] + [g.size for g in grads]).tolist()

    def run() -> None:
        for g, o in zip(grads, offsets, strict=False):
            np.copyto(flat[o : o + g.size].reshape(g.shape), g)
        for g, o in zip(grads, offsets, strict=False):
            np.copyto(g, flat[o : o + g.size].reshape(g.shape))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="CPU", help="CPU (MPI ranks) or CUDA:<n> (NCCL)")
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="interleaved rounds")
    parser.add_argument(
        "--ranks", type=int, default=None, help="ranks to start (default: 2 on CPU, 1 on GPU)"
    )
    parser.add_argument("--bucket-mib", type=float, default=25.0, help="MiB per all-reduce")
    parser.add_argument("--async-progress", action="store_true")
    args = parser.parse_args()
    device = DeviceId.parse(args.device)
    on_gpu = device.device_type is DeviceType.CUDA
    ranks = args.ranks if args.ranks is not None else (1 if on_gpu else 2)
    launched = any(int(os.environ.get(v, "0") or 0) > 1 for v in _LAUNCHED)
    if not launched and ranks > 1:
        sys.exit(relaunch(args, ranks))
    if on_gpu and cuda_device_count() == 0:
        sys.exit(f"allreduce.py --device {device} needs CuPy and a CUDA GPU; CuPy sees none")
    world = init_world() if launched else World()
    if on_gpu:
        gpu_main(world, args, str(device))
    elif world.size < 2:
        sys.exit(
            "allreduce.py --device CPU compares 2 or more MPI ranks, got 1: run it with "
            "--ranks 2 (the default) or under mpirun -n 2"
        )
    else:
        cpu_main(world, args)


# ---------------------------------------------------------------------------------- CPU
def cpu_main(world: World, args: argparse.Namespace) -> None:
    cfg = SIZES[args.size]
    comm = world.comm
    rng = np.random.default_rng(world.rank)
    tokens = rng.integers(0, cfg.vocab_size, size=(args.batch, args.seq))
    targets = rng.integers(0, cfg.vocab_size, size=(args.batch, args.seq))
    bucket_bytes = int(args.bucket_mib * 2**20)
    shape = (cfg, "CPU", args.batch, args.seq)
    local = Replica(world, *shape, None, bucket_bytes)
    blocking = Replica(world, *shape, False, bucket_bytes)
    overlapped = Replica(world, *shape, True, bucket_bytes)
    assert blocking.allreduce is not None and overlapped.allreduce is not None
    reducer = blocking.allreduce
    grads = blocking.model.get_gradients()

    def alone() -> None:
        if world.rank == 0:
            local.step(tokens, targets)

    candidates: dict[str, Callable[[], None]] = {
        "1 rank alone": alone,
        "2 ranks, no all-reduce": lambda: local.step(tokens, targets),
        "2 ranks, blocking all-reduce": lambda: blocking.step(tokens, targets),
        "2 ranks, overlapped all-reduce": lambda: overlapped.step(tokens, targets),
        "all-reduce alone": lambda: reducer(blocking.model),
        "pack + unpack alone": pack_unpack(grads),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    parts: dict[str, list[float]] = {
        "blocking call": [],
        "overlapped hooks": [],
        "overlapped call": [],
    }
    for round_ in range(args.steps + 1):  # the first round warms up (JIT, first touches)
        for name, fn in candidates.items():
            comm.Barrier()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            idle(comm)  # a rank done early sleeps: "1 rank alone" has the machine to itself
            elapsed = comm.allreduce(elapsed, op=_max())
            if round_:
                times[name].append(elapsed)
        if round_:  # the slowest rank's
            for key, value in (
                ("blocking call", blocking.in_call),
                ("overlapped hooks", overlapped.in_hooks),
                ("overlapped call", overlapped.in_call),
            ):
                parts[key].append(comm.allreduce(value, op=_max()))
    early = overlapped.allreduce.last_early_launches
    if not is_main(world):
        return

    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    nbytes = sum(reducer.bucket_nbytes)
    base = ms["2 ranks, no all-reduce"]
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    progress = os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0")
    print(
        f"\nLlama training step, {local.model.parameter_count() / 1e6:.1f}M parameters, "
        f"{world.size} ranks x B={args.batch} T={args.seq}, fp32 CPU, OMP_NUM_THREADS={threads}, "
        f"MPIR_CVAR_ASYNC_PROGRESS={progress}; median of {args.steps} interleaved rounds"
    )
    print(
        f"all-reduce: {nbytes / 2**20:.1f} MiB of gradients per step in {reducer.bucket_count} "
        f"buckets; {early} launched during backward by the block hooks"
    )
    print(f"{'what':<32} {'median ms':>10} {'min ms':>9} {'over no all-reduce':>19}")
    for name, value in ms.items():
        over = f"{value - base:+9.1f} ms" if name.startswith("2 ranks") else ""
        print(f"{name:<32} {value:10.1f} {min(times[name]) * 1e3:9.1f} {over:>19}")
    reduce_ms = ms["all-reduce alone"]
    exposed = {k: ms[f"2 ranks, {k} all-reduce"] - base for k in ("blocking", "overlapped")}
    moved = 2 * (world.size - 1) / world.size * nbytes
    print(
        f"all-reduce alone moves {moved / 2**20:.1f} MiB per rank: "
        f"{moved / (reduce_ms * 1e-3) / 1e9:.2f} GB/s; "
        f"the copies take {ms['pack + unpack alone'] / reduce_ms:.0%} of it"
    )
    print(
        f"step - no all-reduce step: blocking {exposed['blocking']:+.1f} ms, "
        f"overlapped {exposed['overlapped']:+.1f} ms"
    )
    part = {key: statistics.median(t) * 1e3 for key, t in parts.items()}
    waited = part["overlapped hooks"] + part["overlapped call"]
    print(
        f"time in the all-reduce: blocking {part['blocking call']:.1f} ms at the call; "
        f"overlapped {part['overlapped hooks']:.1f} ms in the hooks during backward + "
        f"{part['overlapped call']:.1f} ms at the call: "
        f"{1 - waited / part['blocking call']:.0%} of the blocking time off the critical path"
    )
    scaling = ms["1 rank alone"] / ms["2 ranks, overlapped all-reduce"] * world.size
    print(
        f"throughput of {world.size} ranks (overlapped) / 1 rank alone: {scaling:.2f}x "
        f"(ideal {world.size}x)"
    )


def idle(comm: Any) -> None:
    """Wait for every rank without spinning (MPI's own waits poll, and take a core)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def _max() -> Any:
    from mila_py.distributed import import_mpi

    return import_mpi().MAX


# ---------------------------------------------------------------------------------- GPU
class CommTimeline:
    """CUDA events around the work of ``allreduce``'s stream: one interval per bucket launched
    (its pack and all-reduce, from when both the model's stream and the earlier buckets let it
    start) and one for the unpack and scaling at the call."""

    def __init__(self, allreduce: GradientAllReduce) -> None:
        import cupy

        self._cupy = cupy
        engine = allreduce._engine
        ctx = allreduce.model.execution_context
        self.intervals: list[tuple[Any, Any]] = []
        launch, finish = engine.launch, engine.finish
        comm_stream = engine._stream

        def timed_launch(bucket: Any) -> None:
            # the launch orders its stream after the model's the same way: the start event
            # then marks when the bucket's copies can begin, not when the host launched them
            ready = cupy.cuda.Event(disable_timing=True)
            ready.record(ctx.stream)
            comm_stream.wait_event(ready)
            start = self._event(comm_stream)
            launch(bucket)
            self.intervals.append((start, self._event(comm_stream)))

        def timed_finish(buckets: Any, scale: float) -> None:
            start = self._event(comm_stream)
            finish(buckets, scale)
            self.intervals.append((start, self._event(comm_stream)))

        engine.launch, engine.finish = timed_launch, timed_finish

    def _event(self, stream: Any) -> Any:
        event = self._cupy.cuda.Event()
        event.record(stream)
        return event


class GpuStep:
    """One timed run of a row: wall time to a synchronized end, and events on the model's
    stream at the start, after backward and at the end."""

    def __init__(self, replica: Replica, timeline: CommTimeline | None) -> None:
        import cupy

        self._cupy = cupy
        self.replica, self.timeline = replica, timeline
        self.stream = replica.model.execution_context.stream  # type: ignore[attr-defined]
        self.marks: dict[str, Any] = {}
        replica.after_backward = lambda: self._mark("backward")

    def _mark(self, name: str) -> None:
        event = self._cupy.cuda.Event()
        event.record(self.stream)
        self.marks[name] = event

    def run(self, fn: Callable[[], None]) -> dict[str, float]:
        """``fn`` once: ``{"wall", "span", "comm", "comm_in_backward"}`` in ms."""
        cupy = self._cupy
        cupy.cuda.runtime.deviceSynchronize()
        self.marks.clear()
        if self.timeline is not None:
            self.timeline.intervals.clear()
        start = time.perf_counter()
        self._mark("start")
        fn()
        self._mark("end")
        cupy.cuda.runtime.deviceSynchronize()
        wall = (time.perf_counter() - start) * 1e3
        first = self.marks["start"]

        def at(event: Any) -> float:
            return float(cupy.cuda.get_elapsed_time(first, event))

        backward_end = at(self.marks["backward"]) if "backward" in self.marks else 0.0
        intervals = [(at(a), at(b)) for a, b in (self.timeline.intervals if self.timeline else [])]
        return {
            "wall": wall,
            "span": at(self.marks["end"]),
            "comm": sum(b - a for a, b in intervals),
            "comm_in_backward": sum(max(0.0, min(b, backward_end) - a) for a, b in intervals),
        }


def gpu_main(world: World, args: argparse.Namespace, device: str) -> None:
    import cupy

    cfg = SIZES[args.size]
    if world.is_distributed:  # one GPU per rank, by its index on the node
        device, backend = world.device(), "auto"
    else:  # a communicator of one GPU: the whole path, NCCL's sum over one rank
        backend = "nccl"
    rng = np.random.default_rng(world.rank)
    bucket_bytes = int(args.bucket_mib * 2**20)
    shape = (cfg, device, args.batch, args.seq)
    local = Replica(world, *shape, None, bucket_bytes)
    blocking = Replica(world, *shape, False, bucket_bytes, backend)
    overlapped = Replica(world, *shape, True, bucket_bytes, backend)
    assert blocking.allreduce is not None and overlapped.allreduce is not None
    ctx = local.model.execution_context
    tokens = ctx.to_device(rng.integers(0, cfg.vocab_size, size=(args.batch, args.seq)))
    targets = ctx.to_device(rng.integers(0, cfg.vocab_size, size=(args.batch, args.seq)))
    reducer = blocking.allreduce
    timed = {
        "no all-reduce": GpuStep(local, None),
        "blocking all-reduce": GpuStep(blocking, CommTimeline(blocking.allreduce)),
        "overlapped all-reduce": GpuStep(overlapped, CommTimeline(overlapped.allreduce)),
    }
    candidates: dict[str, tuple[GpuStep, Callable[[], None]]] = {
        name: (step, lambda step=step: step.replica.step(tokens, targets))  # type: ignore[misc]
        for name, step in timed.items()
    }
    candidates["all-reduce alone (the call)"] = (
        timed["blocking all-reduce"],
        lambda: reducer(blocking.model),
    )
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in candidates}
    host: dict[str, list[float]] = {
        "blocking call": [],
        "overlapped hooks": [],
        "overlapped call": [],
    }
    with ctx.activate():
        for round_ in range(args.steps + 1):  # the first round warms up (kernel builds, pools)
            for name, (step, fn) in candidates.items():
                world.barrier()
                got = step.run(fn)
                if round_:
                    for key, value in got.items():
                        figures[name].setdefault(key, []).append(_slowest(world, value))
            if round_:
                for key, value in (
                    ("blocking call", blocking.in_call),
                    ("overlapped hooks", overlapped.in_hooks),
                    ("overlapped call", overlapped.in_call),
                ):
                    host[key].append(_slowest(world, value * 1e3))
    early = overlapped.allreduce.last_early_launches
    if not is_main(world):
        return

    med = {name: {k: statistics.median(v) for k, v in f.items()} for name, f in figures.items()}
    nbytes = sum(reducer.bucket_nbytes)
    print(
        f"\nLlama training step, {local.model.parameter_count() / 1e6:.1f}M parameters, "
        f"{world.size} rank(s) x B={args.batch} T={args.seq}, fp32 on "
        f"{cupy.cuda.runtime.getDeviceProperties(ctx.device_id.index)['name'].decode()} "
        f"({device}), cupy {cupy.__version__}, NCCL {_nccl_version()}; median of {args.steps} "
        "interleaved rounds"
    )
    print(
        f"all-reduce: {nbytes / 2**20:.1f} MiB of gradients per step in {reducer.bucket_count} "
        f"buckets over {world.size} rank(s) (backend={backend!r}); {early} launched during "
        "backward by the block hooks"
    )
    if world.size == 1:
        print(
            "one rank: NCCL's in-place sum does no work; the all-reduce's time is its copies, "
            "scaling and stream hand-offs"
        )
    print(
        f"{'what':<29} {'wall ms':>9} {'GPU span ms':>12} {'comm stream ms':>15} "
        f"{'during backward':>16}"
    )
    for name, m in med.items():
        comm = f"{m['comm']:15.3f}" if name != "no all-reduce" else f"{'-':>15}"
        during = (
            f"{m['comm_in_backward']:9.3f} ({m['comm_in_backward'] / m['comm']:4.0%})"
            if name == "overlapped all-reduce" and m["comm"] > 0
            else f"{'-':>16}"
        )
        print(f"{name:<29} {m['wall']:9.2f} {m['span']:12.2f} {comm} {during:>16}")
    base = med["no all-reduce"]
    over = {k: med[f"{k} all-reduce"] for k in ("blocking", "overlapped")}
    print(
        "step - no all-reduce step: "
        f"blocking {over['blocking']['wall'] - base['wall']:+.2f} ms wall, "
        f"{over['blocking']['span'] - base['span']:+.2f} ms on the GPU; "
        f"overlapped {over['overlapped']['wall'] - base['wall']:+.2f} ms wall, "
        f"{over['overlapped']['span'] - base['span']:+.2f} ms on the GPU"
    )
    ov = over["overlapped"]
    print(
        f"the all-reduce's stream per step: blocking {over['blocking']['comm']:.3f} ms, all after "
        f"backward; overlapped {ov['comm']:.3f} ms, of which {ov['comm_in_backward']:.3f} ms "
        f"({ov['comm_in_backward'] / max(ov['comm'], 1e-9):.0%}) while the model's stream ran "
        "backward"
    )
    part = {key: statistics.median(t) for key, t in host.items()}
    print(
        f"host time in the all-reduce: blocking {part['blocking call']:.2f} ms at the call; "
        f"overlapped {part['overlapped hooks']:.2f} ms in the hooks during backward + "
        f"{part['overlapped call']:.2f} ms at the call"
    )


def _slowest(world: World, value: float) -> float:
    """The largest ``value`` over the ranks (the value itself in one process)."""
    return value if world.comm is None else float(world.comm.allreduce(value, op=_max()))


def _nccl_version() -> str:
    from cupy.cuda import nccl

    code = nccl.get_version()  # 2.19.3 is 21903 (X * 10000 + Y * 100 + Z since 2.9)
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 20900 else str(code)


if __name__ == "__main__":
    main()
