"""The OpenAI-compatible server through the official ``openai`` client: completions and chat,
streamed and not, errors in OpenAI's format, concurrent clients, and a client that leaves
mid-stream. The server's text is checked against ``model.complete`` / ``model.chat`` on the
same model (tests/test_text.py checks those against the tokenizer and ``generate``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi (the serve extra)")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (the serve extra)")
openai = pytest.importorskip("openai", reason="the client tests need the openai package")

from serve_helpers import running_server  # noqa: E402
from text_helpers import make_model_folder  # noqa: E402

from mila_py.models import Llama  # noqa: E402
from mila_py.serve import _Stream, _Worker, create_app  # noqa: E402

NAME = "tiny-chat"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Llama:
    folder = make_model_folder(tmp_path_factory.mktemp("serve") / "tiny")
    return Llama.from_pretrained(folder)


@pytest.fixture(scope="module")
def url(model: Llama) -> Iterator[str]:
    with running_server(model, NAME) as base:
        yield base


@pytest.fixture
def client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, path: str, body: Any) -> tuple[int, Any]:
    """A raw POST (no client-side checks): the status and the decoded JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# ------------------------------------------------------------------------ the endpoints
def test_models_lists_the_model_by_its_name(client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_is_model_complete(client: Any, model: Llama) -> None:
    prompt = "Hello world"
    (want,) = model.complete_detailed(prompt, max_new_tokens=20, temperature=0)
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0)
    assert got.object == "text_completion" and got.model == NAME
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.completion_tokens == want.completion_tokens
    assert got.usage.total_tokens == want.total_tokens
    # the default max_tokens is OpenAI's 16
    short = client.completions.create(model=NAME, prompt=prompt, temperature=0)
    assert short.choices[0].text == model.complete(prompt, max_new_tokens=16, temperature=0)


def test_several_prompts_come_back_in_order(client: Any, model: Llama) -> None:
    prompts = ["Hello world", "The quick brown", "你好"]
    got = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == model.complete(prompts, max_new_tokens=12)
    details = model.complete_detailed(prompts, max_new_tokens=12)
    assert got.usage.completion_tokens == sum(d.completion_tokens for d in details)


def test_streamed_completion_joins_to_the_same_text(client: Any, model: Llama) -> None:
    prompt = "emoji 😀 🎉"
    (want,) = model.complete_detailed(prompt, max_new_tokens=30, temperature=0)
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=30, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    # pieces ready together go out as one event, so the number of events depends on timing
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        want.completion_tokens
    )


def test_stop_strings_and_sampling_reach_the_model(client: Any, model: Llama) -> None:
    prompt = "Numbers 12345"
    full = model.complete(prompt, max_new_tokens=40, temperature=0)
    assert isinstance(full, str)
    stop = full[8:11]
    got = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop]
    )
    assert got.choices[0].text == full[: full.find(stop)]
    assert got.choices[0].finish_reason == "stop"
    sampled = model.complete(prompt, max_new_tokens=20, temperature=0.9, top_k=20, seed=5)
    got = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=20, temperature=0.9, seed=5, extra_body={"top_k": 20}
    )
    assert got.choices[0].text == sampled


def test_chat_is_model_chat(client: Any, model: Llama) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    want = model.chat_detailed(messages, max_new_tokens=25, temperature=0)
    got = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=25, temperature=0
    )
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens
    # content as a list of text parts is the same conversation
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    again = client.chat.completions.create(
        model=NAME, messages=parts, max_completion_tokens=25, temperature=0
    )
    assert again.choices[0].message.content == want.text


