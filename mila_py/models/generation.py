"""Generation: the loops behind :meth:`Llama.generate <mila_py.models.Llama.generate>` and
:meth:`Llama.stream <mila_py.models.Llama.stream>`, their argument checks, and sampling.

Functions of the model they run, which the Llama methods call: a prompt is prefilled once, then
each new token is decoded, greedy on the device or sampled on the host (:func:`sample`).
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from mila_py.components._layer import is_int

if TYPE_CHECKING:  # for annotations only: the network imports this module
    from mila_py.models.llama.network import Llama

__all__ = ["DEFAULT", "Default", "defaults_of", "generate", "sample", "stream", "with_defaults"]


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
) -> Iterator[np.ndarray]:
    """The token stream of :meth:`Llama.stream <mila_py.models.Llama.stream>` (see there):
    ``[B]`` new tokens per step, prefill once, then decode."""
    args = (max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, pad_token_id)
    return _start(model, prompt, *args, stacklevel=4)[2]


def _start(
    model: Llama, prompt: Any, *args: Any, stacklevel: int
) -> tuple[np.ndarray, np.ndarray, Iterator[np.ndarray], str]:
    """What :func:`stream` and :func:`generate` share: their arguments checked (``args``:
    those after the prompt, in :func:`stream`'s order), then ``(prompt rows, lengths, the
    token iterator, what the prompt came as)`` (see :func:`_prompt_rows`). ``stacklevel``: the
    caller's frame for the warning of a cut ``max_new_tokens``, counted from here."""
    model._require_inference("generate()")
    rows, lengths, kind = _prompt_rows(model, prompt)
    sampling = _sampling(model, *args)
    room = model.context_length - rows.shape[1] + 1
    if sampling[0] > room:
        warnings.warn(
            f"{model._describe()}: max_new_tokens={sampling[0]} cut to {room}: a prompt of "
            f"{rows.shape[1]} tokens leaves room for {room} in the context of "
            f"{model.context_length}",
            stacklevel=stacklevel,
        )
        sampling = (room, *sampling[1:])
    steps = _token_steps(model, rows, lengths, *sampling)
    return rows, lengths, steps, kind


def _token_steps(
    model: Llama,
    rows: np.ndarray,
    lengths: np.ndarray,
    steps: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng: np.random.Generator,
    stop: np.ndarray | None,
    pad: int,
) -> Iterator[np.ndarray]:
    """The generator behind :func:`stream`, of checked arguments. It holds the model's
    run lock from its first step to its end (a hold that a paused stream keeps, and that
    its ``finally`` gives back when it is closed or collected)."""
    hold = model._run_lock.hold()
    try:
        ctx = model.execution_context
        xp = ctx.xp
        n_b, n_t = rows.shape  # steps: cut to the context by _start
        finished = np.zeros(n_b, dtype=bool)
        logits = model.prefill(rows)
        position: Any = n_t
        if lengths.min() < n_t:  # each row's last prompt token again, at its own position
            last = lengths - 1
            logits = model.decode(rows[np.arange(n_b), last], last)
            position = lengths
        for step in range(steps):
            mine = model._cache_writes  # the cache as this stream left it
            if temperature == 0:
                # greedy: the argmax on the device, or -1 for a row with a NaN or inf
                # logit, so that one [B] readback brings the ids and the check
                with ctx.activate():
                    finite = xp.isfinite(logits).all(axis=-1)
                    token = ctx.to_host(xp.where(finite, logits.argmax(axis=-1), -1))
                _check_finite_logits(model, token >= 0, finished, step)
            else:
                host = ctx.to_host(logits)
                _check_finite_logits(model, np.isfinite(host).all(axis=-1), finished, step)
                token = sample(host, temperature, top_k, top_p, rng)
            if stop is not None:
                token = np.where(finished, pad, token)
                finished |= np.isin(token, stop)
            if step + 1 == steps or finished.all():
                hold.release()  # a stream that gave its last token holds nothing
                yield token
                return
            hold.pause()
            yield token
            hold.resume()
            if model._cache_writes != mine:
                raise RuntimeError(
                    f"{model._describe()}: another call wrote the KV cache while this stream "
                    "was paused (a prefill, decode, reset or another stream); its context is "
                    "gone: start a new stream"
                )
            logits = model.decode(token, position + step)
    finally:
        hold.release()


