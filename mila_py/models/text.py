"""Text in, text out: prompts and chat conversations through a model's tokenizer, generated
with :meth:`Llama.stream <mila_py.models.Llama.stream>`, decoded as the tokens arrive and cut at
stop strings.

What :meth:`Llama.complete <mila_py.models.Llama.complete>`, :meth:`Llama.chat
<mila_py.models.Llama.chat>`, :meth:`Llama.stream_text <mila_py.models.Llama.stream_text>` and
the OpenAI-compatible server (:mod:`mila_py.serve`) share:

- a prompt is encoded with the tokenizer's special tokens (BOS first for Llama); a conversation
  is rendered by its chat template with ``add_generation_prompt=True`` (the template writes the
  special tokens);
- generation stops at the first of: an EOS id (the checkpoint's, else the tokenizer's) or one
  of ``stop_token_ids``, whose text is left out; a stop string, the text ending just before it;
  ``max_new_tokens`` new tokens, or the end of the context;
- the text is decoded without special tokens, piece by piece (a character that spans several
  tokens comes out whole), and the pieces that could be the start of a stop string are held
  back until the next tokens tell;
- more prompts than the build's batch size run in waves of ``batch_size`` prompts, one wave
  after another; the results come back in the prompts' order.

The tokenizer is duck-typed (``encode``, ``apply_chat_template``, ``stream_decoder`` and
``eos_token_id``, as :class:`mila_py.interop.Tokenizer` has them), so this module needs nothing
above the models.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from mila_py.components._layer import is_int
from mila_py.models.generation import defaults_of

if TYPE_CHECKING:  # for annotations only: the network imports this module
    from mila_py.models.llama.network import Llama

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "Completion",
    "StopStrings",
    "TextStream",
    "chat_detailed",
    "complete_detailed",
    "stream_text",
]

#: new tokens per prompt when neither the caller nor the checkpoint says how many
DEFAULT_MAX_NEW_TOKENS = 64

FinishReason = Literal["stop", "length"]


class _StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextTokenizer(Protocol):
    """What the text functions use of a tokenizer (:class:`mila_py.interop.Tokenizer`)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any: ...

    def stream_decoder(self, skip_special_tokens: bool = False) -> Any: ...