def test_streamed_chat_joins_to_the_same_reply(client: Any, model: Llama) -> None:
    messages = [{"role": "user", "content": "Tell me"}]
    want = model.chat(messages, max_new_tokens=30, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=30, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": -1, "stream": True}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"echo": True}, "echo"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"prompt": "Hello world " * 200}, None),
        ({"prompt": 7}, "prompt"),
        ({"prompt": ["a", "b"], "stream": True}, "prompt"),
    ],
)
def test_bad_parameters_are_400_in_openai_format(
    url: str, client: Any, extra: dict[str, Any], param: str | None
) -> None:
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, **extra}
    status, answer = post(url, "/v1/completions", body)
    assert status == 400
    assert set(answer) == {"error"}
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    else:
        assert "context" in error["message"]
    # the official client raises its BadRequestError on the same request
    with pytest.raises(openai.BadRequestError):
        kwargs = {k: v for k, v in body.items() if k not in ("model", "prompt")}
        client.completions.create(model=NAME, prompt=body["prompt"], extra_body=kwargs)


def test_penalties_reach_the_model_only_where_it_takes_them(url: str, model: Llama) -> None:
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    neutral, _ = post(url, "/v1/completions", {**body, "presence_penalty": 0})
    assert neutral == 200  # neutral: nothing passed on
    status, answer = post(url, "/v1/completions", {**body, "presence_penalty": 0.5})
    if "presence_penalty" in inspect.signature(model.stream).parameters:
        assert status == 200
    else:
        assert status == 400 and answer["error"]["param"] == "presence_penalty"


