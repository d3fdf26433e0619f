"""Resumable checkpoints: a run stopped, saved and resumed in a fresh process ends bit for bit
where the run that never stopped ends; the folder is written atomically and loaded all or
nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import mila_py
from mila_py.data import prepare_data
from mila_py.train import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    load_checkpoint,
    save_checkpoint,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
STEPS, STOP = 16, 7

# run as a script in a fresh process (a checkpoint, data folder, steps and output path as its
# arguments), and imported by the test for the same setup
SCRIPT = """
import sys

import numpy as np

from mila_py import BuildContext, RuntimeMode
from mila_py.models import Llama, LlamaConfig
from mila_py.data import TokenDataset
from mila_py.init import manual_seed
from mila_py.optim import AdamW, CosineSchedule
from mila_py.train import load_checkpoint, train

TOTAL = 16


def setup(data_dir, init_seed=0):
    manual_seed(init_seed)
    cfg = LlamaConfig(
        vocab_size=256, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=24,
        max_seq_len=16,
    )
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((2, 8), RuntimeMode.TRAINING))
    opt = AdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = CosineSchedule(opt, 3, TOTAL, min_lr=1e-3)
    data = TokenDataset(data_dir, 8, 2, seed=5)
    return model, opt, schedule, data


def run(model, opt, schedule, data, steps, checkpoint_dir=None):
    train(
        model, opt, data, steps=steps, grad_accum=2, clip=0.5, schedule=schedule,
        checkpoint_dir=checkpoint_dir, progress=False,
    )


if __name__ == "__main__":
    checkpoint, data_dir, steps, out = sys.argv[1:]
    model, opt, schedule, data = setup(data_dir, init_seed=99)  # other weights: load replaces
    extra = load_checkpoint(checkpoint, model, opt, schedule, data)
    run(model, opt, schedule, data, int(steps))
    with open(out, "wb") as sink:
        for _, p in model.named_parameters():
            sink.write(p.tobytes())
        for m in opt._m + opt._v:
            sink.write(m.tobytes())
    print(extra["note"], opt.step_count, data.epoch, schedule.step_count)
"""


def load_script(tmp_path: Path) -> ModuleType:
    path = tmp_path / "resume_script.py"
    path.write_text(SCRIPT, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("resume_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus(tmp_path: Path, size: int = 400) -> Path:
    """Byte-level tokens: 44 windows of 9, so the 16 steps of 4 windows pass an epoch."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(np.random.default_rng(3).integers(32, 127, size, dtype=np.uint8).tobytes())
    return prepare_data(None, tmp_path / "data", [text])


