"""RopeConfig: the frozen, validated description of a rotary position embedding."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.rope.scaling import (
    BOOKKEEPING_KEYS,
    RopeType,
    check_scaling,
    check_scaling_values,
    get_rope_type,
    rope_type_name,
)

__all__ = ["FrozenDict", "RopeConfig", "RopeLayout"]


class RopeLayout(enum.StrEnum):
    """Which channels of a head form a rotated pair.

    HALF pairs ``(i, i + d/2)`` (Llama, Mila, GPT-NeoX "rotate_half"); INTERLEAVED pairs
    ``(2i, 2i + 1)`` (GPT-J, Meta's original Llama checkpoints). Named by layout on purpose:
    family names ("neox style") mean opposite things in different libraries.
    """

    HALF = "half"
    INTERLEAVED = "interleaved"


class FrozenDict(Mapping[str, Any]):
    """An immutable, hashable mapping (lists inside become tuples)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = {str(k): _freeze(v) for k, v in data.items()}
        self._hash = hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == {k: _freeze(v) for k, v in other.items()}
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._data)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._data.items()}


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _freeze(value.tolist())
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RopeConfig:
    """Configuration of a rotary position embedding.

    Args:
        channels: width of Q, ``n_heads * head_dim``.
        n_heads: query heads.
        n_kv_heads: key heads (``n_kv_heads <= n_heads``; GQA/MQA when smaller).
        max_seq_len: table size: the longest context served (positions ``0..max_seq_len-1``).
        base: the frequency base theta.
        rotary_dim: channels rotated per head, the first ones (0 = the whole head); even. Frequencies
            use exponents over ``rotary_dim`` (the common convention); for Mila's convention, where
            pairs span the whole head and frequencies past the rotated part are zero, use the
            scaling type ``"proportional"``.
        layout: ``"half"`` pairs ``(i, i + d/2)``; ``"interleaved"`` pairs ``(2i, 2i + 1)``.
        scaling: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict with ``rope_type``
            (or legacy ``type``): default, linear, dynamic, yarn, llama3, longrope, proportional or
            any type added with ``register_rope_type``. Its ``mrope_section`` and
            ``mrope_interleaved`` keys (Qwen2-VL, Qwen3-VL, GLM-4V) move to the fields below, and
            Qwen2-VL's legacy ``"type": "mrope"`` reads as ``"default"``, as transformers does.
        mrope_section: multimodal RoPE (M-RoPE): how many of the ``n_freq = rotated_dim // 2``
            frequencies follow each of the three position axes (temporal, height, width); they
            sum to ``n_freq``. Calls then take positions ``[3, B, T]`` (see :meth:`mrope_axes`);
            positions without the axis mean one position on every axis (text tokens).
        mrope_interleaved: Qwen3-VL's assignment of frequencies to axes (``t h w t h w ...``)
            instead of Qwen2-VL's contiguous sections.

    Raises:
        ValueError: on any invalid value, saying what to fix; in the scaling dict, a NaN or
            infinite number anywhere, or a bool or str where a number goes (see
            :func:`~mila_py.rope.scaling.check_scaling_values`).
        TypeError: a non-int size or a non-dict scaling.
    """

    channels: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int
    base: float = 10000.0
    rotary_dim: int = 0
    layout: RopeLayout | str = RopeLayout.HALF
    scaling: Mapping[str, Any] | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layout", RopeLayout(self.layout))
        except ValueError:
            raise ValueError(
                f"RopeConfig: layout must be 'half' (pairs i, i+d/2) or 'interleaved' "
                f"(pairs 2i, 2i+1), got {self.layout!r}"
            ) from None
        if self.scaling is not None:
            if not isinstance(self.scaling, Mapping):
                raise TypeError(
                    f"RopeConfig: scaling must be a dict like {{'rope_type': 'yarn', ...}} or None, "
                    f"got {self.scaling!r}"
                )
            self._lift_mrope(dict(self.scaling))
        if self.mrope_section is not None:
            section = self.mrope_section
            if isinstance(section, str | bytes) or not hasattr(section, "__iter__"):
                raise TypeError(
                    f"RopeConfig: mrope_section must be three ints (temporal, height, width), "
                    f"got {section!r}"
                )
            object.__setattr__(self, "mrope_section", _freeze(section))
        self.validate()

    def _lift_mrope(self, params: dict[str, Any]) -> None:
        """Move the M-RoPE keys of the scaling dict to their fields; freeze what is left."""
        for key in ("mrope_section", "mrope_interleaved"):
            if key not in params:
                continue
            value = params.pop(key)
            field = getattr(self, key)
            if field is not None and field is not False and _freeze(field) != _freeze(value):
                raise ValueError(
                    f"RopeConfig: scaling carries {key}={value!r} but {key}={field!r}; give it once"
                )
            object.__setattr__(self, key, value)
        if rope_type_name(params) == "mrope":  # Qwen2-VL's legacy name
            params.pop("type", None)
            params["rope_type"] = "default"
        object.__setattr__(self, "scaling", FrozenDict(params))

    def validate(self) -> None:
        """Check every field and the scaling dict (called on construction).

        Raises:
            ValueError: naming the field, the value and what is expected.
        """
        for name in ("channels", "n_heads", "n_kv_heads", "max_seq_len", "rotary_dim"):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"RopeConfig: {name} must be an int, got {value!r}")
        for name in ("channels", "n_heads", "n_kv_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RopeConfig: {name} must be > 0, got {getattr(self, name)}")
        if self.channels % self.n_heads:
            raise ValueError(
                f"RopeConfig: channels ({self.channels}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"RopeConfig: head_dim = channels / n_heads = {self.head_dim} must be even "
                "(RoPE rotates pairs of channels)"
            )
        if self.n_kv_heads > self.n_heads:
            raise ValueError(
                f"RopeConfig: n_kv_heads ({self.n_kv_heads}) must be <= n_heads ({self.n_heads})"
            )
        if (
            isinstance(self.base, bool)
            or not isinstance(self.base, int | float)
            or not math.isfinite(self.base)
            or self.base <= 1.0
        ):
            raise ValueError(f"RopeConfig: base must be a finite number > 1, got {self.base!r}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"RopeConfig: rotary_dim must be even and in [0, head_dim={self.head_dim}] "
                f"(0 = whole head), got {self.rotary_dim}"
            )
        check_scaling_values(self.scaling)  # before rope_theta and partial_rotary_factor are read
        scaling = self.scaling or {}
        theta = scaling.get("rope_theta")
        if theta is not None and float(theta) != float(self.base):
            raise ValueError(
                f"RopeConfig: scaling carries rope_theta={theta} but base={self.base}; set "
                "base=<rope_theta> (or read the config.json with "
                "mila_py.interop.hf_rope.rope_config_from_hf, which does)"
            )
        prf = scaling.get("partial_rotary_factor")
        if prf is not None and int(self.head_dim * float(prf)) != self.rotated_dim:
            raise ValueError(
                f"RopeConfig: scaling carries partial_rotary_factor={prf} (rotary_dim "
                f"{int(self.head_dim * float(prf))}) but rotary_dim={self.rotated_dim}; set "
                "rotary_dim to match (or use mila_py.interop.hf_rope.rope_config_from_hf)"
            )
        check_scaling(self.scaling, self.head_dim, self.rotated_dim, self.max_seq_len)
        self._validate_mrope()

    def _validate_mrope(self) -> None:
        if isinstance(self.mrope_interleaved, np.bool_):
            object.__setattr__(self, "mrope_interleaved", bool(self.mrope_interleaved))
        if not isinstance(self.mrope_interleaved, bool):
            raise TypeError(
                f"RopeConfig: mrope_interleaved must be a bool, got {self.mrope_interleaved!r}"
            )
        section = self.mrope_section
        if section is None:
            if self.mrope_interleaved:
                raise ValueError("RopeConfig: mrope_interleaved=True needs an mrope_section")
            return
        n_freq = self.rotated_dim // 2
        if len(section) != 3 or not all(_is_int(v) and v >= 0 for v in section):
            raise ValueError(
                "RopeConfig: mrope_section must be three ints >= 0 (frequencies of the temporal, "
                f"height and width axes), got {section!r}"
            )
        if sum(section) != n_freq:
            raise ValueError(
                f"RopeConfig: mrope_section {list(section)} must sum to the {n_freq} rotated "
                f"frequencies (rotated_dim {self.rotated_dim} / 2), got {sum(section)}"
            )
        if self.mrope_interleaved:
            axes = self.mrope_axes()
            if (axes.count(1), axes.count(2)) != (section[1], section[2]):
                raise ValueError(
                    f"RopeConfig: interleaved mrope_section {list(section)} does not fit "
                    f"{n_freq} frequencies: height and width take every third one from 1 and 2, "
                    f"so each needs 3 * count <= {n_freq} + 1"
                )

    @property
    def head_dim(self) -> int:
        return self.channels // self.n_heads

    @property
    def kv_channels(self) -> int:
        """Width of K, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def rotated_dim(self) -> int:
        """``rotary_dim``, or ``head_dim`` when ``rotary_dim == 0``."""
        return self.rotary_dim or self.head_dim

    @property
    def is_mrope(self) -> bool:
        """Whether positions may carry three axes (``mrope_section`` is set)."""
        return self.mrope_section is not None

    def mrope_axes(self) -> tuple[int, ...]:
        """The position axis (0 temporal, 1 height, 2 width) of each rotated frequency.

        Contiguous sections (Qwen2-VL, GLM-4V): the first ``mrope_section[0]`` frequencies
        follow axis 0, the next ``mrope_section[1]`` axis 1, the rest axis 2. Interleaved
        (Qwen3-VL): frequency ``i`` follows axis 1 when ``i % 3 == 1`` and ``i < 3 *
        mrope_section[1]``, axis 2 when ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, else 0.

        Raises:
            ValueError: the config has no ``mrope_section``.
        """
        if self.mrope_section is None:
            raise ValueError("RopeConfig.mrope_axes: this config has no mrope_section")
        t, h, w = self.mrope_section
        if not self.mrope_interleaved:
            return (0,) * t + (1,) * h + (2,) * w
        axes = []
        for i in range(t + h + w):
            if i % 3 == 1 and i < 3 * h:
                axes.append(1)
            elif i % 3 == 2 and i < 3 * w:
                axes.append(2)
            else:
                axes.append(0)
        return tuple(axes)

    @property
    def rope_type(self) -> str:
        return rope_type_name(self.scaling)

    @property
    def rope_type_entry(self) -> RopeType:
        return get_rope_type(self.rope_type)

    def table_key(self) -> tuple[Any, ...]:
        """What determines the cos/sin table (layout and head counts do not), with the type
        (:attr:`rope_type_entry`) beside it: the scaling parameters, sorted, without the keys
        that name the type or repeat ``base`` and ``rotary_dim``, so ``None`` and
        ``{"rope_type": "default"}``, or ``type`` and ``rope_type``, share one table."""
        params = (self.scaling or {}).items()
        return (
            self.head_dim,
            self.rotated_dim,
            float(self.base),
            self.max_seq_len,
            tuple(sorted((k, v) for k, v in params if k not in BOOKKEEPING_KEYS)),
        )
