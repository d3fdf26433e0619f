"""Data parallelism (mila_py.distributed): 2 MPI ranks train as 1 process on the global batch.

The two-rank cases launch ``mpirun -n 2 python tests/dist_worker.py`` once (skipped where
mpi4py or an MPI launcher is missing); the single-process world runs here, without MPI. On a
GPU, the NCCL path runs here too, over a communicator of one rank (``backend="nccl"``), and
must train exactly as the GPU alone (skipped without CuPy, a GPU or NCCL).
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import HAS_CUDA, NO_CUDA_REASON
from dist_worker import GLOBAL_BATCH, SEED, VARIANTS, T, global_batches, make_model, train

from mila_py import BuildContext, RuntimeMode
from mila_py.distributed import (
    GradientAllReduce,
    World,
    broadcast_parameters,
    init_world,
    is_main,
)
from mila_py.models import Llama

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")
HAS_MPI4PY = importlib.util.find_spec("mpi4py") is not None
#: per tensor, ||p - p_ref|| / ||p_ref||: FP32 sums in another order, through 5 AdamW steps
RTOL = 1e-5

needs_mpi = pytest.mark.skipif(
    not (HAS_MPI4PY and MPIRUN),
    reason="needs mpi4py and an MPI launcher (mpirun): pip install mpi4py mpich",
)


def mpi_env() -> dict[str, str]:
    """The environment of a process that ``mpirun`` starts: this checkout first on the path, one
    thread per rank (the ranks share the cores), no rank variables of an enclosing launch, and
    Open MPI's consent to run as root (it refuses otherwise, as in containers; MPICH ignores it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """What rank 0 of ``mpirun -n 2 tests/dist_worker.py`` wrote: (info, arrays)."""
    out = tmp_path_factory.mktemp("dist")
    env = mpi_env()
    command = [str(MPIRUN), "-n", "2", sys.executable, str(WORKER), str(out)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    info = json.loads((out / "result.json").read_text())
    return info, np.load(out / "result.npz")


def _reference() -> dict[str, np.ndarray]:
    """One process, the whole global batch, no all-reduce, from rank 0's seed."""
    model = make_model(GLOBAL_BATCH, SEED)
    train(model, global_batches())
    return {name: p.copy() for name, p in model.named_parameters()}


def _worst(params: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    return max(
        float(np.linalg.norm(params[n] - r) / np.linalg.norm(r)) for n, r in reference.items()
    )


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    return _reference()


def _rank(arrays: Any, prefix: str, rank: int, names: Any) -> dict[str, np.ndarray]:
    return {n: arrays[f"{prefix}/rank{rank}/{n}"] for n in names}


@needs_mpi
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_ranks_train_as_one_process_on_the_global_batch(
    two_ranks: tuple[dict[str, Any], Any], reference: dict[str, np.ndarray], variant: str
) -> None:
    info, arrays = two_ranks
    assert info["size"] == 2
    ranks = [_rank(arrays, variant, r, reference) for r in (0, 1)]
    for name in reference:  # one sum on both ranks: the replicas stay bit-identical
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)
    assert _worst(ranks[0], reference) < RTOL


def test_the_reference_tells_a_rank_alone_from_the_global_batch(
    reference: dict[str, np.ndarray],
) -> None:
    """Training on one rank's half of each batch misses the tolerance by far: the comparison
    above can fail."""
    alone = make_model(GLOBAL_BATCH // 2, SEED)
    train(alone, [b[: GLOBAL_BATCH // 2] for b in global_batches()])
    params = {name: p for name, p in alone.named_parameters()}
    assert _worst(params, reference) > 100 * RTOL


@needs_mpi
def test_broadcast_makes_ranks_equal_from_different_seeds(
    two_ranks: tuple[dict[str, Any], Any], reference: dict[str, np.ndarray]
) -> None:
    _, arrays = two_ranks
    before = [_rank(arrays, "before_broadcast", r, reference) for r in (0, 1)]
    after = [_rank(arrays, "after_broadcast", r, reference) for r in (0, 1)]
    assert all(
        not np.array_equal(before[0][n], before[1][n])
        for n in reference
        if n.endswith("proj.weight")
    )
    for name in reference:
        np.testing.assert_array_equal(after[0][name], before[0][name], err_msg=name)
        np.testing.assert_array_equal(after[1][name], before[0][name], err_msg=name)


@needs_mpi
def test_block_hooks_launch_buckets_during_backward(two_ranks: tuple[dict[str, Any], Any]) -> None:
    info, _ = two_ranks
    overlap, blocking = info["overlap"], info["blocking"]
    assert overlap["buckets"] == blocking["buckets"] > 2
    # all but the embedding's bucket (final only after the embedding's backward), every step
    assert overlap["early_launches"] == [overlap["buckets"] - 1] * 5
    assert blocking["early_launches"] == [0] * 5
    assert info["one_bucket"]["buckets"] == 1
    for variant in VARIANTS:  # FP32 gradients: the buckets hold exactly their bytes
        assert info[variant]["bucket_bytes"] == info[variant]["gradient_bytes"] > 0


@needs_mpi
def test_a_second_overlapping_allreduce_is_refused(two_ranks: tuple[dict[str, Any], Any]) -> None:
    info, _ = two_ranks
    assert "already has a GradientAllReduce" in info["second"]


@needs_mpi
def test_ranks_with_different_models_all_raise(two_ranks: tuple[dict[str, Any], Any]) -> None:
    info, _ = two_ranks
    for rank_errors in info["mismatch"]:
        for what in ("broadcast", "allreduce"):
            assert "the ranks' models differ" in rank_errors[what]
            assert "(64, 32)" in rank_errors[what] and "(64, 16)" in rank_errors[what]


# ---------------------------------------------------------------------- one process, no MPI
def _trained_once() -> Llama:
    model = make_model(2, SEED)
    batch = global_batches()[0][:2]
    from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig

    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(64), device="CPU")
    loss_fn.build(BuildContext((2, batch.shape[1] - 1, 64), RuntimeMode.TRAINING))
    loss_fn.forward(model.forward(batch[:, :-1]), batch[:, 1:])
    model.backward(loss_fn.backward())
    return model


def test_single_process_world_runs_without_mpirun() -> None:
    world = World()
    assert (world.rank, world.size, world.local_rank, world.local_size) == (0, 1, 0, 1)
    assert not world.is_distributed and world.comm is None and is_main(world) and is_main()
    world.barrier()
    model = _trained_once()
    params = [p.copy() for p in model.get_parameters()]
    grads = [g.copy() for g in model.get_gradients()]
    broadcast_parameters(model, world)
    allreduce = GradientAllReduce(model, world)
    assert allreduce.bucket_count == 0 and allreduce.get_memory_stats().total_bytes == 0
    assert model.block_backward_hooks == []  # nothing to overlap: no hook
    allreduce(model)
    for before, after in zip(params, model.get_parameters(), strict=True):
        np.testing.assert_array_equal(before, after)
    for before, after in zip(grads, model.get_gradients(), strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.fixture
def no_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``from mpi4py import MPI`` fail, as where mpi4py is not installed."""
    real_import = builtins.__import__

    def refuse(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    for variable in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)


def test_init_world_without_mpi4py_is_one_process(no_mpi4py: None) -> None:
    world = init_world()
    assert (world.rank, world.size) == (0, 1) and world.comm is None


def test_init_world_without_mpi4py_under_a_launcher_says_what_to_install(
    no_mpi4py: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(ImportError, match=r"one of 4 ranks.*pip install mpi4py mpich"):
        init_world()


@needs_mpi
def test_init_world_outside_a_launch_is_one_process() -> None:
    """With mpi4py installed but no launcher, MPI starts as a singleton: one process."""
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "PMI_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    code = "from mila_py.distributed import init_world; w = init_world(); print(w.size, w.comm)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "None"]


def test_importing_the_module_does_not_start_mpi() -> None:
    code = "import sys, mila_py.distributed; print('mpi4py' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_block_backward_hooks_run_after_each_block_last_first() -> None:
    model = make_model(2, SEED)
    seen: list[str] = []
    model.block_backward_hooks.append(lambda block: seen.append(block.name))
    batch = global_batches()[0][:2, :-1]
    logits = model.forward(batch)
    model.backward(np.ones_like(logits))
    assert seen == [block.name for block in reversed(model.layers)]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"rank": 1, "size": 1}, ValueError, "0 <= rank < size"),
        ({"size": 2}, ValueError, "needs their communicator"),
        ({"rank": 1.0, "size": 2}, TypeError, "rank must be an int"),
        ({"local_rank": 0, "local_size": 2}, ValueError, "local_size <= size"),
    ],
)
def test_world_refuses_impossible_worlds(kwargs: dict[str, Any], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        World(**kwargs)


def test_gradient_allreduce_refuses_bad_arguments() -> None:
    model = _trained_once()
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        GradientAllReduce(model, World(), 0)
    with pytest.raises(TypeError, match="world must be a World"):
        GradientAllReduce(model, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="is_main: world must be a World"):
        is_main(0)  # type: ignore[arg-type]
    inference = Llama("llama", model.config, device="CPU")
    inference.build(BuildContext((1, 8), RuntimeMode.INFERENCE, initialize_parameters=True))
    with pytest.raises(RuntimeError, match="no parameter gradients"):
        GradientAllReduce(inference, World())
    with pytest.raises(ValueError, match="root must be a rank"):
        broadcast_parameters(model, World(), root=1)
    allreduce = GradientAllReduce(model, World())
    with pytest.raises(ValueError, match="averages the gradients of"):
        allreduce(inference)


def test_backend_is_auto_or_nccl_and_nccl_needs_a_gpu() -> None:
    model = _trained_once()
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'nccl'\), got 'mpi'"):
        GradientAllReduce(model, World(), backend="mpi")
    with pytest.raises(ValueError, match=r"backend='nccl' sums on GPUs, but .* is on CPU"):
        GradientAllReduce(model, World(), backend="nccl")
    assert model.block_backward_hooks == []  # the refused ones hooked nothing
    assert GradientAllReduce(model, World(), backend="auto").bucket_count == 0


# ------------------------------------------------------ one GPU: NCCL over a one-rank world
def _nccl_available() -> bool:
    if not HAS_CUDA:
        return False
    from cupy.cuda import nccl

    return bool(getattr(nccl, "available", False))


needs_nccl = pytest.mark.skipif(
    not _nccl_available(), reason=f"{NO_CUDA_REASON}, or CuPy finds no NCCL library"
)
GPU = "CUDA:0"
GPU_STEPS = 3


def _distinct_token_batches() -> list[np.ndarray]:
    """:data:`GPU_STEPS` ``[GLOBAL_BATCH, T + 1]`` windows whose input tokens (all but the last
    column) never repeat within a window. The CUDA embedding's backward adds each token's row
    with ``atomicAdd``, in an order that may differ between runs where a token repeats; without
    repeats every kernel of the step is deterministic, so two runs agree to the bit."""
    rng = np.random.default_rng(11)
    windows = []
    for _ in range(GPU_STEPS):
        inputs = rng.permutation(64)[: GLOBAL_BATCH * T].reshape(GLOBAL_BATCH, T)
        windows.append(np.concatenate([inputs, rng.integers(0, 64, (GLOBAL_BATCH, 1))], axis=1))
    return windows


def _host(array: Any) -> np.ndarray:
    """A host copy once every stream of the GPU (the all-reduce's own included) finished."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    return cupy.asnumpy(array)


def _gpu_parameters(model: Llama) -> dict[str, np.ndarray]:
    return {name: _host(p) for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def gpu_reference() -> dict[str, np.ndarray]:
    """The parameters of the model trained on the GPU alone, no all-reduce."""
    model = make_model(GLOBAL_BATCH, SEED, device=GPU)
    train(model, _distinct_token_batches())
    return _gpu_parameters(model)


@pytest.mark.cuda
@needs_nccl
def test_the_gpu_step_repeats_to_the_bit(gpu_reference: dict[str, np.ndarray]) -> None:
    """What the exact comparison below rests on: the same steps on the GPU, run again."""
    model = make_model(GLOBAL_BATCH, SEED, device=GPU)
    train(model, _distinct_token_batches())
    again = _gpu_parameters(model)
    for name, want in gpu_reference.items():
        np.testing.assert_array_equal(again[name], want, err_msg=name)


class _PicklingComm:
    """A one-rank stand-in for an mpi4py communicator: ``bcast`` returns the object after a
    pickle round trip, as mpi4py's object broadcast hands it to the other ranks."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def bcast(self, obj: Any, root: int = 0) -> Any:
        self.sent.append(obj)
        return pickle.loads(pickle.dumps(obj))


@pytest.mark.cuda
@needs_nccl
@pytest.mark.parametrize(
    ("overlap", "communicator"),
    [(True, False), (False, False), (True, True)],
    ids=["overlap", "blocking", "id-through-a-communicator"],
)
def test_a_one_rank_nccl_allreduce_trains_as_the_gpu_alone(
    gpu_reference: dict[str, np.ndarray], overlap: bool, communicator: bool
) -> None:
    """The GPU path (buckets packed on the all-reduce's stream, NCCL's sum over one rank,
    the scaling by 1, the gradients unpacked before the optimizer) changes no bit: every
    parameter after the steps equals the GPU-alone run's."""
    comm = _PicklingComm() if communicator else None
    world = World(comm=comm)
    model = make_model(GLOBAL_BATCH, SEED, device=GPU)
    allreduce = GradientAllReduce(model, world, 4096, overlap=overlap, backend="nccl")
    gradient_bytes = sum(g.nbytes for g in model.get_gradients())
    assert allreduce.bucket_count > 2 and sum(allreduce.bucket_nbytes) == gradient_bytes
    assert allreduce.get_memory_stats().device_gradient_bytes == gradient_bytes
    if comm is not None:  # rank 0's unique id went through the communicator, once
        assert len(comm.sent) == 1 and len(comm.sent[0]) == 128

    def every_gradient_went_through_a_bucket() -> None:
        for bucket in allreduce._buckets:
            packed = np.concatenate([_host(g).ravel() for g in bucket.grads])
            np.testing.assert_array_equal(_host(bucket.buffer), packed)

    early = train(
        model,
        _distinct_token_batches(),
        1,
        allreduce,
        after_allreduce=every_gradient_went_through_a_bucket,
    )
    # all but the embedding's bucket launch from the block hooks during backward
    assert early == ([allreduce.bucket_count - 1] if overlap else [0]) * GPU_STEPS
    got = _gpu_parameters(model)
    assert sorted(got) == sorted(gpu_reference)
    for name, want in gpu_reference.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    allreduce.detach()
    assert model.block_backward_hooks == []


# ------------------------------------------------------- examples/train_llama.py under mpirun
EXAMPLE = ROOT / "examples" / "train_llama.py"
#: a tiny model, 5 steps of 2 micro-batches of a global batch of 4 (the earlier micro-batch's
#: backward inside no_sync on 2 ranks)
EXAMPLE_ARGS = ["--seq", "32", "--dim", "16", "--layers", "1", "--heads", "2", "--kv-heads",
                "1", "--warmup", "2", "--grad-accum", "2", "--steps", "5", "--seed", "3"]  # fmt: skip


def _example(where: Path, ranks: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``examples/train_llama.py`` on one process, or on ``ranks`` under ``mpirun``."""
    env = mpi_env()
    command = [sys.executable, str(EXAMPLE), "--data", str(where / "corpus.txt"), *args]
    if ranks > 1:
        command = [str(MPIRUN), "-n", str(ranks), *command]
    return subprocess.run(command, cwd=where, env=env, capture_output=True, text=True, timeout=600)


def _ran(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _saved(folder: Path, file: str = "model.safetensors") -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / file))


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """Checkpoints (and logs) of the example: ``two`` (2 ranks, 5 steps), ``one`` (one
    process, the same arguments), ``half`` (one process on one rank's share: batch 2),
    ``resumed`` (2 ranks: 3 of the 5 steps saved, then resumed for the other 2). Returns the
    folder and each run's standard output."""
    where = tmp_path_factory.mktemp("example")
    (where / "corpus.txt").write_bytes(
        b"".join(b"def f%d(x):\n    return x * %d + 1\n" % (i, i) for i in range(800))
    )
    out = {}
    for name, ranks, batch, extra in (
        ("two", 2, "4", []),
        ("one", 1, "4", []),
        ("half", 1, "2", []),
        ("stopped", 2, "4", ["--stop-after", "3"]),
        ("resumed", 2, "4", ["--resume", str(where / "stopped")]),
    ):
        log = ["--log", str(where / f"{name}.jsonl")]
        done = _example(where, ranks, *EXAMPLE_ARGS, "--batch", batch, "--save", name, *log, *extra)
        out[name] = _ran(done).stdout
    return where, out


@needs_mpi
def test_the_example_on_two_ranks_trains_as_one_process_on_the_global_batch(
    example_runs: tuple[Path, dict[str, str]],
) -> None:
    where, out = example_runs
    two, one = _saved(where / "two"), _saved(where / "one")
    assert sorted(two) == sorted(one)
    assert _worst(two, one) < RTOL
    # the tolerance tells one rank's share alone from the global batch
    assert _worst(_saved(where / "half"), one) > 100 * RTOL
    # each rank read its own half of every global batch
    data = json.loads((where / "two" / "state.json").read_text())["data"]
    assert (data["batch_size"], data["world_size"]) == (2, 2)
    assert "2 ranks of 2 sequences each" in out["two"]


@needs_mpi
def test_the_example_logs_and_prints_once_on_two_ranks(
    example_runs: tuple[Path, dict[str, str]],
) -> None:
    """Rank 0 alone writes the log, with the global batch's loss and tokens, and prints."""
    where, out = example_runs
    two = [json.loads(line) for line in (where / "two.jsonl").read_text().splitlines()]
    one = [json.loads(line) for line in (where / "one.jsonl").read_text().splitlines()]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3, 4, 5]
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one]
    for mine, theirs in zip(two, one, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert out["two"].count("held-out loss:") == 1 and out["two"].count("parameters;") == 1


@needs_mpi
def test_the_example_resumed_on_two_ranks_equals_the_run_that_never_stopped(
    example_runs: tuple[Path, dict[str, str]],
) -> None:
    where, out = example_runs
    assert "at step 3 of 5" in out["resumed"]
    stopped = json.loads((where / "stopped" / "state.json").read_text())["optimizer"]
    assert stopped["step_count"] + stopped["skipped_steps"] == 3
    for file in ("model.safetensors", "optimizer.safetensors"):
        resumed, whole = _saved(where / "resumed", file), _saved(where / "two", file)
        assert sorted(resumed) == sorted(whole)
        for name, want in whole.items():
            np.testing.assert_array_equal(resumed[name], want, err_msg=f"{file}: {name}")


@needs_mpi
def test_the_example_refuses_a_global_batch_the_ranks_cannot_share(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(b"x = 1\n" * 2000)
    done = _example(tmp_path, 2, *EXAMPLE_ARGS, "--batch", "3")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    message = "--batch 3 is the global batch, split evenly between the 2 ranks"
    assert done.stderr.count(message) == 1, done.stderr  # said once, by rank 0
