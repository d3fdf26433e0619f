"""Data parallelism on CPUs: what a 2-rank training step costs over a 1-rank step of half the batch.

Every rank runs a training step (forward, cross-entropy, backward, AdamW) of a ~10M-parameter
Llama (the model of ``train_step.py``) on its own ``--batch`` sequences, so two ranks train on
twice the batch of one. Rows, timed in interleaved rounds (a step's time is the slowest rank's):

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

Run: ``python benchmarks/allreduce_cpu.py [--steps 8] [--async-progress]``; it starts itself
under ``mpirun -n 2`` (``--ranks``) with ``OMP_NUM_THREADS`` = cores / ranks unless set.
``--async-progress`` sets ``MPIR_CVAR_ASYNC_PROGRESS=1``: MPICH's progress thread, which moves
a nonblocking all-reduce along while the rank computes.
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
from mila_py.distributed import GradientAllReduce, World, broadcast_parameters, init_world, is_main
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

CFG = LlamaConfig(
    vocab_size=256, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, hidden_dim=1024, max_seq_len=256
)
_LAUNCHED = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def relaunch(args: argparse.Namespace) -> int:
    """Start this script under ``mpirun -n args.ranks`` and return its exit status."""
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        print("needs an MPI launcher (mpirun): pip install mpi4py mpich", file=sys.stderr)
        return 1
    env = dict(os.environ)
    threads = str(max(1, (os.cpu_count() or 1) // args.ranks))
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("NUMBA_NUM_THREADS", env["OMP_NUM_THREADS"])
    if args.async_progress:
        env["MPIR_CVAR_ASYNC_PROGRESS"] = "1"
    command = [mpirun, "-n", str(args.ranks), sys.executable, *sys.argv]
    return subprocess.run(command, env=env).returncode


class Replica:
    """One rank's model, loss and optimizer, with an all-reduce or none."""

    def __init__(
        self, world: World, n_b: int, n_t: int, overlap: bool | None, bucket_bytes: int
    ) -> None:
        self.model = Llama("llama", CFG, device="CPU")
        self.model.build(BuildContext((n_b, n_t), RuntimeMode.TRAINING))
        broadcast_parameters(self.model, world)
        self.loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(256), device="CPU")
        self.loss_fn.build(BuildContext((n_b, n_t, CFG.vocab_size), RuntimeMode.TRAINING))
        self.opt = AdamW(self.model, lr=1e-4, weight_decay=0.1)
        self.allreduce = (
            None
            if overlap is None
            else GradientAllReduce(self.model, world, bucket_bytes, overlap=overlap)
        )
        #: seconds of the last step in the block hooks (during backward) and in the call after
        self.in_hooks, self.in_call = 0.0, 0.0
        hooks = self.model.block_backward_hooks
        hooks[:] = [self._timed(hook) for hook in hooks]

    def _timed(self, hook: Callable[[Any], None]) -> Callable[[Any], None]:
        def run(block: Any) -> None:
            start = time.perf_counter()
            hook(block)
            self.in_hooks += time.perf_counter() - start

        return run

    def step(self, tokens: np.ndarray, targets: np.ndarray) -> None:
        self.in_hooks = 0.0
        self.loss_fn.forward(self.model.forward(tokens), targets)
        self.model.backward(self.loss_fn.backward())
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
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bucket-mib", type=float, default=25.0, help="MiB per all-reduce")
    parser.add_argument("--async-progress", action="store_true")
    args = parser.parse_args()
    if not any(int(os.environ.get(v, "0") or 0) > 1 for v in _LAUNCHED):
        sys.exit(relaunch(args))

    world = init_world()
    comm = world.comm
    rng = np.random.default_rng(world.rank)
    tokens = rng.integers(0, CFG.vocab_size, size=(args.batch, args.seq))
    targets = rng.integers(0, CFG.vocab_size, size=(args.batch, args.seq))
    bucket_bytes = int(args.bucket_mib * 2**20)
    local = Replica(world, args.batch, args.seq, None, bucket_bytes)
    blocking = Replica(world, args.batch, args.seq, False, bucket_bytes)
    overlapped = Replica(world, args.batch, args.seq, True, bucket_bytes)
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


if __name__ == "__main__":
    main()
