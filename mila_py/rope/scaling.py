"""RoPE scaling types: ``rope_type`` name -> inverse frequencies and attention factor.

Each type computes what Hugging Face transformers 5.x ``modeling_rope_utils.py`` computes for the
same ``rope_scaling`` / ``rope_parameters`` dict, with one deliberate difference: everything is
float64 here (HF forms frequencies in float32), and tables are rounded to float32 once.

A type is a function ``(head_dim, rotary_dim, base, max_seq_len, params) -> (inv_freq, attention)``:

- ``inv_freq``: float64 ``[n_freq]``. The rotated channels of a head are its first ``2 * n_freq``
  (``n_freq == rotary_dim // 2`` for every built-in type except ``proportional``, whose pairs span
  the whole head with zero frequencies past the rotated part).
- ``attention``: the factor folded into cos and sin (YaRN's mscale, LongRoPE's scaling).

``register_rope_type("name")`` adds a type; afterwards ``scaling={"rope_type": "name", ...}`` works
in every ``RopeConfig``, ``get_rope`` and ``Rope``.

Length-dependent types (``dynamic``, ``longrope``) choose their parameters from the largest
position of each call: ``seq_len = max(position) + 1``. ``longrope`` switches as HF does; HF's
``dynamic`` module also keeps the longest length it has seen (until a call falls below the
original length), which matters only when a shorter call past the original length follows a
longer one. mila_py keeps no such history.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "RopeType",
    "check_scaling_values",
    "default_inv_freq",
    "get_rope_type",
    "register_rope_type",
    "registered_rope_types",
    "rope_type_name",
]

RopeTypeFn = Callable[[int, int, float, int, Mapping[str, Any]], tuple[np.ndarray, float]]

#: keys any scaling dict may carry (HF bookkeeping that has no effect on the tables)
BOOKKEEPING_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
#: keys that hold a real number in every type that reads them (HF's names), whatever the type
NUMBER_KEYS = frozenset(
    {"factor", "alpha", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
     "low_freq_factor", "high_freq_factor", "rope_theta", "partial_rotary_factor"}
)  # fmt: skip
#: keys that hold an int (a position count: a float would be truncated)
INT_KEYS = frozenset({"original_max_position_embeddings"})
#: keys that hold a list of real numbers
NUMBER_LIST_KEYS = frozenset({"short_factor", "long_factor"})


@dataclass(frozen=True)
class RopeType:
    """A registered scaling type.

    Attributes:
        name: the ``rope_type`` string.
        fn: ``(head_dim, rotary_dim, base, max_seq_len, params) -> (inv_freq float64, attention)``.
        required: keys the params dict must have.
        optional: keys it may have (others are refused, so typos surface).
        validate: extra checks ``(head_dim, rotary_dim, max_seq_len, params) -> None`` raising ValueError.
        length_dependent: ``"none"``; ``"switch"`` (two tables, chosen by ``seq_len > original``);
            or ``"per_length"`` (new frequencies for every ``seq_len > original``).
        softmax_scale: ``params -> float``, the extra factor attention must apply (default 1.0).
    """

    name: str
    fn: RopeTypeFn
    required: frozenset[str] = field(default_factory=frozenset)
    optional: frozenset[str] = field(default_factory=frozenset)
    validate: Callable[[int, int, int, Mapping[str, Any]], None] | None = None
    length_dependent: str = "none"
    softmax_scale: Callable[[Mapping[str, Any]], float] | None = None


_TYPES: dict[str, RopeType] = {}
_LOCK = threading.Lock()


def register_rope_type(
    name: str,
    fn: RopeTypeFn | None = None,
    *,
    required: tuple[str, ...] = (),
    optional: tuple[str, ...] | None = None,
    validate: Callable[[int, int, int, Mapping[str, Any]], None] | None = None,
    softmax_scale: Callable[[Mapping[str, Any]], float] | None = None,
    length_dependent: str = "none",
    replace: bool = False,
) -> Any:
    """Register a RoPE scaling type; usable as ``@register_rope_type("name")`` or directly.

    The function receives ``(head_dim, rotary_dim, base, max_seq_len, params)`` and returns
    ``(inv_freq, attention_scaling)`` with ``inv_freq`` float64 of length ``rotary_dim // 2``
    (or ``head_dim // 2`` for pairs spanning the whole head).

    Args:
        name: the ``rope_type`` value that selects it.
        fn: the function (omit to use as a decorator).
        required: keys the scaling dict must carry.
        optional: keys it may carry; ``None`` accepts any extra key.
        validate: extra checks raising ValueError.
        softmax_scale: ``params -> float`` multiplier attention must apply; default 1.0.
        length_dependent: ``"none"``, ``"switch"`` or ``"per_length"`` (see :class:`RopeType`).
        replace: allow replacing an existing type (built-ins included).

    Raises:
        ValueError: empty name, a name already registered (unless ``replace``), or a bad
            ``length_dependent``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_rope_type: name must be a non-empty str, got {name!r}")
    if length_dependent not in ("none", "switch", "per_length"):
        raise ValueError(
            f"register_rope_type({name!r}): length_dependent must be 'none', 'switch' or "
            f"'per_length', got {length_dependent!r}"
        )

    def decorator(func: RopeTypeFn) -> RopeTypeFn:
        if not callable(func):
            raise TypeError(f"register_rope_type({name!r}): expected a function, got {func!r}")
        entry = RopeType(
            name=name,
            fn=func,
            required=frozenset(required),
            optional=frozenset(optional) if optional is not None else frozenset({"*"}),
            validate=validate,
            length_dependent=length_dependent,
            softmax_scale=softmax_scale,
        )
        with _LOCK:
            if name in _TYPES and not replace:
                raise ValueError(
                    f"rope type {name!r} is already registered; pass replace=True to override it"
                )
            _TYPES[name] = entry
        return func

    return decorator(fn) if fn is not None else decorator


def registered_rope_types() -> list[str]:
    """Names of every registered scaling type."""
    return sorted(_TYPES)


def rope_type_name(scaling: Mapping[str, Any] | None) -> str:
    """The type name of a scaling dict (``rope_type``, legacy ``type``, or ``"default"``)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def get_rope_type(name: str) -> RopeType:
    """The registered type ``name``.

    Raises:
        ValueError: unknown type, listing the known ones.
    """
    try:
        return _TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown rope_type {name!r}; registered types: {registered_rope_types()} "
            "(add one with register_rope_type)"
        ) from None


def check_scaling(
    scaling: Mapping[str, Any] | None, head_dim: int, rotary_dim: int, max_seq_len: int
) -> RopeType:
    """Validate a scaling dict against its type; returns the type.

    Raises:
        ValueError: unknown type, missing or unexpected keys, bad values.
    """
    name = rope_type_name(scaling)
    entry = get_rope_type(name)
    check_scaling_values(scaling)
    params = dict(scaling or {})
    # a required key given as null is missing too (it failed deep in the type's function),
    # except YaRN's factor: null means max_seq_len / original_max_position_embeddings
    missing = sorted(
        k
        for k in entry.required
        if k not in params or (params[k] is None and (name, k) not in _NULLABLE)
    )
    if missing:
        raise ValueError(f"rope_type {name!r} needs the key(s) {missing} in scaling; got {params}")
    if "*" not in entry.optional:
        unknown = sorted(params.keys() - entry.required - entry.optional - BOOKKEEPING_KEYS)
        if unknown:
            raise ValueError(
                f"rope_type {name!r} does not take the key(s) {unknown}; it takes "
                f"{sorted(entry.required | entry.optional)}"
            )
    if entry.validate is not None:
        entry.validate(head_dim, rotary_dim, max_seq_len, params)
    return entry


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def _non_finite(value: Any, where: str) -> tuple[str, Any] | None:
    """The first NaN or infinite number in ``value`` (nested lists and dicts too), with where
    it sits, or None."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _non_finite(item, f"{where}[{key!r}]")
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _non_finite(item, f"{where}[{i}]")
            if found is not None:
                return found
    elif _is_real(value) and not math.isfinite(value):
        return where, value
    return None


def check_scaling_values(scaling: Mapping[str, Any] | None) -> None:
    """Refuse values no type can mean, whatever the type: a NaN or infinite number anywhere
    (a NaN factor or ``mscale_all_dim`` would give NaN tables or attention, a NaN ``beta_fast``
    would fail only when the table is made), a non-number (a bool, a str) in a key that holds
    a real number (:data:`NUMBER_KEYS`), a non-int in an ``original_max_position_embeddings``,
    and a list that is not all real numbers in ``short_factor`` / ``long_factor``. A null value
    is left to the type (some read it as absent).

    Raises:
        ValueError: naming the type, the key and the value.
    """
    if not scaling:
        return
    name = rope_type_name(scaling)
    for key, value in scaling.items():
        found = _non_finite(value, str(key))
        if found is not None:
            raise ValueError(
                f"rope_type {name!r}: {found[0]} must be a finite number, got {found[1]!r}"
            )
        if value is None:
            continue
        if key in NUMBER_KEYS and not _is_real(value):
            raise ValueError(
                f"rope_type {name!r}: {key} must be a real number, got {value!r} "
                f"({type(value).__name__})"
            )
        if key in INT_KEYS and not (isinstance(value, numbers.Integral) and _is_real(value)):
            raise ValueError(
                f"rope_type {name!r}: {key} must be an int, got {value!r} "
                f"({type(value).__name__}; a float is refused even when whole, so that none is "
                "truncated)"
            )
        if key in NUMBER_LIST_KEYS:
            items = value if isinstance(value, list | tuple) else None
            bad = [value] if items is None else [v for v in items if not _is_real(v)]
            if bad:
                raise ValueError(
                    f"rope_type {name!r}: {key} must be a list of real numbers, got {value!r} "
                    f"(not a number: {bad[0]!r})"
                )


#: required keys a type's function reads as null on purpose
_NULLABLE = frozenset({("yarn", "factor")})


def default_inv_freq(base: float, dim: int, n: int | None = None) -> np.ndarray:
    """``1 / base ** (2i / dim)`` for ``i < n`` (``n = dim // 2`` by default), float64."""
    n = dim // 2 if n is None else n
    return 1.0 / (float(base) ** (np.arange(0, 2 * n, 2, dtype=np.float64) / dim))


def _original_len(params: Mapping[str, Any], max_seq_len: int) -> int:
    value = params.get("original_max_position_embeddings")
    return int(value) if value is not None else int(max_seq_len)


def _positive(name: str, params: Mapping[str, Any], key: str, *, minimum: float = 0.0) -> None:
    value = params.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"rope_type {name!r}: {key} must be a finite number, got {value!r}")
    if value <= minimum:
        raise ValueError(f"rope_type {name!r}: {key} must be > {minimum}, got {value!r}")


