"""Train a small Llama with mila_py on a real text corpus, in a run that survives restarts.

By default the corpus is the Python standard library's own source code (every Python install has
it); ``--data FILE`` trains on any text file instead. The text is tokenized once into memory-mapped
token files (byte-level ids, or ``--tokenizer DIR`` with a Hugging Face ``tokenizer.json``), 95%
for training and 5% held out. The run uses AdamW with a warmup and cosine schedule, optional
gradient accumulation, clipping, a progress bar with the loss, rate and tokens/s, and prints the
held-out loss before and after training and the memory table of the build.

``--save DIR`` writes a checkpoint folder (atomically) every ``--save-every`` steps and at the end;
``--resume DIR`` continues a saved run bit for bit: the weights, optimizer moments, schedule and
data position are restored and the run goes on to ``--steps`` in total. ``--log FILE`` appends one
JSON line per step; ``--plot PNG`` draws the loss curve from it (matplotlib).

Run: ``python examples/train_llama.py --steps 400 --save run``; stopped before the end, the same
command with ``--resume run`` added goes on where the last checkpoint left it (``--help``).
``--stop-after N`` ends the process after step N of the run, as a job of limited time would.
``examples/train_and_generate.py`` goes on to generate text with the trained weights.

Data parallelism: ``mpirun -n 2 python examples/train_llama.py ...`` trains on two processes
(MPI ranks; mpi4py and an MPI library: ``pip install -e ".[dist]"``), one GPU each where there
are GPUs. ``--batch`` is then the global batch, split evenly between the ranks; every rank starts
from rank 0's weights, reads its own share of each batch and averages its gradients with the
others before each step, so the run trains as one process with the whole batch would. Only rank 0
prints, logs and saves; ``--resume`` reads the checkpoint on every rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from mila_py import BuildContext, RuntimeMode
from mila_py.data import TokenDataset, prepare_data
from mila_py.devices import DeviceId, DeviceType
from mila_py.distributed import GradientAllReduce, World, broadcast_parameters, init_world, is_main
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, CosineSchedule
from mila_py.train import evaluate, load_checkpoint, plot_loss, train

#: share of the corpus held out for the evaluation
HELD_OUT = 0.05


def load_corpus(path: str | None, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of ``path``, or of the standard library's ``*.py`` files
    (a file is read no further than that)."""
    if path:
        try:
            with open(path, "rb") as file:
                return file.read(max_bytes)
        except OSError as exc:
            sys.exit(f"--data {path}: cannot read it ({exc.strerror or exc})")
    stdlib = Path(os.path.dirname(os.__file__))
    chunks, size = [], 0
    for file_path in sorted(stdlib.glob("*.py")):
        blob = file_path.read_bytes()
        chunks.append(blob)
        size += len(blob)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def split_corpus(data: bytes) -> tuple[bytes, bytes]:
    """95% for training, 5% held out, cut at a line end (else a UTF-8 character boundary) so
    that both halves stay text."""
    cut = int(len(data) * (1 - HELD_OUT))
    line_end = data.rfind(b"\n", 0, cut)
    if line_end > cut // 2:
        cut = line_end + 1
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        cut -= 1
    return data[:cut], data[cut:]


def prepare(
    data: bytes,
    tokenizer: str | None,
    folder: Path,
    seq: int,
    batch: int,
    seed: int,
    world: World | None = None,
) -> tuple[TokenDataset, TokenDataset]:
    """Tokenize the training and held-out parts into ``folder``; their datasets, ``batch``
    sequences per batch. The training data is this rank's share of ``world``'s (one
    process's without it); the held-out data is whole (only rank 0 evaluates).

    Exits with a message where the held-out part holds less than one window of ``seq + 1``
    tokens."""
    rank, ranks = (0, 1) if world is None else (world.rank, world.size)
    train_text, held_out_text = split_corpus(data)
    folder.mkdir(parents=True, exist_ok=True)
    datasets = []
    for name, text, data_seed, shard in (
        ("train", train_text, seed, (rank, ranks)),
        ("held_out", held_out_text, 1, (0, 1)),
    ):
        source = folder / f"{name}.txt"
        source.write_bytes(text)
        try:
            prepare_data(tokenizer, folder / name, [source])
        except (OSError, ValueError) as exc:
            sys.exit(f"cannot tokenize the corpus: {exc}")
        try:
            datasets.append(TokenDataset(folder / name, seq, batch, data_seed, *shard))
        except ValueError:
            sys.exit(
                f"corpus too small: {len(data):,} bytes; {HELD_OUT:.0%} of it is held out and "
                f"must hold one window of --seq + 1 = {seq + 1} tokens"
            )
    return datasets[0], datasets[1]


