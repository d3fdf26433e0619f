"""Training: the loop, resumable checkpoints and the loss plot.

:func:`train` runs the steps of a run, top to bottom as nanoGPT does (micro-batches, gradient
all-reduce, clipping, update, schedule, eval, checkpoint, log). :func:`save_checkpoint` writes
everything a run needs to go on bit for bit into one folder, atomically;
:func:`load_checkpoint` puts it back. :func:`plot_loss` draws a run's JSON-lines log.

A checkpoint folder holds::

    model.safetensors      the parameters (mila_py.serialization.save: class, config, version)
    optimizer.safetensors  the AdamW moments: exp_avg.<name>, exp_avg_sq.<name>, and the FP32
                           master weights of a 16-bit model: master.<name>
    state.json             step counts, hyper-parameters, schedule, loss scaler, data
                           position, RNG states, mila_py version and the caller's ``extra``

Precision: a BF16 or FP16 model trains with FP32 gradient buffers, FP32 master weights and
FP32 moments in :class:`~mila_py.optim.AdamW`; :func:`train` adds dynamic loss scaling
(:class:`~mila_py.optim.GradScaler`) for FP16 models by default (BF16 has FP32's range and
needs none; FP32 and BF16 train without a scaler unless one is given).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from tqdm import tqdm

from mila_py.build_context import BuildContext, RuntimeMode, TrainingMode
from mila_py.data import TokenDataset
from mila_py.distributed import World, is_main
from mila_py.files import _sync_folder, atomic_write, atomic_write_text
from mila_py.optim import AdamW, GradScaler, _Schedule, clip_grad_norm
from mila_py.precision import Precision
from mila_py.serialization import load, mila_py_version, read_safetensors, save

__all__ = [
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "evaluate",
    "load_checkpoint",
    "plot_loss",
    "read_log",
    "save_checkpoint",
    "train",
]

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
_FORMAT = "mila_py.checkpoint"
_VERSION = 1
_MOMENTS = ("exp_avg", "exp_avg_sq")
#: the optimizer's arrays saved in optimizer.safetensors (masters: 16-bit models only)
_ARRAYS = (*_MOMENTS, "master")


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: AdamW,
    schedule: _Schedule | None = None,
    data: Any = None,
    extra: Any = None,
    *,
    rngs: Mapping[str, np.random.Generator] | None = None,
    scaler: GradScaler | None = None,
) -> Path:
    """Write a resumable checkpoint folder at ``path``, atomically.

    The files are written into a new hidden folder beside ``path`` and flushed to disk; then
    an existing checkpoint at ``path`` is renamed aside, the new folder renamed to ``path`` and
    the old one removed. A reader sees the old folder or the new one, whole; a save killed
    between the two renames leaves the previous checkpoint whole as ``.<name>.<random>.old``
    (:func:`load_checkpoint` names it).

    Args:
        path: the checkpoint folder. Where it exists it must be a checkpoint folder (or
            empty): anything else is refused, not replaced.
        model: the built model; optimizer: its AdamW.
        schedule: a learning-rate schedule of ``mila_py.optim``, or None.
        data: the training data (a :class:`~mila_py.data.TokenDataset`, or anything whose
            ``state_dict()`` is JSON-able), or None.
        extra: any JSON-able value of the caller's (returned by :func:`load_checkpoint`).
        rngs: NumPy generators the loop draws from, by name (their bit generators' states
            are saved).
        scaler: the loss scaler of an FP16 run, or None.

    Returns:
        ``path`` as a Path.

    Raises:
        ValueError: ``extra``, the data state or an RNG state has no JSON form (nothing is
            written).
        FileExistsError: ``path`` exists and is not a checkpoint folder.
        OSError: a file cannot be written; ``path`` is then as it was.
    """
    target = Path(path)
    optimizer_state = optimizer.state_dict()
    moments = {
        f"{key}.{name}": np.ascontiguousarray(array)
        for key in _ARRAYS
        for name, array in optimizer_state.pop(key, {}).items()
    }
    state = {
        "format": _FORMAT,
        "version": _VERSION,
        "mila_py_version": mila_py_version(),
        "model": type(model).__name__,
        "optimizer": optimizer_state,
        "schedule": None if schedule is None else schedule.state_dict(),
        "scaler": None if scaler is None else scaler.state_dict(),
        "data": None if data is None else data.state_dict(),
        "rng": {name: gen.bit_generator.state for name, gen in (rngs or {}).items()},
        "extra": extra,
    }
    try:  # before anything is written: a state with no JSON form writes nothing
        text = json.dumps(state, indent=1, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"save_checkpoint: the state has no JSON form ({exc}); extra and the data state "
            "must be JSON values (dicts, lists, strings, finite numbers, bools, None)"
        ) from None

    def write(folder: Path) -> None:
        save(model, folder / MODEL_FILE)
        _save_tensors(folder / OPTIMIZER_FILE, moments)
        atomic_write_text(folder / STATE_FILE, text, who="save_checkpoint")

    _write_folder(target, write)
    return target


def _save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    atomic_write(
        path,
        lambda tmp: save_file(tensors, os.fspath(tmp), metadata={"format": "mila_py.optimizer"}),
        who="save_checkpoint",
    )


def _is_checkpoint(folder: Path) -> bool:
    """``folder`` holds a checkpoint (its state.json says so) or nothing."""
    if not any(folder.iterdir()):
        return True
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("format") == _FORMAT


def _write_folder(target: Path, write: Callable[[Path], None]) -> None:
    """Write a folder through ``write(new empty folder)``, then swap it in at ``target``."""
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"save_checkpoint: {target} exists and is not a folder")
    if target.is_dir() and not _is_checkpoint(target):
        raise FileExistsError(
            f"save_checkpoint: {target} is a folder that holds no checkpoint ({STATE_FILE} "
            "missing or not ours); refusing to replace it"
        )
    parent = target.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    temporary = _new_sibling(target, "tmp", create=True)
    try:
        write(temporary)
        _sync_folder(temporary, "save_checkpoint")
        if target.exists():
            old = _new_sibling(target, "old", create=False)
            os.rename(target, old)
            try:
                os.rename(temporary, target)
            except BaseException:
                os.rename(old, target)
                raise
            _sync_folder(parent, "save_checkpoint")
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temporary, target)
            _sync_folder(parent, "save_checkpoint")
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _new_sibling(target: Path, kind: str, *, create: bool) -> Path:
    """A free hidden name ``.<name>.<random>.<kind>`` beside ``target`` (made a folder with
    the usual permissions when ``create``)."""
    while True:
        sibling = target.with_name(f".{target.name}.{secrets.token_hex(6)}.{kind}")
        if not create:
            if not sibling.exists():
                return sibling
            continue
        try:
            sibling.mkdir(0o777)
        except FileExistsError:
            continue
        return sibling


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: AdamW,
    schedule: _Schedule | None = None,
    data: Any = None,
    *,
    rngs: Mapping[str, np.random.Generator] | None = None,
    check_config: bool = True,
    scaler: GradScaler | None = None,
) -> Any:
    """Restore a :func:`save_checkpoint` folder into ``model``, ``optimizer``, ``schedule``,
    ``data`` and ``rngs`` (those given; the saved hyper-parameters and schedule replace the
    objects' own, so the run continues as saved).

    Everything is read and checked before anything changes: a model of another config, an
    optimizer over other parameters, a schedule of another type, data of another token file
    or seed, a missing RNG state, all raise and leave every object as it was (a ``data``
    other than a TokenDataset is restored last, by its own ``load_state_dict``).

    Args:
        path: the checkpoint folder.
        model, optimizer, schedule, data, rngs, scaler: as given to :func:`save_checkpoint`.
        check_config: as in :func:`mila_py.serialization.load`.

    Returns:
        The ``extra`` value saved with the checkpoint.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (naming a whole one an interrupted save
            left beside it, if any).
        ValueError: the folder is not a checkpoint of this format, or the state does not fit
            (every problem of one object in one message).
    """
    folder = Path(path)
    state = _read_state(folder)
    who = f"load_checkpoint {folder}"
    saved = dict(state["optimizer"])
    tensors = read_safetensors(folder / OPTIMIZER_FILE, who)
    for key in _ARRAYS:
        arrays = {
            name[len(key) + 1 :]: array
            for name, array in tensors.items()
            if name.startswith(key + ".")
        }
        if key in _MOMENTS or arrays:
            saved[key] = arrays
    try:
        parsed_optimizer = optimizer._parse_state(saved)
    except ValueError as exc:
        raise ValueError(f"{who}: {exc}") from None
    parsed_schedule = None
    if schedule is not None:
        if state["schedule"] is None:
            raise ValueError(f"{who}: the checkpoint has no schedule, one was given")
        parsed_schedule = schedule._parse_state(state["schedule"])
    parsed_scaler = None
    if scaler is not None:
        if not state.get("scaler"):
            raise ValueError(f"{who}: the checkpoint has no loss scaler state, a scaler was given")
        parsed_scaler = scaler._parse_state(state["scaler"])
    parsed_data = None
    if data is not None:
        if state["data"] is None:
            raise ValueError(f"{who}: the checkpoint has no data state, data was given")
        if isinstance(data, TokenDataset):
            parsed_data = data._parse_state(state["data"])
    saved_rngs = state["rng"]
    for name, gen in (rngs or {}).items():
        if name not in saved_rngs:
            raise ValueError(
                f"{who}: no state for the generator {name!r} (saved: {sorted(saved_rngs)})"
            )
        kind = saved_rngs[name].get("bit_generator")
        if kind != type(gen.bit_generator).__name__:
            raise ValueError(
                f"{who}: generator {name!r} was a {kind}, this one is a "
                f"{type(gen.bit_generator).__name__}"
            )
    # the model checks its config and tensors itself, and loads all or nothing
    load(model, folder / MODEL_FILE, check_config=check_config)
    optimizer._apply_state(parsed_optimizer)
    if schedule is not None:
        assert parsed_schedule is not None
        schedule._apply_state(parsed_schedule)
    if parsed_scaler is not None:
        assert scaler is not None
        scaler._apply_state(parsed_scaler)
    for name, gen in (rngs or {}).items():
        gen.bit_generator.state = saved_rngs[name]
    if data is not None:
        if parsed_data is not None:
            data._consumed = parsed_data
        else:
            data.load_state_dict(state["data"])
    return state["extra"]


def _read_state(folder: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint folder, its format checked."""
    file = folder / STATE_FILE
    if not file.is_file():
        leftovers = sorted(folder.absolute().parent.glob(f".{folder.name}.*.old"))
        hint = (
            f"; an interrupted save left the previous checkpoint whole at {leftovers[-1]} "
            "(rename it to load it)"
            if leftovers and not folder.exists()
            else ""
        )
        raise FileNotFoundError(
            f"load_checkpoint: no checkpoint at {folder} (no {STATE_FILE}){hint}"
        )
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"load_checkpoint: {file} is not JSON ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ValueError(f"load_checkpoint: {file} is not a mila_py checkpoint")
    if state.get("version") != _VERSION:
        raise ValueError(
            f"load_checkpoint: {file} has format version {state.get('version')!r}; this "
            f"mila_py reads version {_VERSION}"
        )
    keys = ("optimizer", "schedule", "data", "rng", "extra")
    missing = [key for key in keys if key not in state]
    if missing or not isinstance(state["optimizer"], dict) or not isinstance(state["rng"], dict):
        raise ValueError(f"load_checkpoint: {file} lacks or mangles entries {missing or keys}")
    return state


# -------------------------------------------------------------------------------- the loop


def _loss_for(model: Any, batch: int, seq: int, mode: RuntimeMode) -> Any:
    """A SoftmaxCrossEntropy for ``model``'s logits ``[batch, seq, vocab]`` on its device, in
    the model's precision: it reads 16-bit logits as they are (no FP32 copy), computes the
    softmax and the loss in FP32 and hands back ``dlogits`` in the logits' dtype."""
    from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig

    vocab = model.config.vocab_size
    precision = model.precision
    loss_fn = SoftmaxCrossEntropy(
        "loss", SoftmaxCrossEntropyConfig(vocab), device=model.device_id, precision=precision
    )
    loss_fn.build(BuildContext((batch, seq, vocab), mode))
    return loss_fn


def _check_fits(model: Any, dataset: Any, what: str) -> None:
    """``dataset``'s batches fit ``model``'s build and vocabulary."""
    build_b, build_t = model.build_context.input_shape[:2]
    if dataset.batch_size > build_b or dataset.seq_len > build_t:
        raise ValueError(
            f"train: the {what} batches are [{dataset.batch_size}, {dataset.seq_len}], larger "
            f"than {model._describe()}'s build [{build_b}, {build_t}]"
        )
    vocab = getattr(dataset, "vocab_size", None)
    if vocab is not None and vocab > model.config.vocab_size:
        raise ValueError(
            f"train: the {what} data has a vocabulary of {vocab} ids, {model._describe()} "
            f"{model.config.vocab_size}"
        )


def evaluate(model: Any, dataset: Any, batches: int = 8, *, loss_fn: Any = None) -> float:
    """The mean loss of ``model`` over ``batches`` batches of ``dataset``, in EVAL mode.

    The batches are the next ones from the dataset's position, which is left as it was: each
    call sees the same batches. The model's training mode is restored.

    Args:
        model: a built Llama (any build); dataset: a TokenDataset (or anything with
            ``next_batch``, ``state_dict`` and ``load_state_dict``).
        batches: how many batches (>= 1).
        loss_fn: a built SoftmaxCrossEntropy (default: one built for the dataset's batches).

    Raises:
        ValueError: ``batches < 1``, or batches that do not fit the model's build.
    """
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
        raise ValueError(f"evaluate: batches must be an int >= 1, got {batches!r}")
    _check_fits(model, dataset, "eval")
    if loss_fn is None:
        loss_fn = _loss_for(model, dataset.batch_size, dataset.seq_len, RuntimeMode.INFERENCE)
    position = dataset.state_dict()
    mode = model.training_mode
    training = model.build_context.is_training
    if training:
        model.set_training_mode(TrainingMode.EVAL)
    try:
        losses = []
        for _ in range(batches):
            x, y = dataset.next_batch()
            losses.append(loss_fn.forward(model.forward(x), y))
    finally:
        dataset.load_state_dict(position)
        if training:
            model.set_training_mode(mode)
    return float(np.mean(losses))


def train(
    model: Any,
    optimizer: AdamW,
    dataset: Any,
    *,
    steps: int,
    grad_accum: int = 1,
    clip: float | None = None,
    schedule: _Schedule | None = None,
    eval_dataset: Any = None,
    eval_every: int = 0,
    eval_batches: int = 8,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    log_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    loss_fn: Any = None,
    allreduce: Callable[[Any], None] | None = None,
    rngs: Mapping[str, np.random.Generator] | None = None,
    scaler: GradScaler | Literal["auto"] | None = "auto",
) -> list[dict[str, Any]]:
    """Train ``model`` until ``steps`` optimizer steps are done (a resumed run does those left).

    Each step: ``grad_accum`` micro-batches of forward and backward (the model's backward adds
    into its gradient buffers, so the micro-batches' gradients add up there, each scaled by
    ``1 / grad_accum``: the step sees the gradient of the mean loss), then ``allreduce(model)``
    (data parallelism: average the gradients across ranks), clipping to ``clip``, the
    optimizer step (skipped, and counted in ``optimizer.skipped_steps``, where the gradients'
    norm is not finite), the schedule step, the eval every ``eval_every`` steps, the
    checkpoint every ``checkpoint_every`` steps and at the end, and one log line.

    The steps done so far are ``optimizer.step_count + optimizer.skipped_steps``, which a
    checkpoint saves: after :func:`load_checkpoint` the same call goes on where it stopped.

    Data parallelism: every rank calls ``train`` alike, with its share of each global batch
    and a :class:`~mila_py.distributed.GradientAllReduce` as ``allreduce``. The ranks are
    ``allreduce.world`` (where the object has one): only its rank 0 evaluates, shows
    progress, writes the log and saves checkpoints, and the other ranks wait at each
    checkpoint until it is whole (a save that fails on rank 0 raises on every rank). The
    logged loss and token counts are those of the global batch.
    Where the object has ``no_sync()``, the backward of every micro-batch but the last runs
    inside it (their gradients are not final, so nothing is sent for them).

    Args:
        model: a built TRAINING Llama (anything with ``forward``, ``backward``, ``config.
            vocab_size``); optimizer: its AdamW.
        dataset: a :class:`~mila_py.data.TokenDataset` (``next_batch``, ``state_dict``).
        steps: the run's total steps (>= 0).
        grad_accum: micro-batches per step (>= 1).
        clip: the gradients' largest global L2 norm, or None (no clipping, no norm).
        schedule: a schedule driving ``optimizer.lr``; its step count must equal the steps
            done.
        eval_dataset, eval_every, eval_batches: the held-out loss of ``eval_batches`` batches
            (the same ones each time) every ``eval_every`` steps (0: never).
        checkpoint_dir, checkpoint_every: :func:`save_checkpoint` there every
            ``checkpoint_every`` steps (0: only at the end) and after the last step.
        log_path: a JSON-lines file, appended one line per step (``step``, ``loss``, ``lr``,
            ``tokens``, ``tokens_per_s``, ``epoch``; ``grad_norm`` with ``clip``;
            ``eval_loss`` on eval steps; ``skipped`` on skipped steps; a non-finite loss is
            ``null``), flushed after each line.
        progress: show a tqdm progress bar (loss, lr, tokens/s).
        loss_fn: a TRAINING SoftmaxCrossEntropy for the batches (default: one is built).
        allreduce: called with the model after the last micro-batch's backward, before
            clipping (e.g. a :class:`~mila_py.distributed.GradientAllReduce`); its ``world``
            and ``no_sync()``, where it has them, are used as said above.
        rngs: generators saved with each checkpoint (see :func:`save_checkpoint`; rank 0's,
            in data parallelism).
        scaler: dynamic loss scaling (:class:`~mila_py.optim.GradScaler`): the loss gradient
            is scaled before backward, the gradients unscaled before clipping, and a step
            whose gradients overflowed is skipped (``skipped`` in the log). ``"auto"``: a
            new ``GradScaler()`` for an FP16 model, none for FP32 and BF16. None: no
            scaling. A resumed FP16 run continues bit for bit with a scaler of its own,
            passed here and to :func:`load_checkpoint` (checkpoints save its state).

    Returns:
        The log records of the steps this call ran.

    Raises:
        ValueError: a bad argument, batches that do not fit the model's build, or a schedule
            whose step count differs from the steps done.
        TypeError: ``allreduce.world`` is not a World.
        RuntimeError: the model is not a TRAINING build, or rank 0 failed to save a
            checkpoint (on the other ranks).
    """
    _check_train_arguments(steps, grad_accum, clip, eval_every, eval_batches, checkpoint_every)
    if isinstance(scaler, str) and scaler == "auto":
        scaler = GradScaler() if getattr(model, "precision", None) is Precision.FP16 else None
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise TypeError(f"train: scaler must be a GradScaler, 'auto' or None, got {scaler!r}")
    world = getattr(allreduce, "world", None)
    if world is not None and not isinstance(world, World):
        raise TypeError(
            f"train: allreduce.world must be a mila_py.distributed.World, got {world!r}"
        )
    main = is_main(world)
    ranks = 1 if world is None else world.size
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = getattr(
        allreduce, "no_sync", None
    )
    if not model.is_built or not model.build_context.is_training:
        raise RuntimeError(f"train: {model._describe()} must be a built TRAINING model")
    _check_fits(model, dataset, "training")
    if eval_dataset is not None:
        _check_fits(model, eval_dataset, "eval")
    done = optimizer.step_count + optimizer.skipped_steps
    if schedule is not None and schedule.step_count != done:
        raise ValueError(
            f"train: the schedule is at step {schedule.step_count}, the optimizer at {done} "
            "(load both from one checkpoint)"
        )
    if loss_fn is None:
        loss_fn = _loss_for(model, dataset.batch_size, dataset.seq_len, RuntimeMode.TRAINING)
    eval_loss_fn = None
    if eval_dataset is not None and eval_every and main:
        eval_loss_fn = _loss_for(
            model, eval_dataset.batch_size, eval_dataset.seq_len, RuntimeMode.INFERENCE
        )
    tokens_per_step = dataset.batch_size * dataset.seq_len * grad_accum * ranks
    records: list[dict[str, Any]] = []
    model.set_training_mode(TrainingMode.NORMAL)
    model.zero_gradients()
    with contextlib.ExitStack() as stack:
        log: IO[str] | None = None
        if log_path is not None and main:
            log = stack.enter_context(open(log_path, "a", encoding="utf-8"))
        bar = stack.enter_context(
            tqdm(
                total=steps, initial=min(done, steps), desc="train", unit="step",
                disable=not (progress and main), mininterval=1.0, dynamic_ncols=True,
            )
        )  # fmt: skip
        start = time.perf_counter()
        while done < steps:
            lr = float(optimizer.lr)
            # 1. micro-batches: backward adds each one's gradient (scaled) into the buffers
            loss = 0.0
            for micro in range(grad_accum):
                x, y = dataset.next_batch()
                loss += loss_fn.forward(model.forward(x), y) / grad_accum
                dloss = 1.0 / grad_accum
                dlogits = loss_fn.backward(dloss if scaler is None else scaler.scale(dloss))
                # the earlier micro-batches' gradients are not final: send nothing for them
                last = micro == grad_accum - 1
                with contextlib.nullcontext() if last or no_sync is None else no_sync():
                    model.backward(dlogits)
            # 2. data parallelism: every rank's gradients averaged before they are used
            if allreduce is not None:
                allreduce(model)
            if world is not None and world.is_distributed:
                loss = world.comm.allreduce(loss) / world.size  # the global batch's mean
            # 3. clipping (of the unscaled gradients); a non-finite norm leaves them as they are
            if scaler is not None:
                scaler.unscale_(optimizer)
            norm = clip_grad_norm(model, clip) if clip is not None else None
            # 4. the update, unless the gradients hold inf or NaN (it would poison the weights)
            if scaler is not None:
                applied = scaler.step(optimizer)  # skipped and counted on inf or NaN
                scaler.update()
            elif norm is not None and not math.isfinite(norm):
                optimizer.skipped_steps += 1
                applied = False
            else:
                applied = optimizer.step()
            model.zero_gradients()
            if schedule is not None:
                schedule.step()
            done += 1
            seen = len(records) + 1
            rate = seen * tokens_per_step / max(time.perf_counter() - start, 1e-9)
            record: dict[str, Any] = {
                "step": done,
                "loss": loss if math.isfinite(loss) else None,
                "lr": lr,
                "tokens": done * tokens_per_step,
                "tokens_per_s": round(rate, 1),
                "epoch": getattr(dataset, "epoch", None),
            }
            if norm is not None:
                record["grad_norm"] = norm if math.isfinite(norm) else None
            if not applied:
                record["skipped"] = True
            # 5. eval on the held-out batches
            if eval_loss_fn is not None and done % eval_every == 0:
                value = evaluate(model, eval_dataset, eval_batches, loss_fn=eval_loss_fn)
                record["eval_loss"] = value if math.isfinite(value) else None
            # 6. checkpoint
            if checkpoint_dir is not None and (
                done == steps or (checkpoint_every and done % checkpoint_every == 0)
            ):
                _save_on_main(
                    world,
                    lambda: save_checkpoint(
                        checkpoint_dir,
                        model,
                        optimizer,
                        schedule,
                        dataset,
                        rngs=rngs,
                        scaler=scaler,
                    ),
                )
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            records.append(record)
            bar.update(1)
            postfix = {"loss": f"{loss:.3f}", "lr": f"{lr:.2e}", "tok/s": f"{rate:,.0f}"}
            if "eval_loss" in record:
                postfix["eval"] = f"{record['eval_loss']:.3f}"
            bar.set_postfix(postfix, refresh=False)
    return records


def _save_on_main(world: World | None, save: Callable[[], Any]) -> None:
    """``save()`` on rank 0 only; the other ranks wait until it is done.

    Rank 0 broadcasts the outcome after the save, so the broadcast is the barrier: no rank
    goes on (and may read the checkpoint) before it is whole, and a save that fails raises on
    every rank instead of leaving the others waiting for a rank that is gone.

    Raises:
        RuntimeError: (ranks other than 0) rank 0 failed to save; rank 0 raises its own error.
    """
    if world is None or not world.is_distributed:
        save()
        return
    if world.rank == 0:
        try:
            save()
        except BaseException as exc:
            world.comm.bcast(f"{type(exc).__name__}: {exc}", root=0)
            raise
        world.comm.bcast(None, root=0)
        return
    failure = world.comm.bcast(None, root=0)
    if failure is not None:
        raise RuntimeError(f"train: rank 0 failed to save the checkpoint ({failure})")


def _check_train_arguments(
    steps: Any, grad_accum: Any, clip: Any, eval_every: Any, eval_batches: Any, every: Any
) -> None:
    for name, value, least in (
        ("steps", steps, 0),
        ("grad_accum", grad_accum, 1),
        ("eval_every", eval_every, 0),
        ("eval_batches", eval_batches, 1),
        ("checkpoint_every", every, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"train: {name} must be an int >= {least}, got {value!r}")
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0
    ):
        raise ValueError(f"train: clip must be a number > 0 or None, got {clip!r}")


# --------------------------------------------------------------------------------- the plot


def read_log(log_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a :func:`train` log, one per step: where a step was logged twice (a run
    resumed from a checkpoint older than its last steps), the later line wins.

    Raises:
        FileNotFoundError: no file; ValueError: a line that is not a JSON object with an int
            ``step`` (naming the line).
    """
    by_step: dict[int, dict[str, Any]] = {}
    with open(log_path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"read_log: {log_path}:{number} is not JSON ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(f"read_log: {log_path}:{number} has no int 'step'")
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def plot_loss(log_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> Path:
    """Draw a :func:`train` log's training loss, eval loss and learning rate into a PNG,
    written atomically.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'mila-py[plot]'``).
        ValueError: the log holds no step.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(
            "plot_loss needs matplotlib: pip install 'mila-py[plot]' (or matplotlib)"
        ) from exc
    records = read_log(log_path)
    if not records:
        raise ValueError(f"plot_loss: {log_path} holds no logged step")

    def series(key: str) -> tuple[list[int], list[float]]:
        kept = [r for r in records if r.get(key) is not None]
        return [r["step"] for r in kept], [float(r[key]) for r in kept]

    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)  # a canvas of its own: no pyplot, no global backend
    axes = figure.add_subplot()
    axes.plot(*series("loss"), lw=1, label="train loss")
    eval_steps, eval_losses = series("eval_loss")
    if eval_steps:
        axes.plot(eval_steps, eval_losses, "o-", ms=3, label="eval loss")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    rates = axes.twinx()
    rates.plot(*series("lr"), color="gray", lw=1, ls="--", label="lr")
    rates.set_ylabel("learning rate")
    handles = axes.get_legend_handles_labels()
    more = rates.get_legend_handles_labels()
    axes.legend(handles[0] + more[0], handles[1] + more[1], loc="upper right")
    target = Path(png_path)
    atomic_write(target, lambda tmp: figure.savefig(tmp, format="png", dpi=100), who="plot_loss")
    return target
