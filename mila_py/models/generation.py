"""Generation: the loops behind :meth:`Llama.generate <mila_py.models.Llama.generate>` and
:meth:`Llama.stream <mila_py.models.Llama.stream>`, and their argument checks.

Functions of the model they run, which the Llama methods call: a prompt is prefilled once, then
each new token is chosen on the model's device (:func:`mila_py.models.sampling.sample_tokens`:
the penalties, then greedy or temperature, top-k, top-p and min-p, the draws' uniforms taken up
front from a seeded host generator) and decoded. A step of the loop writes the step's positions
(a few bytes to the device), feeds the sampled ids to the decode step's token buffer (a copy on
the device), runs the decode step (on a GPU the replay of its CUDA graph) and reads back one
``[B]`` array: the new ids, ``-1`` in a row whose logits hold NaN or inf.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from mila_py.components._layer import is_int
from mila_py.models import sampling
from mila_py.models.sampling import SamplingParams, TokenCounts, array_module, sample_tokens

if TYPE_CHECKING:  # for annotations only: the network imports this module
    from mila_py.models.llama.network import Llama

__all__ = ["DEFAULT", "Default", "defaults_of", "generate", "stream", "with_defaults"]


class Default(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "DEFAULT"

    def __repr__(self) -> str:
        return "DEFAULT"


#: an argument of ``Llama.generate``/``Llama.stream`` the caller did not pass: it takes the
#: model's generation defaults (see :func:`with_defaults`)
DEFAULT: Final = Default.DEFAULT


def defaults_of(model: Any) -> dict[str, Any]:
    """What :func:`with_defaults` fills in for ``model``: ``temperature``, ``top_k``, ``top_p``,
    ``eos_token_id`` and ``pad_token_id``.

    They come from ``model.generation_defaults`` where it is set (an object with a
    ``generate_kwargs()`` method, as :class:`mila_py.interop.GenerationDefaults` has: the
    checkpoint's ``generation_config.json``, which :meth:`Llama.from_pretrained` loads);
    otherwise greedy decoding (``temperature=0``), no top-k or top-p, and no EOS id.
    """
    values: dict[str, Any] = dict.fromkeys(("top_k", "top_p", "eos_token_id", "pad_token_id"))
    values["temperature"] = 0.0
    defaults = getattr(model, "generation_defaults", None)
    if defaults is not None:
        given = defaults.generate_kwargs()
        values.update({k: given[k] for k in values if k in given})
    return values


def with_defaults(
    model: Any, temperature: Any, top_k: Any, top_p: Any, eos_token_id: Any, pad_token_id: Any
) -> tuple[float, int | None, float | None, int | Sequence[int] | None, int | None]:
    """The arguments of ``Llama.generate``/``Llama.stream`` with each one left at
    :data:`DEFAULT` replaced by the model's default (:func:`defaults_of`); an argument the
    caller passed, ``None`` included, is kept as given."""
    fallback = defaults_of(model)
    given = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    t, k, p, eos, pad = (fallback[n] if v is DEFAULT else v for n, v in given.items())
    return t, k, p, eos, pad


def stream(
    model: Llama,
    prompt: Any,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> Iterator[np.ndarray]:
    """The token stream of :meth:`Llama.stream <mila_py.models.Llama.stream>` (see there):
    ``[B]`` new tokens per step, prefill once, then decode."""
    args = (max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, pad_token_id)
    penalties = (min_p, repetition_penalty, presence_penalty, frequency_penalty)
    return _start(model, prompt, *args, *penalties, stacklevel=4)[2]


def _start(
    model: Llama, prompt: Any, *args: Any, stacklevel: int
) -> tuple[np.ndarray, np.ndarray, Iterator[np.ndarray], str]:
    """What :func:`stream` and :func:`generate` share: their arguments checked (``args``:
    those after the prompt, in :func:`stream`'s order), then ``(prompt rows, lengths, the
    token iterator, what the prompt came as)`` (see :func:`_prompt_rows`). ``stacklevel``: the
    caller's frame for the warning of a cut ``max_new_tokens``, counted from here."""
    model._require_inference("generate()")
    rows, lengths, kind = _prompt_rows(model, prompt)
    steps, params, stop, pad = _sampling(model, *args)
    room = model.context_length - rows.shape[1] + 1
    if steps > room:
        warnings.warn(
            f"{model._describe()}: max_new_tokens={steps} cut to {room}: a prompt of "
            f"{rows.shape[1]} tokens leaves room for {room} in the context of "
            f"{model.context_length}",
            stacklevel=stacklevel,
        )
        steps = room
    tokens = _token_steps(model, rows, lengths, steps, params, stop, pad)
    return rows, lengths, tokens, kind


def _token_steps(
    model: Llama,
    rows: np.ndarray,
    lengths: np.ndarray,
    steps: int,
    params: SamplingParams,
    stop: np.ndarray | None,
    pad: int,
) -> Iterator[np.ndarray]:
    """The generator behind :func:`stream`, of checked arguments (``steps`` cut to the
    context by :func:`_start`). It holds the model's run lock from its first step to its end
    (a hold that a paused stream keeps, and that its ``finally`` gives back when it is closed
    or collected)."""
    hold = model._run_lock.hold()
    try:
        ctx = model.execution_context
        n_b, n_t = rows.shape
        finished = np.zeros(n_b, dtype=bool)  # the host's copy of `done`
        with ctx.activate():
            logits = model.prefill(rows)
            position: Any = n_t
            if lengths.min() < n_t:  # each row's last prompt token again, at its own position
                last = lengths - 1
                logits = model._decode_ids(rows[np.arange(n_b), last], last)[:, 0]
                position = lengths
            xp = array_module(logits)
            counts = None
            if params.uses_counts:  # the penalties' state: the prompts' tokens, on the device
                counts = TokenCounts.from_prompt(
                    rows, model.config.vocab_size, lengths=lengths, xp=xp
                )
            # every step's uniforms in one copy: row s is what the s-th draw of the seeded
            # generator gives
            uniforms = None
            if not params.greedy:
                uniforms = xp.asarray(params.make_rng().random((steps, n_b)))
            stop_d = None if stop is None else xp.asarray(stop)
            done = xp.zeros(n_b, dtype=bool)  # rows that emitted an EOS, on the device
        for step in range(steps):
            mine = model._cache_writes  # the cache as this stream left it
            with ctx.activate():
                drawn = None if uniforms is None else uniforms[step]
                token = sample_tokens(logits, params, drawn, counts)
                # -1 in a row of logits that are not all finite (the sampler takes -inf for a
                # masked token; from the model it is an overflow)
                token = xp.where(xp.isfinite(logits).all(axis=-1), token, -1)
                if stop_d is not None:
                    token = xp.where(done, pad, token)
                if counts is not None:
                    counts.update(token, ~done)
                if stop_d is not None:
                    done |= (token[:, None] == stop_d[None, :]).any(axis=1)
                host = ctx.to_host(token)  # the step's one readback: its ids and the check
            _check_finite_logits(model, host >= 0, finished, step, counts is not None)
            if stop is not None:
                finished |= np.isin(host, stop)
            if step + 1 == steps or finished.all():
                hold.release()  # a stream that gave its last token holds nothing
                yield host
                return
            hold.pause()
            yield host
            hold.resume()
            if model._cache_writes != mine:
                raise RuntimeError(
                    f"{model._describe()}: another call wrote the KV cache while this stream "
                    "was paused (a prefill, decode, reset or another stream); its context is "
                    "gone: start a new stream"
                )
            with ctx.activate():  # the sampled ids stay on the device: no check needed
                logits = model._decode_ids(token, position + step)[:, 0]
    finally:
        hold.release()


def _check_finite_logits(
    model: Llama, finite: np.ndarray, finished: np.ndarray, step: int, penalized: bool = False
) -> None:
    """Refuse new token ``step`` where it could not be sampled: ``finite`` ``[B]`` says which
    rows were sampled (the others' logits hold NaN or inf, or with ``penalized`` the
    penalties may have sent every logit to -inf); rows already ``finished`` (padded) do not
    count.

    Raises:
        FloatingPointError: naming the step and every sequence whose logits are not finite.
    """
    bad = np.flatnonzero(~finite & ~finished)
    if bad.size:
        which = "sequences" if bad.size > 1 else "sequence"
        rows = ", ".join(str(int(r)) for r in bad)
        also = " (or the penalties sent every logit to -inf: use smaller ones)" if penalized else ""
        raise FloatingPointError(
            f"{model._describe()}: NaN or inf in the logits of new token {step} (0-based) "
            f"for {which} {rows} (batch row){also}; no token was sampled from them. The "
            "weights or the activations hold NaN or overflowed: check the checkpoint, or run "
            "in a wider precision"
        )


def _prompt_rows(model: Llama, prompt: Any) -> tuple[np.ndarray, np.ndarray, str]:
    """``prompt`` as host rows ``[B, T]`` (a list's prompts right-padded with token 0), the
    length of each row's prompt ``[B]``, and what it came as: ``"1d"``, ``"2d"`` or
    ``"list"``."""
    to_host = model.execution_context.to_host
    if isinstance(prompt, list | tuple) and prompt and all(np.ndim(p) >= 1 for p in prompt):
        seqs = [np.asarray(to_host(p)) for p in prompt]
        if any(r.ndim != 1 or r.size == 0 or r.dtype.kind not in "iu" for r in seqs):
            raise ValueError(
                f"{model._describe()}: a list of prompts must hold non-empty 1-D integer "
                f"token sequences, got {[f'{r.dtype}{list(r.shape)}' for r in seqs]}"
            )
        lengths = np.array([r.size for r in seqs])
        rows = np.zeros((len(seqs), int(lengths.max())), dtype=np.int64)
        for row, r in zip(rows, seqs, strict=True):
            row[: r.size] = r
        _check_prompt_rows(model, rows)
        return rows, lengths, "list"
    try:
        tokens = np.asarray(to_host(prompt))
    except ValueError:  # nested lists of different lengths
        tokens = np.asarray(None)
    if tokens.ndim not in (1, 2) or tokens.size == 0 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"{model._describe()}: prompt must be non-empty integer tokens [T] or [B, T], or a "
            f"list of [T_b] sequences, got {tokens.dtype} of shape {tokens.shape}"
        )
    rows = tokens[None] if tokens.ndim == 1 else tokens
    _check_prompt_rows(model, rows)
    return rows, np.full(rows.shape[0], rows.shape[1]), f"{tokens.ndim}d"


