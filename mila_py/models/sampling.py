"""Choosing the next token on the model's device: sampling parameters, logits processors, draws.

Every function here takes the logits ``[B, V]`` where the model left them (NumPy on the CPU,
CuPy on a GPU) and returns arrays on the same device: the array code is written against the
input's array module (:func:`array_module`), with calls that NumPy and CuPy both have.

The processors match transformers' ``LogitsProcessor`` of the same name on the same logits
(``apply_top_k`` is ``TopKLogitsWarper``, ...), and :func:`process_logits` chains them in the
order transformers' ``generate`` does: repetition penalty, presence/frequency penalties (OpenAI's,
which transformers lacks; vLLM applies them there too), then, when sampling, temperature, top-k,
top-p and min-p.

Randomness: :func:`sample` takes one uniform in ``[0, 1)`` per row from a NumPy
``Generator`` on the host (``params.make_rng()``: ``numpy.random.default_rng(seed)``) and copies
those ``[B]`` floats to the device, where each row's token is found by inverse CDF. So a seed
gives the same tokens on the CPU and on a GPU, whatever CuPy's version (``cupy.random`` does not
promise the same stream across major versions), and a decode step captured as a CUDA graph can
read its uniforms from a device buffer filled before the replay (:func:`sample_tokens`):
``rng.random((steps, B))`` drawn up front gives row ``s`` the uniforms that the ``s``-th
:func:`sample` call would draw.

Penalties keep their state in :class:`TokenCounts`, fixed ``[B, V]`` buffers on the device
updated in place with each step's tokens, so no token history goes back to the host.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "SamplingParams",
    "SamplingTypeError",
    "TokenCounts",
    "apply_min_p",
    "apply_presence_frequency",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "array_module",
    "process_logits",
    "sample",
    "sample_tokens",
]

#: OpenAI's range for ``presence_penalty`` and ``frequency_penalty`` (vLLM checks the same)
PENALTY_RANGE = (-2.0, 2.0)

_NEG_INF = np.float32(-np.inf)
#: the smallest normal float32: the temperature of a draw whose temperature rounds to 0 there
_TINIEST = float(np.finfo(np.float32).tiny)


class SamplingTypeError(TypeError, ValueError):
    """A sampling parameter of the wrong type. It is a ``TypeError``, and a ``ValueError`` too,
    so that one ``except ValueError`` turns every invalid request into an HTTP 400 (as NumPy's
    ``AxisError`` is both a ``ValueError`` and an ``IndexError``)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def _real(who: str, name: str, value: Any, allowed: str) -> float:
    if not _is_real(value):
        raise SamplingTypeError(f"{who}: {name} must be a real number, {allowed}, got {value!r}")
    return float(value)


def _check_temperature(who: str, value: Any, *, zero_ok: bool) -> float:
    allowed = "finite and >= 0 (0 = greedy)" if zero_ok else "finite and > 0"
    t = _real(who, "temperature", value, allowed)
    if not (math.isfinite(t) and (t > 0 or (zero_ok and t == 0))):
        raise ValueError(f"{who}: temperature must be {allowed}, got {value!r}")
    return t


def _check_top_k(who: str, value: Any, *, off_ok: bool) -> int | None:
    allowed = "None or an int >= 0 (None or 0 = off)" if off_ok else "an int >= 1"
    if value is None and off_ok:
        return None
    if not _is_int(value):
        raise SamplingTypeError(f"{who}: top_k must be {allowed}, got {value!r}")
    if value < (0 if off_ok else 1):
        raise ValueError(f"{who}: top_k must be {allowed}, got {value!r}")
    return int(value)


def _check_top_p(who: str, value: Any) -> float:
    allowed = "in (0, 1] (1 = off)"
    p = _real(who, "top_p", value, allowed)
    if not 0 < p <= 1:  # NaN fails too
        raise ValueError(f"{who}: top_p must be {allowed}, got {value!r}")
    return p


def _check_min_p(who: str, value: Any) -> float:
    allowed = "in [0, 1] (0 = off)"
    p = _real(who, "min_p", value, allowed)
    if not 0 <= p <= 1:
        raise ValueError(f"{who}: min_p must be {allowed}, got {value!r}")
    return p