def _check_factor(name: str, params: Mapping[str, Any], *, at_least_one: bool = True) -> None:
    _positive(name, params, "factor")
    factor = params.get("factor")
    if at_least_one and factor is not None and factor < 1.0:
        raise ValueError(f"rope_type {name!r}: factor must be >= 1, got {factor!r}")
    _positive(name, params, "original_max_position_embeddings")


# ---------------------------------------------------------------------------------------- types


def _default(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    return default_inv_freq(base, rotary_dim), 1.0


def _linear(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    return default_inv_freq(base, rotary_dim) / float(params["factor"]), 1.0


def _proportional(
    head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any
) -> Any:
    # Mila's convention: pairs span the whole head; exponents over head_dim; zero past rotary_dim.
    inv_freq = np.zeros(head_dim // 2, dtype=np.float64)
    inv_freq[: rotary_dim // 2] = default_inv_freq(base, head_dim, rotary_dim // 2)
    return inv_freq / float(params.get("factor", 1.0)), 1.0


def _ntk_alpha(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    # HunYuan's fixed NTK scaling: the base stretched by alpha^(d / (d - 2)), d = head_dim
    stretched = base * float(params["alpha"]) ** (head_dim / (head_dim - 2))
    return default_inv_freq(stretched, rotary_dim), 1.0


def _dynamic(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    original = _original_len(params, max_seq_len)
    seq_len = max(int(params.get("seq_len", 0)), original)
    factor = float(params["factor"])
    dim = rotary_dim
    if seq_len > original and dim > 2:
        base = base * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(base, dim), 1.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(params: Mapping[str, Any], max_seq_len: int) -> float:
    factor = params.get("factor")
    if factor is None:
        return max_seq_len / _original_len(params, max_seq_len)
    return float(factor)


def _yarn(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    dim = rotary_dim
    factor = _yarn_factor(params, max_seq_len)
    original = _original_len(params, max_seq_len)
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoids a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    pos_freqs = float(base) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1.0 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention)


def _yarn_softmax_scale(params: Mapping[str, Any]) -> float:
    # DeepSeek-V2/V3: attention multiplies its softmax scale by mscale(factor, mscale_all_dim)^2.
    mscale_all_dim = params.get("mscale_all_dim")
    factor = params.get("factor")
    if not mscale_all_dim or factor is None:
        return 1.0
    return yarn_get_mscale(float(factor), float(mscale_all_dim)) ** 2


def _longrope_factor(params: Mapping[str, Any], max_seq_len: int) -> float:
    factor = params.get("factor")
    if factor is None:
        return max_seq_len / _original_len(params, max_seq_len)
    return float(factor)


def _longrope(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    original = _original_len(params, max_seq_len)
    factor = _longrope_factor(params, max_seq_len)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    seq_len = int(params.get("seq_len", 0))
    ext = params["long_factor"] if seq_len > original else params["short_factor"]
    inv_freq = default_inv_freq(base, rotary_dim) / np.asarray(ext, dtype=np.float64)
    return inv_freq, float(attention)


def _llama3(head_dim: int, rotary_dim: int, base: float, max_seq_len: int, params: Any) -> Any:
    inv_freq = default_inv_freq(base, rotary_dim)
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = _original_len(params, max_seq_len)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    if high_freq_factor == low_freq_factor:  # Llama 4: no band to smooth over
        return scaled, 1.0
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


# ---------------------------------------------------------------------------------------- checks


def _check_linear(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _positive("linear", params, "factor")


def _check_ntk_alpha(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _positive("ntk_alpha", params, "alpha")
    if head_dim <= 2:
        raise ValueError(f"rope_type 'ntk_alpha' needs head_dim > 2, got {head_dim}")


def _needs_original(name: str, params: Mapping[str, Any], max_seq_len: int) -> None:
    """A length-dependent type switches past the pretrained context: without one it would
    switch at the table's end, which no position reaches (plain RoPE, or LongRoPE's short
    factors only, in silence)."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(
            f"rope_type {name!r} needs original_max_position_embeddings (the pretrained context "
            "it scales past; transformers takes the model's max_position_embeddings): without "
            f"it, it would switch at max_seq_len {max_seq_len}, which no position reaches"
        )


def _check_dynamic(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _check_factor("dynamic", params)
    _needs_original("dynamic", params, max_seq_len)


def _check_proportional(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _positive("proportional", params, "factor")


def _check_yarn(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    if params.get("factor") is not None:
        _check_factor("yarn", params)
    else:
        _positive("yarn", params, "original_max_position_embeddings")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        value = params.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or value < 0
        ):
            raise ValueError(f"rope_type 'yarn': {key} must be a number >= 0, got {value!r}")
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    if fast < slow:
        raise ValueError(f"rope_type 'yarn': beta_fast ({fast}) must be >= beta_slow ({slow})")
    if "truncate" in params and not isinstance(params["truncate"], bool):
        raise ValueError(f"rope_type 'yarn': truncate must be a bool, got {params['truncate']!r}")


def _check_longrope(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _positive("longrope", params, "factor")
    _positive("longrope", params, "attention_factor")
    _positive("longrope", params, "original_max_position_embeddings")
    _needs_original("longrope", params, max_seq_len)
    for key in ("short_factor", "long_factor"):
        values = params[key]
        try:
            array = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"rope_type 'longrope': {key} must be a list of numbers, got {values!r}"
            ) from None
        if array.shape != (rotary_dim // 2,):
            raise ValueError(
                f"rope_type 'longrope': {key} must have rotary_dim // 2 = {rotary_dim // 2} "
                f"entries, got {array.size}"
            )
        if not np.all(np.isfinite(array)) or np.any(array <= 0):
            raise ValueError(f"rope_type 'longrope': {key} entries must be finite and > 0")


def _check_llama3(head_dim: int, rotary_dim: int, max_seq_len: int, params: Any) -> None:
    _check_factor("llama3", params)
    _positive("llama3", params, "low_freq_factor")
    _positive("llama3", params, "high_freq_factor")
    if float(params["high_freq_factor"]) < float(params["low_freq_factor"]):
        raise ValueError(
            "rope_type 'llama3': high_freq_factor must be >= low_freq_factor, got "
            f"{params['high_freq_factor']} < {params['low_freq_factor']}"
        )


_ORIGINAL = "original_max_position_embeddings"
register_rope_type("default", _default, optional=())
register_rope_type("linear", _linear, required=("factor",), optional=(), validate=_check_linear)
register_rope_type(
    "proportional", _proportional, optional=("factor",), validate=_check_proportional
)
register_rope_type(
    "ntk_alpha", _ntk_alpha, required=("alpha",), optional=(), validate=_check_ntk_alpha
)
register_rope_type(
    "dynamic",
    _dynamic,
    required=("factor",),
    optional=(_ORIGINAL,),
    validate=_check_dynamic,
    length_dependent="per_length",
)
register_rope_type(
    "yarn",
    _yarn,
    required=("factor",),
    optional=(
        _ORIGINAL,
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    validate=_check_yarn,
    softmax_scale=_yarn_softmax_scale,
)
register_rope_type(
    "longrope",
    _longrope,
    required=("short_factor", "long_factor"),
    optional=(_ORIGINAL, "factor", "attention_factor"),
    validate=_check_longrope,
    length_dependent="switch",
)
register_rope_type(
    "llama3",
    _llama3,
    required=("factor", "low_freq_factor", "high_freq_factor"),
    optional=(_ORIGINAL,),
    validate=_check_llama3,
)


def original_length(scaling: Mapping[str, Any] | None, max_seq_len: int) -> int:
    """The pretrained context a length-dependent type switches at (``max_seq_len`` if absent)."""
    return _original_len(scaling or {}, max_seq_len)
