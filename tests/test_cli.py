"""``mila-py generate``, ``chat`` and ``serve`` on a tiny model folder: their text is
``model.complete`` / ``model.chat``'s on the same folder (tests/test_text.py checks those)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from text_helpers import make_model_folder

from mila_py import cli
from mila_py.models import Llama

ROOT = Path(__file__).resolve().parents[1]
# the subprocesses import this checkout's mila_py and write UTF-8 whatever the locale
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": "utf-8"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_folder(tmp_path_factory.mktemp("cli") / "tiny-chat")


@pytest.fixture(scope="module")
def model(folder: Path) -> Llama:
    return Llama.from_pretrained(folder)


def run_cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "mila_py", *args],
        input=stdin, capture_output=True, timeout=300, env=ENV,
    )  # fmt: skip


def test_generate_streams_what_model_complete_returns(folder: Path, model: Llama) -> None:
    prompt = "Hello world, this"
    done = run_cli("generate", str(folder), "--prompt", prompt, "--max-new-tokens", "25",
                   "--temperature", "0")  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    # bytes: the text may hold a carriage return, which text mode would turn into a newline
    want = model.complete(prompt, max_new_tokens=25, temperature=0)
    assert done.stdout.decode("utf-8") == f"{want}\n"


def test_generate_passes_the_sampling_options(
    folder: Path, model: Llama, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--max-new-tokens", "20", "--temperature", "0.9", "--top-k", "20", "--top-p",
            "0.95", "--seed", "5"]  # fmt: skip
    assert cli.main(["generate", str(folder), "--prompt", "Numbers", *args]) == 0
    want = model.complete(
        "Numbers", max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.95, seed=5
    )
    assert capsys.readouterr().out == f"{want}\n"
    greedy = model.complete("Numbers", max_new_tokens=20, temperature=0)
    assert want != greedy  # the options made a difference


def test_chat_keeps_the_history(
    folder: Path, model: Llama, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\nTell me more\n/exit\nnever read\n"))
    argv = ["chat", str(folder), "--max-new-tokens", "15", "--system", "Be brief."]
    assert cli.main(argv) == 0
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    first = model.chat(history, max_new_tokens=15)
    history += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Tell me more"},
    ]
    second = model.chat(history, max_new_tokens=15)
    assert capsys.readouterr().out == f"{first}\n{second}\n"
    # end of input ends it too
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n"))
    assert cli.main(["chat", str(folder), "--max-new-tokens", "15"]) == 0
    assert capsys.readouterr().out == model.chat(history[1:2], max_new_tokens=15) + "\n"


def test_errors_name_the_command(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", str(tmp_path / "none"), "--prompt", "hi"]) == 1
    assert "mila-py generate:" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    assert cli.main(["chat", str(bare)]) == 1
    assert "tokenizer.json" in capsys.readouterr().err
    assert cli.main(["generate", str(folder), "--prompt", "hi", "--temperature", "-1"]) == 1
    assert "temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        cli.main(["generate", str(folder)])  # no --prompt
    assert usage.value.code == 2


def test_serve_loads_the_model_under_the_folders_name(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("fastapi", reason="serve needs fastapi (the serve extra)")
    pytest.importorskip("uvicorn", reason="serve needs uvicorn (the serve extra)")
    from mila_py import serve

    calls: list[tuple[Any, str, dict[str, Any]]] = []
    monkeypatch.setattr(serve, "run_server", lambda m, n, **kw: calls.append((m, n, kw)))
    argv = ["serve", str(folder), "--port", "8123", "--batch-size", "3", "--seq-len", "64"]
    assert cli.main(argv) == 0
    ((served, name, kwargs),) = calls
    assert name == "tiny-chat" and kwargs == {"host": "127.0.0.1", "port": 8123}
    assert served.build_context.input_shape == (3, 64) and served.tokenizer is not None
    assert cli.main([*argv, "--model-name", "other"]) == 0
    assert calls[-1][1] == "other"


def test_mila_py_serve_answers_what_model_complete_returns(folder: Path, model: Llama) -> None:
    pytest.importorskip("fastapi", reason="serve needs fastapi (the serve extra)")
    pytest.importorskip("uvicorn", reason="serve needs uvicorn (the serve extra)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "mila_py", "serve", str(folder), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5) as response:
                    assert json.loads(response.read())["data"][0]["id"] == "tiny-chat"
                break
            except OSError:
                assert server.poll() is None, server.stderr.read().decode()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "mila-py serve did not start"
                time.sleep(0.2)
        body = {"model": "tiny-chat", "prompt": "Hello world, this", "max_tokens": 25,
                "temperature": 0}  # fmt: skip
        request = urllib.request.Request(
            f"{url}/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        assert text == model.complete("Hello world, this", max_new_tokens=25, temperature=0)
    finally:
        server.terminate()
        server.wait(timeout=60)