def test_a_failed_generation_is_500_in_openai_format(
    url: str, model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise FloatingPointError("NaN in the logits")

    monkeypatch.setattr(model, "stream", broken)
    status, answer = post(url, "/v1/completions", {"model": NAME, "prompt": "Hello"})
    assert status == 500 and answer["error"]["type"] == "server_error"
    assert "NaN in the logits" in answer["error"]["message"]


def test_chat_errors_too(url: str) -> None:
    for body in (
        {"model": NAME, "messages": []},
        {"model": NAME, "messages": [{"content": "no role"}]},
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_p": 2},
    ):
        status, answer = post(url, "/v1/chat/completions", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", body
    status, answer = post(url, "/v1/chat/completions", b"{not json")
    assert status == 400 and "JSON" in answer["error"]["message"]


def test_an_unknown_model_is_404(url: str, client: Any) -> None:
    status, answer = post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404
    assert answer["error"]["param"] == "model" and answer["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------------ concurrency
def test_concurrent_streams_each_get_what_they_get_alone(client: Any, url: str) -> None:
    requests = [
        {"prompt": p, "max_tokens": 24, "temperature": t, "seed": s}
        for p, t, s in [
            ("Hello world", 0, None), ("The quick brown", 0, None), ("你好，世界", 0, None),
            ("emoji 😀", 0, None), ("Hello world", 1.0, 1), ("Hello world", 1.0, 2),
            ("Numbers 12345", 0.8, 3), ("It's a lovely day", 0, None),
        ]
    ]  # fmt: skip

    def streamed(request: dict[str, Any], client: Any) -> str:
        chunks = client.completions.create(model=NAME, stream=True, **request)
        return "".join(c.choices[0].text for c in chunks)

    alone = [streamed(r, client) for r in requests]
    assert len(set(alone)) >= 6  # different answers, so a mix-up would show
    results: list[str | None] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def run(i: int) -> None:
        own = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        start.wait()
        results[i] = streamed(requests[i], own)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == alone


def test_a_client_that_leaves_mid_stream_frees_the_model(
    client: Any, model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generation of a client that disconnects stops at its next piece, and the next
    request is served. A slowed stream (one token per 20 ms) makes the stop observable."""
    real = model.stream
    produced: list[int] = []
    closed = threading.Event()

    def slow(prompt: Any, **kwargs: Any) -> Iterator[Any]:
        tokens = real(prompt, **kwargs)
        try:
            for token in tokens:
                produced.append(1)
                time.sleep(0.02)
                yield token
        finally:
            tokens.close()  # type: ignore[attr-defined]
            closed.set()

    monkeypatch.setattr(model, "stream", slow)
    stream = client.completions.create(
        model=NAME, prompt="Hello world", max_tokens=150, temperature=0, stream=True,
        extra_body={"stop_token_ids": []},
    )  # fmt: skip
    next(iter(stream))
    stream.close()  # the connection goes away
    assert closed.wait(timeout=60)
    assert len(produced) < 100 and not model.run_lock.locked
    monkeypatch.setattr(model, "stream", real)
    got = client.completions.create(model=NAME, prompt="Hello world", max_tokens=10, temperature=0)
    assert got.choices[0].text == model.complete("Hello world", max_new_tokens=10, temperature=0)


# ------------------------------------------------------------------------ the hand-off
class Pieces:
    """A stand-in for a TextStream: ``pieces`` in turn, each after its gate (if any) opens,
    then ``error`` (if any); ``done`` is set once the last piece is handed over."""

    def __init__(
        self,
        pieces: list[str],
        gates: dict[int, threading.Event] | None = None,
        error: Exception | None = None,
    ) -> None:
        self.pieces, self.gates, self.error = pieces, gates or {}, error
        self.done, self.closed = threading.Event(), threading.Event()

    def __iter__(self) -> Iterator[str]:
        for i, piece in enumerate(self.pieces):
            if i in self.gates:
                assert self.gates[i].wait(timeout=60)
            yield piece
        self.done.set()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed.set()


def test_pieces_ready_together_go_out_as_one_text_with_one_wake_up() -> None:
    """The pieces the worker hands over while the event loop is busy elsewhere come out joined,
    and the worker wakes the loop once for them, not once per piece."""
    gate = threading.Event()
    source = Pieces(["He", "llo", " wor", "ld"], gates={1: gate})

    async def read() -> tuple[list[str], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        real = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal wake_ups
            wake_ups += threading.current_thread().name.startswith("mila-serve")
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        worker = _Worker()
        try:
            stream = _Stream(worker, lambda: source)
            await asyncio.wrap_future(stream.started)
            texts = stream.texts()
            got = [await anext(texts)]
            before = wake_ups
            gate.set()  # the other three pieces and the end, while the loop waits here
            await asyncio.to_thread(source.closed.wait, 60)
            got += [text async for text in texts]
            return got, wake_ups - before
        finally:
            worker.shutdown()

    got, wake_ups = asyncio.run(read())
    assert got == ["He", "llo world"]
    assert wake_ups == 1
    assert source.closed.is_set()


def test_an_error_comes_after_the_text_before_it() -> None:
    source = Pieces(["a", "b"], error=RuntimeError("the generation failed"))

    async def read() -> list[str]:
        worker = _Worker()
        got: list[str] = []
        try:
            stream = _Stream(worker, lambda: source)
            await asyncio.wrap_future(stream.started)
            await asyncio.to_thread(source.closed.wait, 60)
            with pytest.raises(RuntimeError, match="the generation failed"):
                async for text in stream.texts():
                    got.append(text)
            return got
        finally:
            worker.shutdown()

    assert asyncio.run(read()) == ["ab"]


# ------------------------------------------------------------------------ setup errors
def test_create_app_needs_a_tokenizer_and_names_the_extra(
    model: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = model.tokenizer
    monkeypatch.setattr(model, "tokenizer", None)
    with pytest.raises(ValueError, match="tokenizer"):
        create_app(model, NAME)
    monkeypatch.setattr(model, "tokenizer", tokenizer)
    with pytest.raises(ValueError, match="model_name"):
        create_app(model, "")
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(ImportError, match=r"mila-py\[serve\]"):
        create_app(model, NAME)


def test_the_serve_extra_lists_the_server_packages() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert {d.split(">")[0] for d in extras["serve"]} == {"fastapi", "uvicorn"}
    assert {"fastapi", "uvicorn", "openai"} <= {d.split(">")[0] for d in extras["test"]}