@dataclass(frozen=True)
class Completion:
    """One prompt's generated text and how it ended.

    Attributes:
        text: the new text only (not the prompt), cut before a stop string.
        finish_reason: ``"stop"`` (an EOS or stop token, or a stop string) or ``"length"``
            (``max_new_tokens`` reached, or the context full).
        prompt_tokens: the prompt's token count (special and template tokens included).
        completion_tokens: the tokens generated for it, the one that stopped it included.
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """``prompt_tokens + completion_tokens``."""
        return self.prompt_tokens + self.completion_tokens


class StopStrings:
    """Text that arrives in pieces, cut before the first of some stop strings.

    :meth:`push` returns the text that is final: everything before a stop string once one has
    appeared (then nothing more), else everything except the longest end that is the start of
    a stop string (held back: the next piece may complete it). :meth:`flush` returns what is
    held back when the text ends without one. A stop string split over pieces is found: the
    text held back is searched again with the next piece.

    Args:
        stops: the stop strings (non-empty), or none.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False  # a stop string appeared

    def push(self, piece: str) -> str:
        """Add ``piece``; the text that is final."""
        if self.stopped:
            return ""
        text = self._held + piece
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        keep = self._partial(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The text held back (the text has ended without a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial(self, text: str) -> int:
        """The length of the longest end of ``text`` that starts a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


class _Row:
    """One prompt of a wave: its decoder, its stop strings, its text and how it ended."""

    def __init__(self, tokenizer: TextTokenizer, prompt_tokens: int, options: _Options) -> None:
        self._decoder: _StreamDecoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self._stops = StopStrings(options.stop)
        self._stop_ids = options.stop_ids
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        self.pieces: list[str] = []
        self.finish_reason: FinishReason | None = None

    def push(self, token: int) -> str:
        """The text final after ``token``; "" once the row has finished."""
        if self.finish_reason is not None:
            return ""
        self.tokens += 1
        if token in self._stop_ids:  # its text is left out
            return self._finish("stop")
        text = self._stops.push(self._decoder.push(token))
        if self._stops.stopped:
            self.finish_reason = "stop"
        return self._keep(text)

    def end(self) -> str:
        """The generation ran out of steps: the text held back; "" if already finished."""
        return "" if self.finish_reason is not None else self._finish("length")

    def _finish(self, reason: FinishReason) -> str:
        text = self._stops.push(self._decoder.flush())
        if self._stops.stopped:
            reason = "stop"
        else:
            text += self._stops.flush()
        self.finish_reason = reason
        return self._keep(text)

    def _keep(self, text: str) -> str:
        if text:
            self.pieces.append(text)
        return text

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion("".join(self.pieces), self.finish_reason, self.prompt_tokens, self.tokens)


@dataclass(frozen=True)
class _Options:
    """The checked options of one call: what every wave passes to ``model.stream``."""

    max_new_tokens: int
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    seed: int | None
    sampling: dict[str, Any]  # temperature, top_k, top_p and processors: those given


class _Wave:
    """Up to ``batch_size`` prompts generated together by one ``model.stream``.

    The stream is made (and every argument checked by it) on construction; the model is
    held from the first step of :meth:`run` until it ends or is closed."""

    def __init__(
        self,
        model: Llama,
        tokenizer: TextTokenizer,
        prompts: list[list[int]],
        options: _Options,
        seed: int | None,
    ) -> None:
        room = model.context_length - max(len(p) for p in prompts) + 1
        self.rows = [_Row(tokenizer, len(p), options) for p in prompts]
        self._tokens: Iterator[Any] = model.stream(
            [np.asarray(p, dtype=np.int64) for p in prompts],
            max_new_tokens=min(options.max_new_tokens, room),
            seed=seed,
            eos_token_id=sorted(options.stop_ids) or None,
            pad_token_id=None,
            **options.sampling,
        )

    def run(self) -> Generator[list[str], None, None]:
        """Per step, each row's new final text ("" for none); the last step's includes what
        the rows held back."""
        try:
            for token in self._tokens:
                yield [row.push(int(t)) for row, t in zip(self.rows, token, strict=True)]
                if all(row.finish_reason is not None for row in self.rows):
                    return
            yield [row.end() for row in self.rows]
        finally:
            close = getattr(self._tokens, "close", None)
            if close is not None:
                close()  # gives the model back now, not when the stream is collected


class TextStream:
    """The text of one prompt, piece by piece, as it is generated (:func:`stream_text`).

    Iterate it for the pieces (non-empty strings); joined, they are the completion's text.
    After the last piece, :attr:`finish_reason`, :attr:`completion_tokens` and
    :attr:`completion` tell how it ended. It holds the model from its first piece until it
    ends or is closed: :meth:`close` it (or use it in a ``with`` block) to stop early.
    """

    def __init__(self, wave: _Wave) -> None:
        self._row = wave.rows[0]
        self._steps = wave.run()
        self._pieces = self._texts()

    def _texts(self) -> Generator[str, None, None]:
        for texts in self._steps:
            if texts[0]:
                yield texts[0]

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating and give the model back (the text stays as far as it got)."""
        self._pieces.close()
        self._steps.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def text(self) -> str:
        """The text returned so far."""
        return "".join(self._row.pieces)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's token count."""
        return self._row.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """The tokens generated so far."""
        return self._row.tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        """``"stop"`` or ``"length"`` once the text has ended; None before (or if closed early)."""
        return self._row.finish_reason

    @property
    def completion(self) -> Completion | None:
        """The whole :class:`Completion` once the text has ended, else None."""
        return self._row.completion() if self._row.finish_reason is not None else None


# ------------------------------------------------------------------------------ the calls
def complete_detailed(
    model: Llama,
    prompt: str | Sequence[str],
    **options: Any,
) -> list[Completion]:
    """The :class:`Completion` of each prompt (see :meth:`Llama.complete
    <mila_py.models.Llama.complete>` for the arguments), in the prompts' order."""
    who = f"{model._describe()}: complete()"
    tokenizer = _tokenizer(model, who, "complete()")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(f"{who}: prompt must be a str or a non-empty list of strs, got {prompt!r}")
    for p in prompts:
        if not isinstance(p, str):
            raise TypeError(f"{who}: prompt must be a str or a list of strs, got {p!r}")
    ids = [tokenizer.encode(p) for p in prompts]
    checked = _options(model, tokenizer, who, **options)
    return _run_waves(model, tokenizer, ids, checked, who)


def chat_detailed(
    model: Llama,
    messages: Sequence[Mapping[str, Any]],
    **options: Any,
) -> Completion:
    """The assistant's reply to ``messages`` as a :class:`Completion` (see :meth:`Llama.chat
    <mila_py.models.Llama.chat>`)."""
    who = f"{model._describe()}: chat()"
    tokenizer = _tokenizer(model, who, "chat()")
    ids = [_chat_ids(tokenizer, messages, who)]
    checked = _options(model, tokenizer, who, **options)
    return _run_waves(model, tokenizer, ids, checked, who)[0]


def stream_text(
    model: Llama,
    prompt: str | Sequence[Mapping[str, Any]],
    **options: Any,
) -> TextStream:
    """A :class:`TextStream` of one prompt (a str) or conversation (a list of messages),
    every argument checked before it is returned (see :meth:`Llama.stream_text
    <mila_py.models.Llama.stream_text>`)."""
    who = f"{model._describe()}: stream_text()"
    tokenizer = _tokenizer(model, who, "stream_text()")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        ids = _chat_ids(tokenizer, prompt, who)
    else:
        raise TypeError(
            f"{who}: prompt must be a str or a list of chat messages (dicts), got {prompt!r}"
        )
    checked = _options(model, tokenizer, who, **options)
    _check_lengths(model, [ids], who)
    return TextStream(_Wave(model, tokenizer, [ids], checked, checked.seed))


# ------------------------------------------------------------------------------ internals
def _tokenizer(model: Llama, who: str, what: str) -> TextTokenizer:
    model._require_inference(what)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise RuntimeError(
            f"{who} needs a tokenizer, and the model has none: load it with "
            "Llama.from_pretrained(folder) from a folder with a tokenizer.json, or set "
            "model.tokenizer = mila_py.interop.Tokenizer.from_pretrained(folder)"
        )
    return tokenizer


def _chat_ids(tokenizer: TextTokenizer, messages: Any, who: str) -> list[int]:
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise TypeError(
            f"{who}: messages must be a non-empty list of dicts with 'role' and 'content', "
            f"got {messages!r}"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids)


def _options(
    model: Llama,
    tokenizer: TextTokenizer,
    who: str,
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    **processors: Any,
) -> _Options:
    """The call's options (the keyword arguments of :meth:`Llama.complete
    <mila_py.models.Llama.complete>`) checked; the sampling ones again by ``model.stream``."""
    if max_new_tokens is None:
        defaults = getattr(model, "generation_defaults", None)
        given = getattr(defaults, "max_new_tokens", None)
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS if given is None else given
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"{who}: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"{who}: stop must be a str or a list of non-empty strs, got {stop!r}")
    ids = list(stop_token_ids or ())
    for i in ids:
        if not is_int(i):
            raise ValueError(f"{who}: stop_token_ids must be ints, got {stop_token_ids!r}")
    eos = defaults_of(model)["eos_token_id"]
    if eos is None:
        eos = tokenizer.eos_token_id
    ids += [] if eos is None else [eos] if is_int(eos) else list(eos)
    sampling = {
        name: value
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
        if value is not None
    }
    accepted = inspect.signature(model.stream).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for name, value in processors.items():
        if value is None:
            continue
        if not takes_any and name not in accepted:
            raise ValueError(
                f"{who}: {name}={value!r} is not a generation argument of this model "
                f"(Llama.stream takes {', '.join(accepted)})"
            )
        sampling[name] = value
    return _Options(int(max_new_tokens), stops, frozenset(int(i) for i in ids), seed, sampling)


def _check_lengths(model: Llama, prompts: list[list[int]], who: str) -> None:
    """Refuse an empty prompt or one longer than the context, before any work."""
    for n, ids in enumerate(prompts):
        if not 0 < len(ids) <= model.context_length:
            which = f"prompt {n}" if len(prompts) > 1 else "the prompt"
            raise ValueError(
                f"{who}: {which} has {len(ids)} tokens; the model's context holds 1 to "
                f"{model.context_length}"
            )


def _run_waves(
    model: Llama,
    tokenizer: TextTokenizer,
    prompts: list[list[int]],
    options: _Options,
    who: str,
) -> list[Completion]:
    """Every prompt's completion, ``batch_size`` prompts at a time."""
    _check_lengths(model, prompts, who)
    batch = model.build_context.input_shape[0]
    out: list[Completion] = []
    for start in range(0, len(prompts), batch):
        seed = _wave_seed(options.seed, start // batch)
        wave = _Wave(model, tokenizer, prompts[start : start + batch], options, seed)
        for _ in wave.run():
            pass
        out += [row.completion() for row in wave.rows]
    return out


def _wave_seed(seed: int | None, wave: int) -> int | None:
    """The seed of wave ``wave``: the caller's for the first (so one wave samples as
    ``model.stream(seed=seed)`` does), one derived from it for the others (so no two waves
    draw the same numbers)."""
    if seed is None or wave == 0 or not is_int(seed) or seed < 0:
        return seed  # (a bad seed is refused by model.stream)
    return int(np.random.SeedSequence([int(seed), wave]).generate_state(1)[0])
