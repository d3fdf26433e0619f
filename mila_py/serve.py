"""An OpenAI-compatible HTTP server for a :class:`~mila_py.models.Llama` with a tokenizer.

A thin layer, as vLLM's ``entrypoints/openai``: each request is checked, mapped onto the
model's own text calls (:meth:`~mila_py.models.Llama.complete_detailed`,
:meth:`~mila_py.models.Llama.chat_detailed`, :meth:`~mila_py.models.Llama.stream_text`) and
answered in OpenAI's formats. Endpoints:

- ``GET /v1/models``: the one model, by the name the server was given.
- ``POST /v1/completions``: ``prompt`` (a string or a list of strings), ``max_tokens``
  (default 16), ``temperature``, ``top_p``, ``top_k`` (an extension; -1 means unset), ``seed``,
  ``stop``, ``stop_token_ids`` (an extension), ``presence_penalty`` / ``frequency_penalty``
  (and the extensions ``repetition_penalty``, ``min_p``, where the model's generation takes
  them), ``n`` (1 only), ``echo`` (false only), ``stream`` (one prompt), ``stream_options``.
- ``POST /v1/chat/completions``: ``messages`` and the same parameters (``max_tokens`` or
  ``max_completion_tokens``; default: up to the end of the context).

Sampling parameters a request leaves out take the checkpoint's defaults, as
:meth:`~mila_py.models.Llama.complete` does. Streams are server-sent events in OpenAI's
chunk format, ending with ``data: [DONE]``; each chunk carries the text generated since the
one before (one token's, or several where the client or the event loop fell behind). Errors
are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (a
parameter out of range, a prompt longer than the context, an unknown parameter), 404 for
another model's name.

Requests run one at a time on the model, in the order they arrive, in one worker thread (the
event loop stays free to take requests and to stream): concurrent requests never share a
batch, so each gets what it would get alone. A client that disconnects from a stream stops its
generation at its next piece, and the model goes on with the next request.

Needs the ``serve`` extra (``pip install "mila-py[serve]"``: FastAPI and uvicorn), imported when
an app is created.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

__all__ = ["RequestError", "create_app", "require_serving", "run_server"]

#: OpenAI's default ``max_tokens`` for ``/v1/completions``
COMPLETIONS_MAX_TOKENS = 16

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
#: parameters passed on to the model's generation where they are not neutral
_PROCESSORS = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}
#: accepted where they ask for nothing this server does not do: their neutral values
_NEUTRAL: dict[str, tuple[Any, ...] | None] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "user": None,  # any value
    "stream_options": None,
}
_COMMON = ("model", "stream", *_SAMPLING, *_PROCESSORS, *_NEUTRAL)
_COMPLETION_KEYS = frozenset((*_COMMON, "prompt"))
_CHAT_KEYS = frozenset((*_COMMON, "messages", "max_completion_tokens"))


def require_serving() -> tuple[Any, Any]:
    """``(fastapi, uvicorn)``, or an ImportError naming the extra that installs them."""
    try:
        import fastapi
        import uvicorn
    except ImportError as exc:
        raise ImportError(
            f"mila_py.serve needs FastAPI and uvicorn ({exc.name} is missing): "
            'pip install "mila-py[serve]"'
        ) from exc
    return fastapi, uvicorn


class RequestError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type,
            code,
        )

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _bad_value(exc: Exception, body: Mapping[str, Any]) -> RequestError:
    """A ValueError or TypeError of the model's checks as a 400, naming the first parameter of
    the request that its message mentions."""
    message = str(exc)
    named = sorted(
        (found.start(), k)
        for k in body
        if k != "model" and (found := re.search(rf"\b{re.escape(k)}\b", message))
    )
    return RequestError(message, param=named[0][1] if named else None)


class _Worker:
    """Runs jobs on the model one at a time, in arrival order, in one thread."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mila-serve")

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        return self._pool.submit(job)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Stream:
    """One streamed generation: the worker thread produces text pieces that the response
    takes. Whatever pieces are ready when the event loop gets to them go out joined, as one
    event: a loop or client slower than the generation gets fewer, longer events instead of
    falling behind by one event per token (OpenAI's clients take any split of the text). The
    worker wakes the loop once per batch, not once per piece. :meth:`cancel` (the client went
    away) stops the generation at its next piece; the stream is closed in the worker, so the
    model is free for the next job."""

    def __init__(self, worker: _Worker, start: Callable[[], Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._lock = threading.Lock()  # guards the four fields below, shared with the worker
        self._pieces: list[str] = []
        self._ended = False
        self._error: Exception | None = None
        self._woken = False  # a wake-up is on its way to the loop and not yet taken
        self._cancelled = threading.Event()
        self.started: concurrent.futures.Future[Any] = concurrent.futures.Future()
        worker.submit(lambda: self._work(start))

    def _put(self, piece: str | None = None, error: Exception | None = None) -> None:
        """Hands over a piece, or the end (``piece`` None), or an error; in the worker."""
        with self._lock:
            if piece is not None:
                self._pieces.append(piece)
            else:
                self._ended, self._error = True, error
            if self._woken:
                return
            self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the loop has closed: nobody reads any more
            self._cancelled.set()

    def _work(self, start: Callable[[], Any]) -> None:
        if self._cancelled.is_set():
            self.started.cancel()
            return
        try:
            stream = start()  # checks every argument: errors go to the request, as a 400
        except BaseException as exc:
            self.started.set_exception(exc)
            return
        self.started.set_result(stream)
        try:
            for piece in stream:
                if self._cancelled.is_set():
                    break
                self._put(piece)
            self._put()
        except Exception as exc:
            self._put(error=exc)
        finally:
            stream.close()

    def cancel(self) -> None:
        self._cancelled.set()

    async def texts(self) -> AsyncIterator[str]:
        """The text until the generation ends, in parts: each the pieces generated since the
        last part, joined (one piece or several). Raises what the generation raised, after
        the text before it."""
        while True:
            await self._ready.wait()
            # cleared before the take: a piece put after the take wakes the loop again
            self._ready.clear()
            with self._lock:
                pieces, self._pieces = self._pieces, []
                ended, error = self._ended, self._error
                self._woken = False
            if pieces:
                yield "".join(pieces)
            if error is not None:
                raise error
            if ended:
                return


def _event(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(model: Any, model_name: str) -> Any:
    """A FastAPI app that serves ``model`` (a built INFERENCE :class:`Llama` with a
    ``tokenizer``) under the name ``model_name``; see the module's docstring.

    Raises:
        ImportError: FastAPI or uvicorn is not installed (the ``serve`` extra).
        ValueError: ``model`` has no tokenizer, or ``model_name`` is empty.
    """
    fastapi, _ = require_serving()
    from fastapi.responses import JSONResponse, StreamingResponse

    if getattr(model, "tokenizer", None) is None:
        raise ValueError(
            "create_app: the model has no tokenizer: load it with Llama.from_pretrained(folder) "
            "from a folder with a tokenizer.json, or set model.tokenizer"
        )
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"create_app: model_name must be a non-empty str, got {model_name!r}")

    class EventStream(StreamingResponse):
        """Closes its event generator however the response ends (a client gone included)."""

        async def stream_response(self, send: Any) -> None:
            try:
                await super().stream_response(send)
            finally:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()

    worker = _Worker()
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        worker.shutdown()

    app = fastapi.FastAPI(title="mila_py", version="1", lifespan=lifespan)

    async def refused(_: Any, exc: Exception) -> Any:
        assert isinstance(exc, RequestError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def failed(_: Any, exc: Exception) -> Any:
        error = RequestError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
        return JSONResponse(error.body(), status_code=500)

    app.add_exception_handler(RequestError, refused)
    app.add_exception_handler(Exception, failed)  # a failed generation, in OpenAI's format too

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "mila_py"}

    # plain routes: each handler reads its request's JSON itself, so that every refusal,
    # malformed bodies included, is answered in OpenAI's error format
    async def models(request: Any) -> Any:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Any) -> Any:
        name = request.path_params["name"]
        if name != model_name:
            raise _unknown_model(name)
        return JSONResponse(model_card())

    async def read(request: Any, keys: frozenset[str]) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise RequestError(f"the request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        for key in body:
            if key not in keys:
                raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
        name = body.get("model")
        if not isinstance(name, str):
            raise RequestError("model must be the model's name (a string)", param="model")
        if name != model_name:
            raise _unknown_model(name)
        for key, allowed in _NEUTRAL.items():
            value = body.get(key)
            if value is not None and allowed is not None and value not in allowed:
                raise RequestError(
                    f"{key}={value!r} is not supported by this server (only "
                    f"{' or '.join(repr(a) for a in allowed)})",
                    param=key,
                )
        stream_options = body.get("stream_options")
        if stream_options is not None and not (
            isinstance(stream_options, dict) and body.get("stream") is True
        ):
            raise RequestError(
                "stream_options must be an object, and only with stream=true",
                param="stream_options",
            )
        return body

    async def run(body: Mapping[str, Any], job: Callable[[], Any]) -> Any:
        try:
            return await asyncio.wrap_future(worker.submit(job))
        except (ValueError, TypeError) as exc:
            raise _bad_value(exc, body) from None

    async def start_stream(body: Mapping[str, Any], start: Callable[[], Any]) -> _Stream:
        stream = _Stream(worker, start)
        try:
            await asyncio.wrap_future(stream.started)
        except (ValueError, TypeError) as exc:
            raise _bad_value(exc, body) from None
        except BaseException:  # the request was abandoned while it waited
            stream.cancel()
            raise
        return stream

    def events(
        stream: _Stream, body: Mapping[str, Any], chunk: Callable[..., dict[str, Any]]
    ) -> Any:
        text_stream = stream.started.result()
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def generate() -> AsyncIterator[str]:
            try:
                first = chunk(None, None)
                if first is not None:
                    yield _event(first)
                try:
                    async for piece in stream.texts():
                        yield _event(chunk(piece, None))
                except Exception as exc:  # after the headers: reported in the stream
                    yield _event(RequestError(str(exc), type="server_error").body())
                    yield "data: [DONE]\n\n"
                    return
                yield _event(chunk("", text_stream.finish_reason or "length"))
                if usage:
                    final = chunk("", None)
                    final["choices"] = []
                    final["usage"] = _usage(text_stream)
                    yield _event(final)
                yield "data: [DONE]\n\n"
            finally:
                stream.cancel()

        return EventStream(generate(), media_type="text/event-stream")

    async def completions(request: Any) -> Any:
        body = await read(request, _COMPLETION_KEYS)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = prompt
        else:
            raise RequestError("prompt must be a string or a list of strings", param="prompt")
        options = _options(body, COMPLETIONS_MAX_TOKENS)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream") is True:
            if len(prompts) != 1:
                raise RequestError("stream=true takes one prompt", param="prompt")
            stream = await start_stream(body, lambda: model.stream_text(prompts[0], **options))

            def chunk(piece: str | None, finish: str | None) -> Any:
                if piece is None:
                    return None
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
                return {
                    "id": rid,
                    "object": "text_completion",
                    "created": now,
                    "model": model_name,
                    "choices": [choice],
                }

            return events(stream, body, chunk)
        done = await run(body, lambda: model.complete_detailed(prompts, **options))
        choices = [
            {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
            for i, c in enumerate(done)
        ]
        return JSONResponse(
            {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": choices,
                "usage": _usage(*done),
            }
        )

    async def chat_completions(request: Any) -> Any:
        body = await read(request, _CHAT_KEYS)
        messages = _messages(body.get("messages"))
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        options = _options(body, model.context_length)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream") is True:
            stream = await start_stream(body, lambda: model.stream_text(messages, **options))

            def chunk(piece: str | None, finish: str | None) -> Any:
                delta = (
                    {"role": "assistant", "content": ""}
                    if piece is None
                    else {"content": piece}
                    if piece
                    else {}
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": now,
                    "model": model_name,
                    "choices": [choice],
                }

            return events(stream, body, chunk)
        done = await run(body, lambda: model.chat_detailed(messages, **options))
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": done.text},
            "logprobs": None,
            "finish_reason": done.finish_reason,
        }
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": now,
                "model": model_name,
                "choices": [choice],
                "usage": _usage(done),
            }
        )

    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/v1/models/{name:path}", one_model, methods=["GET"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


