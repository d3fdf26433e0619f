"""Data-parallel training of a small Llama, run by tests/test_distributed.py under ``mpirun``.

``mpirun -n 2 python tests/dist_worker.py OUT_DIR``: every rank builds the model from its own
seed, and rank 0 writes what the test checks into ``OUT_DIR`` (``result.npz`` and
``result.json``):

- ``broadcast``: every rank's parameters before and after :func:`broadcast_parameters`;
- one training run per variant in :data:`VARIANTS`: the ranks' parameters after
  :data:`STEPS` AdamW steps on the global batches of :func:`global_batches` (rank ``r`` takes
  rows ``r * B .. r * B + B - 1``), and how many buckets the block hooks launched;
- ``mismatch``: the errors each rank raised for models that differ between ranks.

The test imports :func:`make_model` and :func:`train` to train the single-process reference.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.distributed import GradientAllReduce, broadcast_parameters, init_world, is_main
from mila_py.init import manual_seed
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW

GLOBAL_BATCH, T, STEPS = 4, 8, 5
#: rank 0's initialization seed (rank r draws from SEED + r before the broadcast)
SEED = 100
#: name -> (micro-batches per step, overlap, no_sync on the earlier micro-batches, bucket bytes)
VARIANTS: dict[str, tuple[int, bool, bool, int]] = {
    "overlap": (1, True, False, 4096),
    "blocking": (1, False, False, 4096),
    "one_bucket": (1, True, False, 25 * 2**20),
    "accumulate": (2, True, False, 4096),
    "accumulate_no_sync": (2, True, True, 4096),
}


def config(dim: int = 32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=16
    )


def make_model(batch: int, seed: int, dim: int = 32, device: str = "CPU") -> Llama:
    """A TRAINING build on ``device`` for ``batch`` sequences of ``T`` tokens, initialized
    from ``seed``."""
    manual_seed(seed)
    model = Llama("llama", config(dim), device=device)
    model.build(BuildContext((batch, T), RuntimeMode.TRAINING))
    return model


def global_batches() -> list[np.ndarray]:
    """One ``[GLOBAL_BATCH, T + 1]`` window of token ids per step."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, 64, size=(GLOBAL_BATCH, T + 1)) for _ in range(STEPS)]


def train(
    model: Llama,
    batches: list[np.ndarray],
    micro: int = 1,
    allreduce: GradientAllReduce | None = None,
    no_sync: bool = False,
    after_allreduce: Callable[[], None] | None = None,
) -> list[int]:
    """:data:`STEPS` AdamW steps, each on one ``[B, T + 1]`` window of ``batches`` cut into
    ``micro`` micro-batches whose gradients accumulate, then ``allreduce(model)`` (the earlier
    micro-batches' backward inside ``allreduce.no_sync()`` with ``no_sync``) and
    ``after_allreduce()``, on the model's device. Returns the buckets the block hooks had
    launched at each all-reduce."""
    n_b = batches[0].shape[0]
    ctx = model.execution_context
    loss_fn = SoftmaxCrossEntropy(
        "loss", SoftmaxCrossEntropyConfig(64), device=str(model.device_id)
    )
    loss_fn.build(BuildContext((n_b, T, 64), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    rows = n_b // micro
    early = []
    for window in batches:
        for m in range(micro):
            piece = window[m * rows : (m + 1) * rows]
            tokens = ctx.to_device(np.ascontiguousarray(piece[:, :-1]))
            targets = ctx.to_device(np.ascontiguousarray(piece[:, 1:]))
            loss_fn.forward(model.forward(tokens), targets)
            dlogits = loss_fn.backward(1.0 / micro)
            quiet = allreduce is not None and no_sync and m < micro - 1
            with allreduce.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[union-attr]
                model.backward(dlogits)
        if allreduce is not None:
            allreduce(model)
            early.append(allreduce.last_early_launches)
            if after_allreduce is not None:
                after_allreduce()
        opt.step()
        model.zero_gradients()
    return early


def parameters(model: Llama) -> dict[str, np.ndarray]:
    return {name: p.copy() for name, p in model.named_parameters()}


def main(out_dir: Path) -> None:
    world = init_world()
    comm = world.comm
    per_rank = GLOBAL_BATCH // world.size
    mine = slice(world.rank * per_rank, (world.rank + 1) * per_rank)
    arrays: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {"size": world.size, "local_size": world.local_size}

    def gather(prefix: str, params: dict[str, np.ndarray]) -> None:
        everyone = comm.gather(params, root=0)
        if is_main(world):
            for rank, theirs in enumerate(everyone):
                for name, p in theirs.items():
                    arrays[f"{prefix}/rank{rank}/{name}"] = p

    model = make_model(per_rank, SEED + world.rank)
    gather("before_broadcast", parameters(model))
    broadcast_parameters(model, world)
    gather("after_broadcast", parameters(model))

    batches = [b[mine] for b in global_batches()]
    for name, (micro, overlap, no_sync, bucket_bytes) in VARIANTS.items():
        model = make_model(per_rank, SEED + world.rank)
        broadcast_parameters(model, world)
        allreduce = GradientAllReduce(model, world, bucket_bytes, overlap=overlap)
        early = train(model, batches, micro, allreduce, no_sync)
        gather(name, parameters(model))
        info[name] = {
            "buckets": allreduce.bucket_count,
            "early_launches": early,
            "bucket_bytes": allreduce.get_memory_stats().device_gradient_bytes,
            "gradient_bytes": sum(g.nbytes for g in model.get_gradients()),
        }
        allreduce.detach()

    model = make_model(per_rank, SEED)
    first = GradientAllReduce(model, world)
    try:
        GradientAllReduce(model, world)
        info["second"] = ""
    except RuntimeError as exc:
        info["second"] = str(exc)
    first.detach()
    GradientAllReduce(model, world)  # once detached, another may take its place

    errors: dict[str, str] = {}
    different = make_model(per_rank, SEED, dim=32 if world.rank == 0 else 16)
    for what, call in (
        ("broadcast", lambda: broadcast_parameters(different, world)),
        ("allreduce", lambda: GradientAllReduce(different, world)),
    ):
        try:
            call()
            errors[what] = ""
        except ValueError as exc:
            errors[what] = str(exc)
    info["mismatch"] = comm.gather(errors, root=0)

    if is_main(world):
        out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(out_dir / "result.npz", **arrays)
        (out_dir / "result.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