def _check_prompt_rows(model: Llama, rows: np.ndarray) -> None:
    """Refuse prompt rows ``[B, T]`` that the build cannot take, before any work."""
    n_b, n_t = rows.shape
    build_b = model.build_context.input_shape[0]
    if n_b > build_b or n_t > model.context_length:
        raise ValueError(
            f"{model._describe()}: {n_b} prompts of up to {n_t} tokens do not fit the build "
            f"({build_b} sequences, context {model.context_length})"
        )
    low, high = int(rows.min()), int(rows.max())
    if low < 0 or high >= model.config.vocab_size:
        raise ValueError(
            f"{model._describe()}: prompt token ids must be in [0, {model.config.vocab_size}), "
            f"got {low}..{high}"
        )


def _sampling(
    model: Llama,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    eos_token_id: Any,
    pad_token_id: Any,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> tuple[int, SamplingParams, np.ndarray | None, int]:
    """The checked arguments of :func:`_token_steps` after the prompt: ``(max_new_tokens,
    the sampling parameters, the EOS ids or None, the pad id)``."""
    who = model._describe()
    if not is_int(max_new_tokens):
        raise TypeError(f"{who}: max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"{who}: max_new_tokens must be >= 0")
    temperature = _real(model, temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{who}: temperature must be finite and >= 0, got {temperature}")
    if top_p is not None:
        top_p = _real(model, top_p, "top_p")
        if not 0 <= top_p <= 1:  # (NaN fails too)
            raise ValueError(f"{who}: top_p must be in [0, 1], got {top_p}")
    if top_k is not None and not is_int(top_k):
        raise TypeError(f"{who}: top_k must be an int or None, got {top_k!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"{who}: top_k must be >= 1, got {top_k}")
    if seed is not None and not is_int(seed):
        raise TypeError(f"{who}: seed must be an int or None, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"{who}: seed must be >= 0, got {seed}")
    min_p = 0.0 if min_p is None else sampling._check_min_p(who, min_p)
    repetition_penalty = sampling._check_repetition_penalty(who, repetition_penalty)
    presence_penalty = sampling._check_penalty(who, "presence_penalty", presence_penalty)
    frequency_penalty = sampling._check_penalty(who, "frequency_penalty", frequency_penalty)
    stop, pad = _stop_tokens(model, eos_token_id, pad_token_id)
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        # top_p = 0 keeps the most likely token alone, as any top_p below every probability
        # (the nucleus filter keeps at least one token)
        top_p=_TINY_TOP_P if top_p == 0 else 1.0 if top_p is None else top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        seed=None if seed is None else int(seed),
    )
    return int(max_new_tokens), params, stop, pad


#: the top_p of ``top_p=0``: below every float32 probability of a token kept after the softmax
_TINY_TOP_P = 1e-45


def _real(model: Llama, value: Any, name: str) -> float:
    """``value`` as a float: ints, floats, NumPy scalars and 0-d arrays (not bools, strings
    or complex numbers)."""
    try:
        if isinstance(value, bool | str | bytes) or np.iscomplexobj(value):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{model._describe()}: {name} must be a real number, got {value!r}"
        ) from None


def _stop_tokens(
    model: Llama, eos_token_id: Any, pad_token_id: Any
) -> tuple[np.ndarray | None, int]:
    """The EOS ids as an array (None: no stopping) and the id that pads finished rows."""
    vocab = model.config.vocab_size

    def token_id(value: Any, what: str) -> int:
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]  # a 0-d array: its scalar
        if not is_int(value):
            raise TypeError(f"{model._describe()}: {what} must be int ids, got {value!r}")
        if not 0 <= value < vocab:
            raise ValueError(
                f"{model._describe()}: {what} {value} is outside the vocabulary [0, {vocab})"
            )
        return int(value)

    pad = None if pad_token_id is None else token_id(pad_token_id, "pad_token_id")
    if eos_token_id is None:
        return None, 0  # nothing finishes: no row is padded
    ids = [eos_token_id] if np.ndim(eos_token_id) == 0 else list(eos_token_id)
    if not ids:
        raise ValueError(f"{model._describe()}: eos_token_id is an empty list")
    stop = np.array([token_id(i, "eos_token_id") for i in ids])
    return stop, int(stop[0]) if pad is None else pad


def generate(
    model: Llama,
    prompt: Any,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> np.ndarray | list[np.ndarray]:
    """The tokens of :meth:`Llama.generate <mila_py.models.Llama.generate>` (see there): the
    prompt followed by the new ones, on the host."""
    args = (max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, pad_token_id)
    penalties = (min_p, repetition_penalty, presence_penalty, frequency_penalty)
    rows, lengths, steps, kind = _start(model, prompt, *args, *penalties, stacklevel=5)
    new = list(steps)
    tail = np.stack(new, axis=1) if new else rows[:, :0]
    if kind == "list":
        return [np.concatenate([r[:n], t]) for r, n, t in zip(rows, lengths, tail, strict=True)]
    out = np.concatenate([rows, tail], axis=1)
    return out if kind == "2d" else out[0]