def test_a_resumed_run_in_a_fresh_process_ends_bit_for_bit_as_the_whole_run(
    tmp_path: Path,
) -> None:
    script = load_script(tmp_path)
    data_dir = corpus(tmp_path)
    model, opt, schedule, data = script.setup(data_dir)
    script.run(model, opt, schedule, data, STEPS)
    assert data.epoch == 1  # the run passes an epoch boundary
    whole = b"".join(p.tobytes() for _, p in model.named_parameters())
    whole += b"".join(m.tobytes() for m in opt._m + opt._v)

    model, opt, schedule, data = script.setup(data_dir)
    script.run(model, opt, schedule, data, STOP)
    save_checkpoint(tmp_path / "ckpt", model, opt, schedule, data, extra={"note": "half"})
    out = tmp_path / "resumed.bin"
    done = subprocess.run(
        [sys.executable, str(tmp_path / "resume_script.py"), str(tmp_path / "ckpt"),
         str(data_dir), str(STEPS), str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["half", str(STEPS), "1", str(STEPS)]
    assert out.read_bytes() == whole


def small(tmp_path: Path) -> tuple[Any, ...]:
    """The setup of the script after 3 steps."""
    script = load_script(tmp_path)
    model, opt, schedule, data = script.setup(corpus(tmp_path))
    script.run(model, opt, schedule, data, 3)
    return model, opt, schedule, data


def test_the_folder_holds_the_model_the_moments_and_the_state(tmp_path: Path) -> None:
    from safetensors import safe_open

    model, opt, schedule, data = small(tmp_path)
    gen = np.random.default_rng(4)
    gen.random(3)
    path = save_checkpoint(
        tmp_path / "ckpt", model, opt, schedule, data, extra={"run": [1, "a"]}, rngs={"g": gen}
    )
    assert sorted(os.listdir(path)) == [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    assert state["mila_py_version"] == mila_py.__version__ and state["model"] == "Llama"
    assert state["optimizer"]["step_count"] == 3 and state["schedule"]["step_count"] == 3
    assert state["optimizer"]["hyperparameters"]["lr"] == opt.lr
    assert state["data"] == data.state_dict() and state["extra"] == {"run": [1, "a"]}
    with safe_open(str(path / OPTIMIZER_FILE), framework="numpy") as f:
        names = set(f.keys())
        np.testing.assert_array_equal(f.get_tensor("exp_avg.embed_tokens.weight"), opt._m[0])
    params = [name for name, _ in model.named_parameters()]
    assert names == {f"{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in params}
    with safe_open(str(path / MODEL_FILE), framework="numpy") as f:
        assert json.loads(f.metadata()["mila_py.config"])["dim"] == 16
    # the generators' states come back: the draws after the load repeat
    expected = gen.random(5)
    assert load_checkpoint(path, model, opt, rngs={"g": gen}) == {"run": [1, "a"]}
    np.testing.assert_array_equal(gen.random(5), expected)


def test_a_new_save_replaces_the_old_folder_whole(tmp_path: Path) -> None:
    model, opt, schedule, data = small(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", model, opt, schedule, data, extra=1)
    (path / "stray").write_text("from the old folder")
    save_checkpoint(path, model, opt, schedule, data, extra=2)
    assert sorted(os.listdir(path)) == [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]
    assert json.loads((path / STATE_FILE).read_text())["extra"] == 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["ckpt", "corpus.txt", "data", "resume_script.py"]
    )


def test_a_failed_save_leaves_the_old_checkpoint_and_no_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mila_py.train as train_module

    model, opt, schedule, data = small(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", model, opt, schedule, data, extra="old")
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}
    listing = sorted(os.listdir(tmp_path))

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(train_module, "_save_tensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, model, opt, schedule, data, extra="new")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no JSON form"):
        save_checkpoint(path, model, opt, schedule, data, extra={"a": object()})
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == listing


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    model, opt, _, _ = small(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="holds no checkpoint"):
        save_checkpoint(precious, model, opt)
    assert (precious / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not a folder"):
        save_checkpoint(tmp_path / "file", model, opt)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_checkpoint(empty, model, opt)  # an empty folder is taken
    assert (empty / STATE_FILE).is_file()


def test_an_interrupted_swap_is_named_by_the_load(tmp_path: Path) -> None:
    model, opt, _, _ = small(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", model, opt)
    aside = tmp_path / ".ckpt.0123456789ab.old"
    os.rename(path, aside)  # as a save killed between its two renames leaves it
    with pytest.raises(FileNotFoundError, match=r"the previous checkpoint whole at .*\.ckpt\.0123"):
        load_checkpoint(path, model, opt)


def test_a_checkpoint_that_does_not_fit_loads_nothing(tmp_path: Path) -> None:
    script = load_script(tmp_path)
    model, opt, schedule, data = small(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", model, opt, schedule, data)

    other, other_opt, other_schedule, _ = script.setup(tmp_path / "data", init_seed=5)
    from mila_py.data import TokenDataset

    other_data = TokenDataset(tmp_path / "data", 8, 2, seed=6)  # another seed: another order
    weights = [p.copy() for p in other.get_parameters()]
    with pytest.raises(ValueError, match="seed: saved 5, this dataset has 6"):
        load_checkpoint(path, other, other_opt, other_schedule, other_data)
    for p, w in zip(other.get_parameters(), weights, strict=True):
        np.testing.assert_array_equal(p, w)
    assert other_opt.step_count == 0 and other_schedule.step_count == 0

    from mila_py import BuildContext, RuntimeMode
    from mila_py.models import Llama, LlamaConfig
    from mila_py.optim import AdamW

    cfg = LlamaConfig(
        vocab_size=256, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=32, max_seq_len=16
    )
    wider = Llama("llama", cfg, device="CPU")
    wider.build(BuildContext((2, 8), RuntimeMode.TRAINING))
    wider_opt = AdamW(wider, lr=1e-2)
    with pytest.raises(ValueError, match=r"layer0\.mlp\.gate_proj\.weight: shape"):
        load_checkpoint(path, wider, wider_opt)
    assert wider_opt.step_count == 0
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / STATE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a mila_py checkpoint"):
        load_checkpoint(tmp_path / "fake", model, opt)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere", model, opt)


def test_a_resumed_train_call_does_only_the_steps_left(tmp_path: Path) -> None:
    script = load_script(tmp_path)
    model, opt, schedule, data = script.setup(corpus(tmp_path))
    records = train(model, opt, data, steps=4, schedule=schedule, checkpoint_dir=tmp_path / "c",
                    checkpoint_every=3, progress=False)  # fmt: skip
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    state = json.loads((tmp_path / "c" / STATE_FILE).read_text())
    assert state["optimizer"]["step_count"] == 4  # the last save: the end of the run
    model, opt, schedule, data = script.setup(tmp_path / "data", init_seed=1)
    load_checkpoint(tmp_path / "c", model, opt, schedule, data)
    assert train(model, opt, data, steps=4, schedule=schedule, progress=False) == []
    records = train(model, opt, data, steps=6, schedule=schedule, progress=False)
    assert [r["step"] for r in records] == [5, 6]