def _check_finite_logits(model: Llama, finite: np.ndarray, finished: np.ndarray, step: int) -> None:
    """Refuse to sample new token ``step`` from logits that hold NaN or inf: ``finite``
    ``[B]`` says which rows are finite; rows already ``finished`` (padded) do not count.

    Raises:
        FloatingPointError: naming the step and every sequence whose logits are not finite.
    """
    bad = np.flatnonzero(~finite & ~finished)
    if bad.size:
        which = "sequences" if bad.size > 1 else "sequence"
        rows = ", ".join(str(int(r)) for r in bad)
        raise FloatingPointError(
            f"{model._describe()}: NaN or inf in the logits of new token {step} (0-based) "
            f"for {which} {rows} (batch row); no token was sampled from them. The weights "
            "or the activations hold NaN or overflowed: check the checkpoint, or run in a "
            "wider precision"
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
) -> tuple[int, float, int | None, float | None, np.random.Generator, np.ndarray | None, int]:
    """The checked arguments of :func:`_token_steps` after the prompt."""
    if not is_int(max_new_tokens):
        raise TypeError(
            f"{model._describe()}: max_new_tokens must be an int, got {max_new_tokens!r}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"{model._describe()}: max_new_tokens must be >= 0")
    temperature = _real(model, temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"{model._describe()}: temperature must be finite and >= 0, got {temperature}"
        )
    if top_p is not None:
        top_p = _real(model, top_p, "top_p")
        if not 0 <= top_p <= 1:  # (NaN fails too)
            raise ValueError(f"{model._describe()}: top_p must be in [0, 1], got {top_p}")
    if top_k is not None and not is_int(top_k):
        raise TypeError(f"{model._describe()}: top_k must be an int or None, got {top_k!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"{model._describe()}: top_k must be >= 1, got {top_k}")
    if seed is not None and not is_int(seed):
        raise TypeError(f"{model._describe()}: seed must be an int or None, got {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"{model._describe()}: seed must be >= 0, got {seed}")
    stop, pad = _stop_tokens(model, eos_token_id, pad_token_id)
    rng = np.random.default_rng(seed)
    return max_new_tokens, temperature, top_k, top_p, rng, stop, pad


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
) -> np.ndarray | list[np.ndarray]:
    """The tokens of :meth:`Llama.generate <mila_py.models.Llama.generate>` (see there): the
    prompt followed by the new ones, on the host."""
    args = (max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, pad_token_id)
    rows, lengths, steps, kind = _start(model, prompt, *args, stacklevel=5)
    new = list(steps)
    tail = np.stack(new, axis=1) if new else rows[:, :0]
    if kind == "list":
        return [np.concatenate([r[:n], t]) for r, n, t in zip(rows, lengths, tail, strict=True)]
    out = np.concatenate([rows, tail], axis=1)
    return out if kind == "2d" else out[0]


def sample(
    logits: np.ndarray,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng: np.random.Generator,
) -> np.ndarray:
    """Next token per row of ``logits [B, V]``."""
    if temperature == 0:
        return logits.argmax(axis=-1)
    wide = logits.astype(np.float64)
    # shifted first: a tiny temperature then sends the others to -inf, never the top to inf
    with np.errstate(over="ignore"):  # -> -inf, which is what it means
        scaled = (wide - wide.max(axis=-1, keepdims=True)) / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -top_k, axis=-1)[:, -top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        order = np.argsort(-probs, axis=-1)
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        keep_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
        keep_sorted[:, 0] = True  # the most likely token always (top_p = 0: greedy)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs])
