"""The training loop on one rank of several: ``no_sync`` on the earlier micro-batches, and
only rank 0 evaluating, logging, showing progress and saving, while the others wait for its
checkpoint.

Each case runs one rank, in this process, with a stand-in for the MPI communicator that
answers as the other rank would (the two-rank runs of ``examples/train_llama.py`` under
``mpirun`` are in tests/test_distributed.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_train_loop import T, model_for

from mila_py.data import TokenDataset, prepare_data
from mila_py.distributed import World
from mila_py.optim import AdamW
from mila_py.train import STATE_FILE, train

#: what the stand-in communicator's other rank adds to each allreduce of the loss
OTHER_LOSS = 3.0


class Comm:
    """Answers collectives as the other rank of two would; records what this rank sent.

    ``root_says`` is what rank 0 broadcasts to a rank 1 (None: a checkpoint saved whole);
    ``checkpoint`` is a folder whose ``state.json`` must exist when rank 0 broadcasts."""

    def __init__(self, root_says: Any = None, checkpoint: Path | None = None) -> None:
        self.root_says, self.checkpoint = root_says, checkpoint
        self.broadcasts: list[tuple[Any, bool]] = []  # (sent, checkpoint whole at that time)
        self.losses: list[float] = []

    def bcast(self, value: Any, root: int = 0) -> Any:
        whole = self.checkpoint is not None and (self.checkpoint / STATE_FILE).is_file()
        self.broadcasts.append((value, whole))
        return value if self.root_says is None else self.root_says

    def allreduce(self, value: float) -> float:
        self.losses.append(value)
        return value + OTHER_LOSS

    def Barrier(self) -> None:
        pass


class AllReduce:
    """A GradientAllReduce's seams (``world``, ``no_sync``, the call), without MPI: it
    records, at each block's backward, whether that backward ran inside ``no_sync()``."""

    def __init__(self, model: Any, world: Any) -> None:
        self.world, self.quiet, self.seen = world, False, []
        self.calls = 0
        model.block_backward_hooks.append(lambda block: self.seen.append(self.quiet))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.quiet = True
        try:
            yield
        finally:
            self.quiet = False

    def __call__(self, model: Any) -> None:
        self.calls += 1


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_bytes(np.random.default_rng(3).integers(32, 127, 2000, dtype=np.uint8).tobytes())
    return prepare_data(None, tmp_path / "data", [text])


def _run(data_dir: Path, world: World | None, tmp_path: Path, **kwargs: Any) -> Any:
    model = model_for(2)
    allreduce = AllReduce(model, world)
    rank, size = (world.rank, world.size) if isinstance(world, World) else (0, 1)
    data = TokenDataset(data_dir, T, 2, seed=1, rank=rank, world_size=size)
    records = train(model, AdamW(model, lr=1e-2), data, steps=2, allreduce=allreduce,
                    checkpoint_dir=tmp_path / "ckpt", log_path=tmp_path / "log.jsonl",
                    **kwargs)  # fmt: skip
    return allreduce, records


def test_the_earlier_micro_batches_run_backward_inside_no_sync(
    data_dir: Path, tmp_path: Path
) -> None:
    allreduce, _ = _run(data_dir, None, tmp_path, grad_accum=3, progress=False)
    assert allreduce.seen == [True, True, False] * 2  # one block: one hook call per backward
    assert allreduce.calls == 2


def test_rank_1_writes_nothing_and_waits_for_rank_0s_checkpoint(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    comm = Comm()
    eval_data = TokenDataset(data_dir, T, 2, seed=2)
    allreduce, records = _run(data_dir, World(1, 2, 1, 2, comm), tmp_path, grad_accum=2,
                              eval_dataset=eval_data, eval_every=1)  # fmt: skip
    assert allreduce.seen == [True, False] * 2 and allreduce.calls == 2
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "log.jsonl").exists()
    assert "train" not in capsys.readouterr().err  # no progress bar
    assert comm.broadcasts == [(None, False)]  # it waited once, for the checkpoint at the end
    assert all("eval_loss" not in r for r in records)
    # the logged loss is the mean of the ranks' losses, the tokens the global batch's
    assert [r["loss"] for r in records] == [(x + OTHER_LOSS) / 2 for x in comm.losses]
    per_step = 2 * T * 2 * 2  # rows, tokens per row, micro-batches, ranks
    assert [r["tokens"] for r in records] == [per_step, 2 * per_step]


def test_rank_0_saves_and_logs_and_says_so_once_the_checkpoint_is_whole(
    data_dir: Path, tmp_path: Path
) -> None:
    comm = Comm(checkpoint=tmp_path / "ckpt")
    eval_data = TokenDataset(data_dir, T, 2, seed=2)
    _, records = _run(data_dir, World(0, 2, 0, 2, comm), tmp_path, progress=False,
                      eval_dataset=eval_data, eval_every=1)  # fmt: skip
    assert (tmp_path / "ckpt" / STATE_FILE).is_file()
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 2
    assert comm.broadcasts == [(None, True)]
    assert all("eval_loss" in r for r in records)


def test_a_failed_save_on_rank_0_raises_on_every_rank(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("not a folder")  # save_checkpoint refuses to replace it
    comm = Comm()
    with pytest.raises(FileExistsError, match="is not a folder"):
        _run(data_dir, World(0, 2, 0, 2, comm), tmp_path, progress=False)
    [(sent, _)] = comm.broadcasts
    assert "FileExistsError" in sent and "is not a folder" in sent
    # rank 1 hears it from the broadcast, and raises instead of waiting for a rank that left
    with pytest.raises(RuntimeError, match=r"rank 0 failed to save the checkpoint.*not a folder"):
        _run(data_dir, World(1, 2, 1, 2, Comm(root_says=sent)), tmp_path, progress=False)


def test_an_allreduce_whose_world_is_not_a_world_is_refused(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"train: allreduce.world must be .*World, got 'rank 0'"):
        _run(data_dir, "rank 0", tmp_path, progress=False)  # type: ignore[arg-type]