def check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """``parser.error`` (a usage line and exit code 2) for an option below its minimum."""
    for name in names:
        value = getattr(args, name)
        least = 0 if name in ("steps", "save_every", "stop_after") else 1
        if value < least:
            parser.error(f"--{name.replace('_', '-')} must be >= {least}, got {value}")


def build_or_exit(parser: argparse.ArgumentParser, build: Any) -> Any:
    """``build()``, with a bad device or model option as a usage error, not a traceback."""
    try:
        return build()
    except (ValueError, RuntimeError, TypeError) as exc:
        parser.error(str(exc))


def refuse(parser: argparse.ArgumentParser, world: World, message: str) -> NoReturn:
    """A usage error (exit code 2), printed by rank 0 alone: every rank finds it."""
    if is_main(world):
        parser.error(message)
    sys.exit(2)


def device_for(parser: argparse.ArgumentParser, device: str | None, world: World) -> str:
    """``--device``, or by default the CPU in one process and the rank's own device
    (``world.device()``: its GPU, else the CPU) in several. Several ranks take one GPU each,
    so there a GPU cannot be named."""
    if device is None:
        try:
            return world.device() if world.is_distributed else "CPU"
        except RuntimeError as exc:  # found by the ranks beyond the node's GPUs alone: say it
            parser.error(str(exc))
    if world.is_distributed:
        try:
            kind = DeviceId.parse(device).device_type
        except (ValueError, TypeError) as exc:
            refuse(parser, world, str(exc))
        if kind is not DeviceType.CPU:
            refuse(
                parser,
                world,
                f"--device {device}: with {world.size} ranks each rank takes the GPU of its "
                "index on its node; leave --device out (or give CPU)",
            )
    return device