def _check_repetition_penalty(who: str, value: Any) -> float:
    allowed = "finite and > 0 (1 = off)"
    p = _real(who, "repetition_penalty", value, allowed)
    if not (math.isfinite(p) and p > 0):
        raise ValueError(f"{who}: repetition_penalty must be {allowed}, got {value!r}")
    return p


def _check_penalty(who: str, name: str, value: Any) -> float:
    lo, hi = PENALTY_RANGE
    allowed = f"in [{lo}, {hi}] (0 = off)"
    p = _real(who, name, value, allowed)
    if not lo <= p <= hi:
        raise ValueError(f"{who}: {name} must be {allowed}, got {value!r}")
    return p


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each new token, and when to stop; checked on construction.

    Attributes:
        temperature: divides the logits before sampling; ``0`` is greedy (argmax after the
            penalties; the top-k/top-p/min-p filters are then unused, as in transformers).
        top_k: keep the ``top_k`` largest logits (and any tied with the ``top_k``-th);
            ``None`` or ``0`` is off.
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``
            (nucleus sampling); ``1.0`` is off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's;
            ``0.0`` is off.
        repetition_penalty: transformers' multiplicative penalty over the tokens present in the
            prompt or generated so far: a positive logit is divided by it, a negative one
            multiplied; ``1.0`` is off, above 1 discourages repeats.
        presence_penalty: OpenAI's additive penalty, subtracted once from the logit of every
            token generated so far (the prompt does not count); in ``[-2, 2]``, ``0`` is off.
        frequency_penalty: OpenAI's additive penalty, subtracted once per time a token was
            generated so far; in ``[-2, 2]``, ``0`` is off.
        seed: seeds the generator of :meth:`make_rng`; ``None`` draws fresh entropy.
        max_new_tokens: at most this many new tokens per sequence (``>= 0``).
        stop_token_ids: a sequence that emits one of these ids is finished.
        stop: strings that finish a sequence when its text contains one (the caller checks
            them on the decoded text). A single string is taken as a tuple of one.

    Lists given for the tuple fields are stored as tuples, and NumPy scalars as Python numbers.

    Raises:
        ValueError: a value out of range, naming the field, the value and the allowed range.
        SamplingTypeError: a value of the wrong type (a ``TypeError`` and a ``ValueError``).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, list | tuple):
                value = tuple(int(v) if _is_int(v) else v for v in value)
            elif name == "stop" and isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, value)
        self.validate()

    def validate(self) -> None:
        """Check every field (called on construction).

        Raises:
            ValueError: naming the field, the value received and the allowed range.
            SamplingTypeError: a field of the wrong type.
        """
        who = "SamplingParams"
        checked = {
            "temperature": _check_temperature(who, self.temperature, zero_ok=True),
            "top_k": _check_top_k(who, self.top_k, off_ok=True),
            "top_p": _check_top_p(who, self.top_p),
            "min_p": _check_min_p(who, self.min_p),
            "repetition_penalty": _check_repetition_penalty(who, self.repetition_penalty),
            "presence_penalty": _check_penalty(who, "presence_penalty", self.presence_penalty),
            "frequency_penalty": _check_penalty(who, "frequency_penalty", self.frequency_penalty),
        }
        for name in ("seed", "max_new_tokens"):
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            allowed = "None or an int >= 0" if name == "seed" else "an int >= 0"
            if not _is_int(value):
                raise SamplingTypeError(f"{who}: {name} must be {allowed}, got {value!r}")
            if value < 0:
                raise ValueError(f"{who}: {name} must be {allowed}, got {value!r}")
            checked[name] = int(value)
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) for t in self.stop_token_ids
        ):
            raise SamplingTypeError(
                f"{who}: stop_token_ids must be a tuple of ints >= 0, got {self.stop_token_ids!r}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"{who}: stop_token_ids must be a tuple of ints >= 0, got {self.stop_token_ids!r}"
            )
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingTypeError(
                f"{who}: stop must be a tuple of non-empty strings, got {self.stop!r}"
            )
        if not all(self.stop):
            raise ValueError(f"{who}: stop must be a tuple of non-empty strings, got {self.stop!r}")
        for name, value in checked.items():  # NumPy scalars and ints stored as Python numbers
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """True when ``temperature == 0``: each token is the argmax after the penalties."""
        return self.temperature == 0

    @property
    def uses_counts(self) -> bool:
        """True when a penalty is on, so that :func:`sample` needs a :class:`TokenCounts`."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def make_rng(self) -> np.random.Generator:
        """A host generator for :func:`sample`: ``numpy.random.default_rng(seed)``."""
        return np.random.default_rng(self.seed)


def array_module(array: Any) -> ModuleType:
    """The array module of ``array``: ``numpy`` or ``cupy`` (imported only for a CuPy array).

    Raises:
        TypeError: ``array`` is neither a NumPy nor a CuPy array.
    """
    if isinstance(array, np.ndarray):
        return np
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    raise TypeError(
        f"expected a numpy.ndarray or cupy.ndarray, got {type(array).__module__}."
        f"{type(array).__name__}"
    )


def _check_logits(who: str, logits: Any) -> ModuleType:
    """The array module of ``logits``, once they are a floating ``[B, V]`` array with V >= 1."""
    try:
        xp = array_module(logits)
    except TypeError as error:
        raise TypeError(f"{who}: logits: {error}") from None
    if logits.ndim != 2 or logits.shape[1] < 1 or logits.dtype.kind != "f":
        raise ValueError(
            f"{who}: logits must be a floating [B, V] array with V >= 1, got "
            f"{logits.dtype}{list(logits.shape)}"
        )
    return xp


def _check_table(who: str, name: str, table: Any, logits: Any, xp: ModuleType) -> None:
    """``table`` must be a ``[B, V]`` array of the logits' shape and device."""
    if not isinstance(table, xp.ndarray) or table.shape != logits.shape:
        got = getattr(table, "shape", None)
        raise ValueError(
            f"{who}: {name} must be a {xp.__name__} array of the logits' shape "
            f"{list(logits.shape)}, got {type(table).__name__} of shape {got}"
        )


