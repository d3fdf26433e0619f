"""The training examples: their data handling, argument checks and a short resumable run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
from train_llama import load_corpus, prepare, split_corpus  # noqa: E402

# the examples import this checkout's mila_py, whatever is installed
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_corpus_is_read_only_up_to_max_bytes(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_bytes(b"abc" * 10_000)
    assert len(load_corpus(str(data), 100)) == 100
    with pytest.raises(SystemExit, match="cannot read"):
        load_corpus(str(tmp_path), 100)  # a folder


def test_the_split_holds_out_5_percent_at_a_line_end_or_a_character() -> None:
    text = b"".join(b"line %d\n" % i for i in range(1000))
    train, held_out = split_corpus(text)
    assert train + held_out == text and train.endswith(b"\n")
    assert 0.04 < len(held_out) / len(text) < 0.06
    accents = "é".encode() * 1000  # no line end: the cut falls between two characters
    train, held_out = split_corpus(accents)
    assert train.decode() and held_out.decode() and train + held_out == accents


def test_prepare_gives_byte_level_datasets_or_says_the_corpus_is_too_small(
    tmp_path: Path,
) -> None:
    text = b"".join(b"line %d\n" % i for i in range(2000))
    train, held_out = prepare(text, None, tmp_path, seq=16, batch=4, seed=3)
    assert train.vocab_size == 256 and train.seed == 3 and held_out.seed == 1
    assert train.meta["count"] + held_out.meta["count"] == len(text)
    x, y = held_out.next_batch()
    assert x.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
    with pytest.raises(SystemExit, match="corpus too small"):
        prepare(b"x" * 2000, None, tmp_path / "small", seq=128, batch=1, seed=0)


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
        env=ENV,
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
        env=ENV,
    )
    assert done.returncode == 2, done.stderr
    assert "--lr must be a finite number > 0" in done.stderr and "Traceback" not in done.stderr


def test_a_short_run_saves_resumes_logs_and_plots(tmp_path: Path) -> None:
    """Six steps saved; the same command with --resume and --steps 9 does three more, appending
    to the log; the plot (where matplotlib is installed) is a PNG."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(b"def f%d(x):\n    return x + %d\n" % (i, i) for i in range(800)))
    small = ["--data", str(corpus), "--seq", "32", "--batch", "2", "--dim", "16", "--layers",
             "1", "--heads", "2", "--kv-heads", "1", "--warmup", "2", "--grad-accum", "2",
             "--save", str(tmp_path / "ckpt"), "--save-every", "3", "--log",
             str(tmp_path / "log.jsonl")]  # fmt: skip

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "train_llama.py"), *small, *extra],
            capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done

    first = run("--steps", "6")
    assert "held-out loss:" in first.stdout and "Traceback" not in first.stderr
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["optimizer"]["step_count"] + state["optimizer"]["skipped_steps"] == 6
    plot = ["--plot", str(tmp_path / "loss.png")]
    second = run("--steps", "9", "--resume", str(tmp_path / "ckpt"), *plot)
    assert "resumed from" in second.stdout and "at step 6 of 9" in second.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no loss curve" in second.stderr
    else:
        assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_from_nothing_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_llama.py"), "--resume", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=120, env=ENV,
    )  # fmt: skip
    assert done.returncode == 2 and "no checkpoint there" in done.stderr


def test_the_main_example_saves_a_folder_that_mila_py_chat_and_serve_load(
    tmp_path: Path,
) -> None:
    """A two-step run: the saved folder loads with its tokenizer (id i is byte i, as the model
    was trained), its chat template and its sampling settings, and the text calls run on it."""
    from mila_py.models import Llama

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"".join(b"def f%d(x):\n    return x + %d\n" % (i, i) for i in range(800)))
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_and_generate.py"), "--data", str(corpus),
         "--steps", "2", "--batch", "2", "--seq", "32", "--new-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"mila-py chat {out}" in done.stdout and f"mila-py serve {out}" in done.stdout
    model = Llama.from_pretrained(out)
    text = "def f(x):\n\treturn 'é' + \"😀\"\x00\x7f"
    assert model.tokenizer.encode(text) == list(text.encode())
    assert model.tokenizer.decode(list(text.encode())) == text
    assert model.config.vocab_size == len(model.tokenizer) == 256
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "# user: hi\n# assistant:"
    defaults = model.generation_defaults
    assert defaults.do_sample and defaults.temperature == 0.8 and defaults.top_k == 40
    assert defaults.max_new_tokens == 8
    done_text = model.complete_detailed("def ", seed=0)[0]
    assert done_text.completion_tokens == 8 and done_text.finish_reason == "length"
    assert isinstance(model.chat([{"role": "user", "content": "hi"}], seed=0), str)