def per_rank_batch(parser: argparse.ArgumentParser, batch: int, world: World) -> int:
    """``--batch`` (the global batch) split evenly between the ranks."""
    if batch % world.size:
        refuse(
            parser,
            world,
            f"--batch {batch} is the global batch, split evenly between the {world.size} "
            f"ranks: give a multiple of {world.size}",
        )
    return batch // world.size


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--data", help="a text file (default: the Python standard library source)")
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="a folder with tokenizer.json (default: byte-level ids)"
    )
    parser.add_argument(
        "--device",
        help="CPU or CUDA:N (default: CPU; with several MPI ranks, each rank's own GPU, else CPU)",
    )
    parser.add_argument("--steps", type=int, default=200, help="total training steps (%(default)s)")
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="sequences per micro-batch, all ranks together (%(default)s)",
    )
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step (%(default)s)"
    )
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (%(default)s)")
    parser.add_argument("--dim", type=int, default=128, help="model width (%(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (%(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="query heads (%(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (%(default)s)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak rate (%(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="warmup steps (%(default)s)")
    parser.add_argument(
        "--max-bytes", type=int, default=4_000_000, help="corpus bytes read (%(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="batch order seed (%(default)s)")
    parser.add_argument("--save", metavar="DIR", help="checkpoint folder, written atomically")
    parser.add_argument(
        "--save-every", type=int, default=100, help="steps between checkpoints (%(default)s)"
    )
    parser.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR")
    parser.add_argument(
        "--stop-after",
        type=int,
        metavar="N",
        help="end this process after step N of --steps (the schedule still spans --steps)",
    )
    parser.add_argument("--log", metavar="FILE", help="append one JSON line per step")
    parser.add_argument("--plot", metavar="PNG", help="draw the loss curve (needs matplotlib)")
    args = parser.parse_args()
    check_positive(parser, args, "steps", "batch", "grad_accum", "seq", "dim", "layers")
    check_positive(parser, args, "heads", "kv_heads", "max_bytes", "save_every")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.warmup <= args.steps:
        parser.error(f"--warmup must be in [0, --steps], got {args.warmup}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.stop_after is not None:
        check_positive(parser, args, "stop_after")
    if args.resume and not Path(args.resume, "state.json").is_file():
        parser.error(f"--resume {args.resume}: no checkpoint there")
    world = init_world()  # one process without mpirun: every call below is then a no-op
    main_rank = is_main(world)  # the one rank that prints
    device = device_for(parser, args.device, world)
    batch = per_rank_batch(parser, args.batch, world)

    with tempfile.TemporaryDirectory() as work:
        # every rank tokenizes into its own folder: no file system shared between nodes
        data = load_corpus(args.data, args.max_bytes)
        train_data, held_out = prepare(
            data, args.tokenizer, Path(work), args.seq, batch, args.seed, world
        )

        def build() -> Llama:
            cfg = LlamaConfig(
                vocab_size=train_data.vocab_size,
                dim=args.dim,
                n_layers=args.layers,
                n_heads=args.heads,
                n_kv_heads=args.kv_heads,
                hidden_dim=3 * args.dim,
                max_seq_len=max(256, args.seq),
            )
            model = Llama("llama", cfg, device=device)
            model.build(BuildContext((batch, args.seq), RuntimeMode.TRAINING))
            return model

        model = build_or_exit(parser, build)
        broadcast_parameters(model, world)  # every rank starts from rank 0's weights
        allreduce = GradientAllReduce(model, world) if world.is_distributed else None
        opt = AdamW(model, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        schedule = CosineSchedule(opt, args.warmup, args.steps, min_lr=args.lr / 10)
        if main_rank:
            print(
                f"{model.parameter_count():,} parameters; {train_data.meta['count']:,} training "
                f"tokens ({train_data.meta['tokenizer']}, vocabulary {train_data.vocab_size:,})"
            )
            if world.is_distributed:
                print(f"{world.size} ranks of {batch} sequences each, on {device} (rank 0)")
        if args.resume:  # on every rank: each holds the whole state
            try:
                load_checkpoint(args.resume, model, opt, schedule, train_data)
            except (OSError, ValueError) as exc:
                sys.exit(f"--resume {args.resume}: {exc}")
            if main_rank:
                print(f"resumed from {args.resume} at step {schedule.step_count} of {args.steps}")

        # the held-out windows of 4 whole global batches, on rank 0 alone
        held_out_batches = 4 * world.size
        before = evaluate(model, held_out, held_out_batches) if main_rank else math.nan
        log = args.log or (os.path.join(work, "log.jsonl") if args.plot else None)
        steps = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
        train(
            model,
            opt,
            train_data,
            steps=steps,
            grad_accum=args.grad_accum,
            clip=1.0,
            schedule=schedule,
            checkpoint_dir=args.save,
            checkpoint_every=args.save_every,
            log_path=log,
            allreduce=allreduce,
        )
        if not main_rank:
            return
        after = evaluate(model, held_out, held_out_batches)
        print(f"held-out loss: {before:.3f} before, {after:.3f} after step {steps}")
        if args.save:
            print(f"checkpoint: {args.save}")
        if args.plot:
            try:
                print(f"loss curve: {plot_loss(log, args.plot)}")
            except ImportError as exc:
                print(f"no loss curve: {exc}", file=sys.stderr)
        print(model.get_memory_stats())


if __name__ == "__main__":
    main()
