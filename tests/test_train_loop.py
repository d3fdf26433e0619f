"""The training loop: what one step does and in which order, gradient accumulation, the
all-reduce seam, skipped steps, eval, the JSON-lines log and its plot."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mila_py import BuildContext, RuntimeMode, TrainingMode
from mila_py.components import SoftmaxCrossEntropy, SoftmaxCrossEntropyConfig
from mila_py.data import TokenDataset, prepare_data
from mila_py.init import manual_seed
from mila_py.models import Llama, LlamaConfig
from mila_py.optim import AdamW, LinearSchedule, clip_grad_norm
from mila_py.train import evaluate, plot_loss, read_log, train

T = 8


def model_for(batch: int) -> Llama:
    manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=24, max_seq_len=16
    )
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((batch, T), RuntimeMode.TRAINING))
    return model


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_bytes(np.random.default_rng(3).integers(32, 127, 2000, dtype=np.uint8).tobytes())
    return prepare_data(None, tmp_path / "data", [text])


def weights(model: Llama) -> bytes:
    return b"".join(p.tobytes() for p in model.get_parameters())


def test_a_step_is_the_loop_written_by_hand(data_dir: Path) -> None:
    """forward/backward per micro-batch with the loss scaled by 1/accum, clip, step, schedule,
    zero: the same bytes as train()."""
    model, reference = model_for(2), model_for(2)
    opt, ref_opt = AdamW(model, lr=1e-2), AdamW(reference, lr=1e-2)
    schedule, ref_schedule = LinearSchedule(opt, 2, 6), LinearSchedule(ref_opt, 2, 6)
    data, ref_data = TokenDataset(data_dir, T, 2, seed=1), TokenDataset(data_dir, T, 2, seed=1)
    records = train(model, opt, data, steps=5, grad_accum=3, clip=0.3, schedule=schedule,
                    progress=False)  # fmt: skip

    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(256), device="CPU")
    loss_fn.build(BuildContext((2, T, 256), RuntimeMode.TRAINING))
    for step in range(5):
        lr, loss = ref_opt.lr, 0.0
        for _ in range(3):
            x, y = ref_data.next_batch()
            loss += loss_fn.forward(reference.forward(x), y) / 3
            reference.backward(loss_fn.backward(1 / 3))
        norm = clip_grad_norm(reference, 0.3)
        ref_opt.step()
        reference.zero_gradients()
        ref_schedule.step()
        assert records[step]["loss"] == loss and records[step]["lr"] == lr
        assert records[step]["grad_norm"] == norm
    assert weights(model) == weights(reference)
    assert [r["tokens"] for r in records] == [48 * (i + 1) for i in range(5)]


def test_accumulated_micro_batches_equal_one_large_batch(data_dir: Path) -> None:
    """The stream of windows does not depend on the batch size, so 2 micro-batches of 2 rows
    see the rows of 1 batch of 4: the gradients of the mean loss agree at every step (to
    rounding)."""
    small, large = model_for(2), model_for(4)
    opt_small, opt_large = AdamW(small, lr=1e-2), AdamW(large, lr=1e-2)
    seen: list[np.ndarray] = []

    def keep(model: Llama) -> None:
        seen.append(np.concatenate([g.ravel() for g in model.get_gradients()]))

    train(small, opt_small, TokenDataset(data_dir, T, 2), steps=3, grad_accum=2, progress=False,
          allreduce=keep)  # fmt: skip
    train(large, opt_large, TokenDataset(data_dir, T, 4), steps=3, progress=False,
          allreduce=keep)  # fmt: skip
    # (the weights are not compared: Adam's m / sqrt(v) turns a rounding difference of a
    # near-zero gradient into a step of up to lr)
    for accumulated, whole in zip(seen[:3], seen[3:], strict=True):
        np.testing.assert_allclose(accumulated, whole, rtol=2e-4, atol=1e-7)


def test_the_allreduce_hook_runs_after_backward_and_before_clipping(data_dir: Path) -> None:
    calls = []

    def double(model: Llama) -> None:  # stands for a sum over two ranks of equal gradients
        calls.append(float(sum(np.abs(g).sum() for g in model.get_gradients())))
        for g in model.get_gradients():
            g *= 2

    plain = train(model_for(2), AdamW(model_for(2)), TokenDataset(data_dir, T, 2), steps=1,
                  clip=1e9, progress=False)  # fmt: skip
    model = model_for(2)
    hooked = train(model, AdamW(model), TokenDataset(data_dir, T, 2), steps=2, clip=1e9,
                   progress=False, allreduce=double)  # fmt: skip
    assert len(calls) == 2 and all(c > 0 for c in calls)  # the gradients were there
    assert hooked[0]["grad_norm"] == pytest.approx(2 * plain[0]["grad_norm"], rel=1e-12)


def test_a_step_with_non_finite_gradients_is_skipped_and_counted(data_dir: Path) -> None:
    model = model_for(2)
    opt = AdamW(model, lr=1e-2)
    schedule = LinearSchedule(opt, 0, 10)
    snapshots = []

    def poison(model: Llama) -> None:
        snapshots.append(weights(model))
        if len(snapshots) == 2:
            model.get_gradients()[0].flat[0] = np.nan

    records = train(model, opt, TokenDataset(data_dir, T, 2), steps=3, clip=1.0,
                    schedule=schedule, progress=False, allreduce=poison)  # fmt: skip
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    assert records[1]["grad_norm"] is None
    assert opt.step_count == 2 and opt.skipped_steps == 1 and schedule.step_count == 3
    assert snapshots[2] == snapshots[1]  # the skipped step changed no weight
    assert all(np.isfinite(p).all() for p in model.get_parameters())


def test_the_log_has_one_flushed_line_per_step_and_appends(data_dir: Path, tmp_path: Path) -> None:
    model = model_for(2)
    opt = AdamW(model, lr=1e-2)
    log = tmp_path / "run.jsonl"
    data, held_out = TokenDataset(data_dir, T, 2, seed=1), TokenDataset(data_dir, T, 2, seed=9)
    lines_while_running = []

    def peek(model: Llama) -> None:  # the lines of the steps before are on disk already
        lines_while_running.append(len(log.read_text().splitlines()) if log.exists() else 0)

    records = train(model, opt, data, steps=4, eval_dataset=held_out, eval_every=2,
                    eval_batches=3, log_path=log, progress=False, allreduce=peek)  # fmt: skip
    assert lines_while_running == [0, 1, 2, 3]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == records
    assert [("eval_loss" in r) for r in lines] == [False, True, False, True]
    assert lines[3]["eval_loss"] == evaluate(model, held_out, 3)  # the weights after step 4
    for r in lines:
        assert {"step", "loss", "lr", "tokens", "tokens_per_s", "epoch"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    assert held_out.position == 0  # eval reads the same batches each time
    assert model.training_mode is TrainingMode.NORMAL
    train(model, opt, data, steps=6, log_path=log, progress=False)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_evaluate_is_the_mean_loss_of_the_same_batches_in_eval_mode(data_dir: Path) -> None:
    model = model_for(2)
    held_out = TokenDataset(data_dir, T, 2, seed=9)
    loss_fn = SoftmaxCrossEntropy("loss", SoftmaxCrossEntropyConfig(256), device="CPU")
    loss_fn.build(BuildContext((2, T, 256), RuntimeMode.INFERENCE))
    copy = TokenDataset(data_dir, T, 2, seed=9)
    expected = np.mean([loss_fn.forward(model.forward(x), y) for x, y in
                        (copy.next_batch() for _ in range(3))])  # fmt: skip
    assert evaluate(model, held_out, 3) == pytest.approx(expected, rel=1e-12)
    assert evaluate(model, held_out, 3) == evaluate(model, held_out, 3)
    assert held_out.position == 0 and model.training_mode is TrainingMode.NORMAL


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": -1}, "steps must be an int >= 0"),
        ({"steps": 2, "grad_accum": 0}, "grad_accum must be an int >= 1"),
        ({"steps": 2, "clip": 0.0}, "clip must be a number > 0 or None"),
        ({"steps": 2, "eval_every": -1}, "eval_every must be an int >= 0"),
        ({"steps": 2.0}, "steps must be an int >= 0"),
    ],
)
def test_bad_arguments_are_refused(data_dir: Path, kwargs: dict[str, Any], message: str) -> None:
    model = model_for(2)
    with pytest.raises(ValueError, match=message):
        train(model, AdamW(model), TokenDataset(data_dir, T, 2), progress=False, **kwargs)


def test_batches_larger_than_the_build_and_a_stray_schedule_are_refused(data_dir: Path) -> None:
    model = model_for(2)
    opt = AdamW(model, lr=1e-2)
    with pytest.raises(ValueError, match=r"batches are \[3, 8\], larger than .* build \[2, 8\]"):
        train(model, opt, TokenDataset(data_dir, T, 3), steps=1, progress=False)
    schedule = LinearSchedule(opt, 0, 5)
    schedule.step()
    with pytest.raises(ValueError, match="the schedule is at step 1, the optimizer at 0"):
        train(model, opt, TokenDataset(data_dir, T, 2), steps=1, schedule=schedule,
              progress=False)  # fmt: skip
    inference = Llama("llama", model.config, device="CPU")
    inference.build(BuildContext((2, T), RuntimeMode.INFERENCE))
    with pytest.raises(RuntimeError, match="must be a built TRAINING model"):
        train(inference, opt, TokenDataset(data_dir, T, 2), steps=1, progress=False)


def test_read_log_keeps_the_last_line_of_a_step(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "loss": 3.5},
            {"step": 3, "loss": None}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_log(log) == [rows[0], rows[2], rows[3]]
    log.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"run.jsonl:2 is not JSON"):
        read_log(log)


def test_plot_loss_writes_a_png(data_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = model_for(2)
    log = tmp_path / "run.jsonl"
    held_out = TokenDataset(data_dir, T, 2, seed=9)
    train(model, AdamW(model), TokenDataset(data_dir, T, 2), steps=3, eval_dataset=held_out,
          eval_every=1, eval_batches=1, log_path=log, progress=False)  # fmt: skip
    png = plot_loss(log, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "data", "loss.png",
                                                           "run.jsonl"]  # fmt: skip
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no logged step"):
        plot_loss(tmp_path / "empty.jsonl", tmp_path / "x.png")


def test_plot_loss_without_matplotlib_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails
    (tmp_path / "run.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ImportError, match=r"pip install 'mila-py\[plot\]'"):
        plot_loss(tmp_path / "run.jsonl", tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_train_and_a_checkpoint_on_an_emulated_gpu(
    cuda: None, data_dir: Path, tmp_path: Path
) -> None:
    """The loop, its loss and the checkpoint's device-to-host and host-to-device copies on a
    CUDA:0 build (emulated: NumPy arrays, the CUDA kernels compiled for the CPU)."""
    from kernel_emulator import COMPILER

    from mila_py.train import load_checkpoint, save_checkpoint

    if COMPILER is None:
        pytest.skip("the kernel emulator needs g++")

    def setup() -> tuple[Llama, AdamW, LinearSchedule, TokenDataset]:
        manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=256, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=24,
            max_seq_len=16,
        )  # fmt: skip
        model = Llama("llama", cfg, device="CUDA:0")
        model.build(BuildContext((2, T), RuntimeMode.TRAINING))
        opt = AdamW(model, lr=1e-2)
        return model, opt, LinearSchedule(opt, 1, 4), TokenDataset(data_dir, T, 2)

    model, opt, schedule, data = setup()
    train(model, opt, data, steps=2, clip=1.0, schedule=schedule, progress=False)
    save_checkpoint(tmp_path / "ckpt", model, opt, schedule, data)
    train(model, opt, data, steps=4, clip=1.0, schedule=schedule, progress=False)
    resumed, resumed_opt, resumed_schedule, resumed_data = setup()
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt, resumed_schedule, resumed_data)
    train(resumed, resumed_opt, resumed_data, steps=4, clip=1.0, schedule=resumed_schedule,
          progress=False)  # fmt: skip
    ctx = model.execution_context
    for p, q in zip(model.get_parameters(), resumed.get_parameters(), strict=True):
        assert ctx.to_host(p).tobytes() == ctx.to_host(q).tobytes()