def _softmax(x: Any, xp: ModuleType) -> Any:
    """Row softmax of ``x [B, N]`` in its own dtype, as ``torch.softmax`` computes it."""
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _argsort_stable(x: Any, xp: ModuleType) -> Any:
    """Ascending indices along the last axis, ties in index order. CuPy's sort is always
    stable (and takes no ``kind``); NumPy's default is not."""
    if xp is np:
        return np.argsort(x, axis=-1, kind="stable")
    return xp.argsort(x, axis=-1)


def _quiet() -> Any:
    """NumPy's warnings off where transformers returns inf or NaN silently (an overflowed
    division, the softmax of a row of -inf); CuPy does not warn."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore")


def apply_temperature(logits: Any, temperature: float) -> Any:
    """``logits / temperature`` (transformers' ``TemperatureLogitsWarper``).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        temperature: finite and > 0.

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_temperature"
    _check_logits(who, logits)
    t = _check_temperature(who, temperature, zero_ok=False)
    # a GPU's kernels flush a subnormal operand to zero (1e-38 in float32), which would send
    # every positive logit to +inf: divide by the smallest normal number instead, the same
    # limit (only the largest logits overflow)
    t = max(t, float(np.finfo(logits.dtype).tiny))
    with _quiet():
        return logits / logits.dtype.type(t)


def apply_top_k(logits: Any, top_k: int) -> Any:
    """Logits below the ``top_k``-th largest set to ``-inf`` (transformers' ``TopKLogitsWarper``:
    values tied with the ``top_k``-th stay).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        top_k: an int >= 1; ``top_k >= V`` keeps every logit.

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_top_k"
    xp = _check_logits(who, logits)
    n_v = logits.shape[1]
    k = min(int(_check_top_k(who, top_k, off_ok=False) or 0), n_v)  # (never None here)
    kth = xp.partition(logits, n_v - k, axis=-1)[:, n_v - k : n_v - k + 1]  # [B, 1]
    return xp.where(logits < kth, logits.dtype.type(-np.inf), logits)


def apply_top_p(logits: Any, top_p: float) -> Any:
    """Nucleus filtering (transformers' ``TopPLogitsWarper``, ``min_tokens_to_keep=1``): with
    the logits sorted ascending (ties in index order), the tokens whose cumulative probability
    is at most ``1 - top_p`` are set to ``-inf``; the most likely token always stays.

    Args:
        logits: ``[B, V]`` floating, unchanged.
        top_p: in (0, 1].

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_top_p"
    xp = _check_logits(who, logits)
    p = _check_top_p(who, top_p)
    n_b = logits.shape[0]
    with _quiet():
        order = _argsort_stable(logits, xp)  # [B, V]
        ascending = xp.take_along_axis(logits, order, axis=-1)
        # summed in float64 and stored in the logits' dtype, as torch's cumsum does on the CPU
        cum = xp.cumsum(_softmax(ascending, xp), axis=-1, dtype=xp.float64).astype(logits.dtype)
        drop_sorted = cum <= logits.dtype.type(1 - p)
        drop_sorted[:, -1] = False
        drop = xp.empty(logits.shape, dtype=xp.bool_)
        drop[xp.arange(n_b)[:, None], order] = drop_sorted
    return xp.where(drop, logits.dtype.type(-np.inf), logits)


def apply_min_p(logits: Any, min_p: float) -> Any:
    """Tokens less likely than ``min_p`` times the most likely one set to ``-inf``
    (transformers' ``MinPLogitsWarper``, ``min_tokens_to_keep=1``).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        min_p: in [0, 1].

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_min_p"
    xp = _check_logits(who, logits)
    p = _check_min_p(who, min_p)
    n_b = logits.shape[0]
    with _quiet():
        probs = _softmax(logits, xp)
        drop = probs < logits.dtype.type(p) * probs.max(axis=-1, keepdims=True)
        drop[xp.arange(n_b), probs.argmax(axis=-1)] = False
    return xp.where(drop, logits.dtype.type(-np.inf), logits)


def apply_repetition_penalty(
    logits: Any, penalty: float, *, token_ids: Any = None, counts: Any = None
) -> Any:
    """transformers' ``RepetitionPenaltyLogitsProcessor``: the logit of each token present in a
    row is divided by ``penalty`` when positive, multiplied by it when negative.

    Give the tokens present as exactly one of:

    - ``token_ids``: ``[B, L]`` ints (the prompt and the tokens generated so far); ids outside
      ``[0, V)`` are ignored (padding such as ``-1``, or ids of an embedding table larger than
      the head, which transformers ignores too);
    - ``counts``: ``[B, V]``, nonzero where a token is present (``TokenCounts.seen``, or counts).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        penalty: finite and > 0.

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_repetition_penalty"
    xp = _check_logits(who, logits)
    p = logits.dtype.type(_check_repetition_penalty(who, penalty))
    if (token_ids is None) == (counts is None):
        raise ValueError(f"{who}: give exactly one of token_ids [B, L] and counts [B, V]")
    n_b, n_v = logits.shape
    if counts is not None:
        _check_table(who, "counts", counts, logits, xp)
        present = counts != 0
    else:
        if (
            not isinstance(token_ids, xp.ndarray)
            or token_ids.ndim != 2
            or token_ids.shape[0] != n_b
            or token_ids.dtype.kind not in "iu"
        ):
            raise ValueError(
                f"{who}: token_ids must be a {xp.__name__} int array [B={n_b}, L], got "
                f"{type(token_ids).__name__} {getattr(token_ids, 'dtype', '')}"
                f"{list(getattr(token_ids, 'shape', ()))}"
            )
        ids = token_ids.astype(xp.int64)
        # ids outside the vocabulary land in one extra column, dropped after the scatter
        ids = xp.where((ids >= 0) & (ids < n_v), ids, n_v)
        present = xp.zeros((n_b, n_v + 1), dtype=xp.bool_)
        present[xp.arange(n_b)[:, None], ids] = True
        present = present[:, :n_v]
    with _quiet():
        penalized = xp.where(logits < 0, logits * p, logits / p)
    return xp.where(present, penalized, logits)


def apply_presence_frequency(logits: Any, presence: float, frequency: float, counts: Any) -> Any:
    """OpenAI's penalties: ``logits - presence * (count > 0) - frequency * count``, with
    ``count`` how often each token was generated so far in the row (the prompt does not count,
    as in vLLM).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        presence: in [-2, 2].
        frequency: in [-2, 2].
        counts: ``[B, V]`` ints, the generated tokens' counts (``TokenCounts.generated``).

    Returns:
        ``[B, V]`` new array, same dtype and device.
    """
    who = "apply_presence_frequency"
    xp = _check_logits(who, logits)
    f_type = logits.dtype.type
    pres = f_type(_check_penalty(who, "presence_penalty", presence))
    freq = f_type(_check_penalty(who, "frequency_penalty", frequency))
    _check_table(who, "counts", counts, logits, xp)
    if counts.dtype.kind not in "iu":
        raise ValueError(f"{who}: counts must be integers, got {counts.dtype}")
    with _quiet():
        penalty = freq * counts.astype(logits.dtype) + pres * (counts > 0).astype(logits.dtype)
        return logits - penalty


def _move(array: Any, xp: ModuleType) -> Any:
    """``array`` (NumPy, CuPy or a list) in ``xp``'s memory; a CuPy array goes to the host
    with ``get()`` (NumPy cannot take it implicitly)."""
    if xp is np and not isinstance(array, np.ndarray) and callable(getattr(array, "get", None)):
        return array.get()
    return xp.asarray(array)


class TokenCounts:
    """The penalties' state: which tokens each row has seen, and how often it generated each.

    Two fixed ``[B, V]`` buffers on the logits' device, updated in place by :meth:`update`
    with each step's tokens (so a decode step captured as a CUDA graph reads and writes the
    same memory, and no token history goes back to the host):

    - ``seen``: bool, the tokens of the prompt or generated so far (the repetition penalty);
    - ``generated``: int32, how often each token was generated (presence and frequency
      penalties, which do not count the prompt).

    Args:
        batch: B, the rows.
        vocab_size: V, the logits' width.
        xp: the array module the buffers live in (``numpy`` or ``cupy``), as the logits'.
    """

    def __init__(self, batch: int, vocab_size: int, *, xp: ModuleType = np) -> None:
        if not _is_int(batch) or batch < 0 or not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(
                f"TokenCounts: batch must be an int >= 0 and vocab_size an int >= 1, got "
                f"batch={batch!r}, vocab_size={vocab_size!r}"
            )
        self.xp = xp
        self.seen = xp.zeros((int(batch), int(vocab_size)), dtype=xp.bool_)
        self.generated = xp.zeros((int(batch), int(vocab_size)), dtype=xp.int32)

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, V)``."""
        return self.seen.shape

    @property
    def nbytes(self) -> int:
        """Bytes the two buffers hold on their device."""
        return int(self.seen.nbytes + self.generated.nbytes)

    @classmethod
    def from_prompt(
        cls, prompt: Any, vocab_size: int, *, lengths: Any = None, xp: ModuleType | None = None
    ) -> TokenCounts:
        """Counts whose ``seen`` holds each row's prompt tokens (and nothing generated yet).

        Args:
            prompt: ``[B, T]`` ints (NumPy or CuPy), or a list of B 1-D int sequences; ids
                outside ``[0, V)`` are ignored.
            vocab_size: V.
            lengths: ``[B]`` ints: only the first ``lengths[b]`` tokens of row ``b`` are its
                prompt (a right-padded ``[B, T]``); ``None``: every token.
            xp: where the buffers go; default: the prompt's array module (NumPy for a list).

        Raises:
            ValueError: a prompt or lengths of the wrong shape or kind.
        """
        who = "TokenCounts.from_prompt"
        if isinstance(prompt, list | tuple):
            rows = [np.asarray(p) for p in prompt]
            if any(r.ndim != 1 or (r.size and r.dtype.kind not in "iu") for r in rows):
                raise ValueError(f"{who}: a list prompt must hold 1-D int sequences")
            if lengths is not None:
                raise ValueError(f"{who}: lengths goes with a [B, T] prompt, not a list")
            lengths = np.array([r.size for r in rows], dtype=np.int64)
            padded = np.full((len(rows), max([r.size for r in rows], default=0)), -1, np.int64)
            for out, r in zip(padded, rows, strict=True):
                out[: r.size] = r
            prompt = padded
            xp = np if xp is None else xp
        else:
            module = array_module(prompt)
            xp = module if xp is None else xp
            if prompt.ndim != 2 or prompt.dtype.kind not in "iu":
                raise ValueError(
                    f"{who}: prompt must be a [B, T] int array, got {prompt.dtype}"
                    f"{list(prompt.shape)}"
                )
        counts = cls(prompt.shape[0], vocab_size, xp=xp)
        ids = _move(prompt, xp).astype(xp.int64)
        n_b, n_t = ids.shape
        if lengths is not None:
            lengths = _move(lengths, xp)
            if lengths.shape != (n_b,) or lengths.dtype.kind not in "iu":
                raise ValueError(
                    f"{who}: lengths must be [B={n_b}] ints, got {lengths.dtype}"
                    f"{list(lengths.shape)}"
                )
            ids = xp.where(xp.arange(n_t)[None, :] < lengths[:, None], ids, -1)
        n_v = counts.shape[1]
        ids = xp.where((ids >= 0) & (ids < n_v), ids, n_v)
        seen = xp.zeros((n_b, n_v + 1), dtype=xp.bool_)
        seen[xp.arange(n_b)[:, None], ids] = True
        counts.seen[...] = seen[:, :n_v]
        return counts

    def update(self, tokens: Any, active: Any = None) -> None:
        """Count one new token per row, in place.

        Args:
            tokens: ``[B]`` ints on the buffers' device; ids outside ``[0, V)`` (such as the
                ``-1`` of :func:`sample_tokens`) count nothing.
            active: ``[B]`` bool, or ``None`` for every row: rows where False (finished
                sequences, padded) count nothing.
        """
        xp = self.xp
        n_b, n_v = self.shape
        if (
            not isinstance(tokens, xp.ndarray)
            or tokens.shape != (n_b,)
            or tokens.dtype.kind not in "iu"
        ):
            raise ValueError(
                f"TokenCounts.update: tokens must be a {xp.__name__} int array [B={n_b}], got "
                f"{type(tokens).__name__} {getattr(tokens, 'dtype', '')} of shape "
                f"{getattr(tokens, 'shape', None)}"
            )
        ok = (tokens >= 0) & (tokens < n_v)
        if active is not None:
            if not isinstance(active, xp.ndarray) or active.shape != (n_b,):
                raise ValueError(
                    f"TokenCounts.update: active must be a {xp.__name__} bool array [B={n_b}], "
                    f"got shape {getattr(active, 'shape', None)}"
                )
            ok &= active.astype(xp.bool_)
        rows = xp.arange(n_b)
        ids = xp.where(ok, tokens, 0)
        # one index per row, so the fancy-indexed read-modify-write has no repeated index
        self.generated[rows, ids] += ok.astype(xp.int32)
        self.seen[rows, ids] |= ok

    def reset(self) -> None:
        """Zero both buffers in place (a new set of sequences in the same batch slots)."""
        self.seen.fill(False)
        self.generated.fill(0)


def _check_counts(who: str, counts: Any, logits: Any, xp: ModuleType) -> None:
    if not isinstance(counts, TokenCounts):
        raise TypeError(f"{who}: counts must be a TokenCounts, got {type(counts).__name__}")
    if counts.shape != logits.shape or counts.xp is not xp:
        raise ValueError(
            f"{who}: counts are {counts.xp.__name__} {list(counts.shape)}, the logits "
            f"{xp.__name__} {list(logits.shape)}: they must match"
        )


def process_logits(logits: Any, params: SamplingParams, counts: TokenCounts | None = None) -> Any:
    """The logits :func:`sample` draws from: the processors ``params`` turns on, in the order of
    transformers' ``generate`` (repetition penalty; presence and frequency penalties; then,
    unless greedy, temperature, top-k, top-p, min-p).

    Args:
        logits: ``[B, V]`` floating, unchanged.
        params: the sampling parameters.
        counts: the penalties' state, needed when a penalty is on.

    Returns:
        ``[B, V]`` (a new array, or ``logits`` itself when no processor is on).

    Raises:
        ValueError: a penalty is on and ``counts`` is missing or does not match the logits.
    """
    who = "process_logits"
    xp = _check_logits(who, logits)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{who}: params must be a SamplingParams, got {type(params).__name__}")
    x = _penalized(logits, params, counts, xp)
    if params.greedy:
        return x
    return _warped(x, params)


def _penalized(logits: Any, params: SamplingParams, counts: TokenCounts | None, xp: Any) -> Any:
    """The first half of :func:`process_logits`: the penalties."""
    who = "process_logits"
    x = logits
    if params.uses_counts:
        if counts is None:
            raise ValueError(
                f"{who}: repetition_penalty={params.repetition_penalty}, presence_penalty="
                f"{params.presence_penalty}, frequency_penalty={params.frequency_penalty} need "
                "the tokens seen so far: pass counts=TokenCounts.from_prompt(prompt, vocab_size)"
            )
        _check_counts(who, counts, logits, xp)
        if params.repetition_penalty != 1.0:
            x = apply_repetition_penalty(x, params.repetition_penalty, counts=counts.seen)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            x = apply_presence_frequency(
                x, params.presence_penalty, params.frequency_penalty, counts.generated
            )
    return x


def _warped(x: Any, params: SamplingParams) -> Any:
    """The second half of :func:`process_logits` when sampling: temperature, top-k, top-p,
    min-p."""
    if params.temperature != 1.0:
        x = apply_temperature(x, params.temperature)
    if params.top_k:
        x = apply_top_k(x, params.top_k)
    if params.top_p < 1.0:
        x = apply_top_p(x, params.top_p)
    if params.min_p > 0.0:
        x = apply_min_p(x, params.min_p)
    return x


def _as_float32(logits: Any, xp: ModuleType) -> Any:
    """Floating logits (float16, bfloat16, float64) as float32; anything else as it is."""
    if logits.dtype != np.float32 and (logits.dtype.kind == "f" or logits.dtype.name == "bfloat16"):
        return logits.astype(xp.float32)
    return logits


def _usable_rows(logits: Any) -> Any:
    """``[B]`` bool: rows with no NaN, no +inf and at least one finite logit."""
    return (logits < np.inf).all(axis=-1) & (logits > -np.inf).any(axis=-1)


def sample_tokens(
    logits: Any, params: SamplingParams, uniforms: Any = None, counts: TokenCounts | None = None
) -> Any:
    """The next token of each row, all on the device: no host copy, no host generator, no
    synchronization (the step a CUDA graph captures). A row that cannot be sampled gets ``-1``:
    its logits hold NaN or +inf or no finite value, or the penalties sent every logit to -inf.

    Greedy (``temperature == 0``): the argmax after the penalties (the first of ties).
    Otherwise the token whose cumulative probability first exceeds ``uniforms[b]`` of the
    row's total (inverse CDF over the processed logits in vocabulary order, summed in float64),
    so token ``i`` comes with probability ``softmax(processed)[i]`` and a filtered token never.

    Args:
        logits: ``[B, V]`` floating (float32 after conversion), unchanged.
        params: the sampling parameters.
        uniforms: ``[B]`` floats in ``[0, 1)`` on the logits' device; unused when greedy.
        counts: the penalties' state, needed when a penalty is on.

    Returns:
        ``[B]`` int64 token ids on the logits' device, ``-1`` in rows that could not be sampled.
    """
    who = "sample_tokens"
    try:
        xp = array_module(logits)
    except TypeError as error:
        raise TypeError(f"{who}: logits: {error}") from None
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{who}: params must be a SamplingParams, got {type(params).__name__}")
    logits = _as_float32(logits, xp)
    _check_logits(who, logits)
    n_b, n_v = logits.shape
    if not params.greedy and (not isinstance(uniforms, xp.ndarray) or uniforms.shape != (n_b,)):
        raise ValueError(
            f"{who}: sampling (temperature={params.temperature}) needs uniforms: a "
            f"{xp.__name__} array [B={n_b}] of floats in [0, 1), got "
            f"{type(uniforms).__name__} of shape {getattr(uniforms, 'shape', None)}"
        )
    usable = _usable_rows(logits)
    # unusable rows sampled from zeros instead (their -1 replaces the token), so that no NaN
    # or inf travels through the processors
    x = xp.where(usable[:, None], logits, np.float32(0))
    with _quiet():
        x = _penalized(x, params, counts, xp)
        top = x.max(axis=-1, keepdims=True)  # [B, 1]
        usable &= top[:, 0] > -np.inf  # every logit pushed to -inf by the penalties
        if params.greedy:
            tokens = x.argmax(axis=-1)
        else:
            # each row shifted to a maximum of 0 before the temperature, which leaves the
            # distribution as it is but keeps x / T finite at the top: a temperature so small
            # that 1 / T overflows float32 (or T rounds to 0 there) draws the largest logits
            # alone, the limit of the softmax
            if not np.float32(params.temperature) > 0:
                params = dataclasses.replace(params, temperature=_TINIEST)
            x = _warped(xp.where(xp.isfinite(top), x - top, x), params)
            top = x.max(axis=-1, keepdims=True)
            # +inf (a penalty overflowed float32) as the limit of the softmax: the tokens at
            # +inf share the row, the others get nothing
            probs = xp.exp(xp.where(x == top, np.float32(0), x - top))  # [B, V], max 1
            cum = xp.cumsum(probs, axis=-1, dtype=xp.float64)
            threshold = uniforms.astype(xp.float64) * cum[:, -1]  # [B], < the total
            tokens = (cum <= threshold[:, None]).sum(axis=-1)
            # a uniform rounded up to the total would index past the last possible token
            last = n_v - 1 - (probs[:, ::-1] > 0).argmax(axis=-1)
            tokens = xp.minimum(tokens, last)
    return xp.where(usable, tokens.astype(xp.int64), -1)


def sample(
    logits: Any,
    params: SamplingParams,
    counts: TokenCounts | None = None,
    rng: np.random.Generator | None = None,
) -> Any:
    """The next token of each row, on the logits' device, after :func:`process_logits`.

    Greedy when ``params.temperature == 0``; otherwise one uniform per row is drawn from
    ``rng`` on the host (``[B]`` floats, copied to the device) and :func:`sample_tokens`
    turns it into a token. The same ``rng`` state gives the same tokens. ``counts`` is read,
    not updated: call ``counts.update(tokens)`` after the step.

    Args:
        logits: ``[B, V]`` floating (float32 after conversion), unchanged.
        params: the sampling parameters.
        counts: the penalties' state, needed when a penalty is on.
        rng: ``params.make_rng()``, one per generation (not per step); unused when greedy.

    Returns:
        ``[B]`` int64 token ids on the logits' device.

    Raises:
        FloatingPointError: naming each batch row whose logits hold NaN or +inf or no finite
            value (or whose every logit the penalties sent to -inf); nothing is returned, and
            ``rng`` is left as it was.
        ValueError, TypeError: bad logits, counts, or a missing ``rng`` when sampling.
    """
    who = "sample"
    try:
        xp = array_module(logits)
    except TypeError as error:
        raise TypeError(f"{who}: logits: {error}") from None
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{who}: params must be a SamplingParams, got {type(params).__name__}")
    logits = _as_float32(logits, xp)
    uniforms = None
    state = None
    if not params.greedy:
        if not isinstance(rng, np.random.Generator):
            raise TypeError(
                f"{who}: temperature={params.temperature} samples: pass "
                f"rng=params.make_rng() (a numpy.random.Generator), got {type(rng).__name__}"
            )
        if logits.ndim != 2:
            _check_logits(who, logits)
        state = rng.bit_generator.state
        uniforms = xp.asarray(rng.random(logits.shape[0]))
    try:
        tokens = sample_tokens(logits, params, uniforms, counts)
    except Exception:
        if state is not None and rng is not None:
            rng.bit_generator.state = state
        raise
    if bool((tokens < 0).any()):  # the only wait on the device: one bool
        if state is not None and rng is not None:
            rng.bit_generator.state = state
        _raise_unusable(logits, tokens, params)
    return tokens


def _raise_unusable(logits: Any, tokens: Any, params: SamplingParams) -> None:
    """Raise the FloatingPointError of :func:`sample` for the rows where ``tokens`` is -1."""
    xp = array_module(logits)
    to_host = getattr(xp, "asnumpy", np.asarray)
    bad = np.flatnonzero(to_host(tokens) < 0)
    broken = to_host(~_usable_rows(logits))
    nonfinite = [int(r) for r in bad if broken[r]]
    penalized = [int(r) for r in bad if not broken[r]]

    def rows(which: list[int]) -> str:
        return ("batch rows " if len(which) > 1 else "batch row ") + ", ".join(map(str, which))

    problems = []
    if nonfinite:
        problems.append(
            f"NaN or +inf (or no finite value) in the logits of {rows(nonfinite)}; no token was "
            "sampled from them. The weights or the activations hold NaN or overflowed: check "
            "the checkpoint, or run in a wider precision"
        )
    if penalized:
        problems.append(
            f"the penalties sent every logit of {rows(penalized)} to -inf "
            f"(repetition_penalty={params.repetition_penalty}, presence_penalty="
            f"{params.presence_penalty}, frequency_penalty={params.frequency_penalty}); "
            "no token was sampled from them: use smaller penalties"
        )
    raise FloatingPointError("sample: " + "; and ".join(problems))