def _unknown_model(name: str) -> RequestError:
    return RequestError(
        f"The model `{name}` does not exist.",
        param="model",
        status=404,
        code="model_not_found",
    )


def _usage(*done: Any) -> dict[str, int]:
    prompt = sum(d.prompt_tokens for d in done)
    completion = sum(d.completion_tokens for d in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _options(body: Mapping[str, Any], max_tokens: int) -> dict[str, Any]:
    """The keyword arguments of the model's text calls for a request's parameters."""
    options: dict[str, Any] = {}
    integers = ("top_k", "seed", "max_tokens")
    for key in ("temperature", "top_p", *integers, *_PROCESSORS):
        value = body.get(key)
        if value is None:
            continue
        if key in integers and (not isinstance(value, int) or isinstance(value, bool)):
            raise RequestError(f"{key} must be an integer, got {value!r}", param=key)
        if not _is_number(value):
            raise RequestError(f"{key} must be a number, got {value!r}", param=key)
        if key == "max_tokens":
            if value < 1:
                raise RequestError(f"max_tokens must be at least 1, got {value}", param=key)
            max_tokens = value
        elif key == "top_k" and value == -1:
            continue  # vLLM's "unset"
        elif key in _PROCESSORS and value == _PROCESSORS[key]:
            continue  # neutral: nothing to pass on
        else:
            options[key] = value
    options["max_new_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of them", param="stop")
        options["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise RequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
        options["stop_token_ids"] = ids
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", param="stream")
    return options


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The chat messages, each ``content`` as a string (the text parts of a list joined)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages", param="messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(
                f"each message must be an object with a string role, got {message!r}",
                param="messages",
            )
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(
                    "message content parts must be text parts ({'type': 'text', 'text': ...})",
                    param="messages",
                )
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(
                f"message content must be a string or a list of text parts, got {content!r}",
                param="messages",
            )
        out.append({**message, "content": content})
    return out


def run_server(
    model: Any,
    model_name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Serve ``model`` with uvicorn at ``http://host:port/v1`` until interrupted (see
    :func:`create_app`).

    Raises:
        ImportError: FastAPI or uvicorn is not installed (the ``serve`` extra).
    """
    _, uvicorn = require_serving()
    app = create_app(model, model_name)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
