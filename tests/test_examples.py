"""The training examples' data handling and argument checks (no training is run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from train_llama import batches, held_out_batches, load_corpus, split_corpus  # noqa: E402


def test_held_out_batches_differ_and_repeat_across_runs() -> None:
    tokens = np.arange(10_000)
    first = held_out_batches(tokens, 4, 16)
    starts = {int(x[0, 0]) for x, _ in first}
    assert len(starts) == 4  # four different batches, not one four times
    again = held_out_batches(tokens, 4, 16)
    for (x, y), (u, v) in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, u)
        np.testing.assert_array_equal(y, v)


def test_batches_take_every_window_that_fits() -> None:
    tokens = np.arange(20)
    x, y = next(batches(tokens, 2000, 19, np.random.default_rng(0)))
    assert set(x[:, 0].tolist()) == {0}  # exactly one window of 20 tokens: start 0
    np.testing.assert_array_equal(y, x + 1)
    x, _ = next(batches(tokens, 2000, 10, np.random.default_rng(0)))
    assert set(x[:, 0].tolist()) == set(range(10))  # the last start (9) included


def test_corpus_is_read_only_up_to_max_bytes_and_must_fit_a_window(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_bytes(b"abc" * 10_000)
    assert load_corpus(str(data), 100).size == 100
    train, held = split_corpus(load_corpus(str(data), 30_000), 128)
    assert train.size + held.size == 30_000 and held.size >= 129
    with pytest.raises(SystemExit, match="corpus too small"):
        split_corpus(np.arange(2000), 128)
    with pytest.raises(SystemExit, match="cannot read"):
        load_corpus(str(tmp_path), 100)  # a folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--device", "garbage"], "unknown device type"),
        (["--prompt", ""], "--prompt must have 1 to 512 bytes"),
        (["--new-tokens", "1000"], "--new-tokens must be in"),
    ],
)
def test_the_main_example_refuses_bad_options_before_training(
    args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_and_generate.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("lr", ["0", "-1", "nan", "inf"])
def test_the_training_example_refuses_a_bad_learning_rate_before_reading(lr: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_llama.py"), "--lr", lr, "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--lr must be a finite number > 0" in done.stderr and "Traceback" not in done.stderr
