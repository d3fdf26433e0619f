"""An independent float64 reference for rotary position embeddings (used by the Rope tests).

Nothing here imports mila_py: the inverse frequencies of every scaling type are written from the
formulas of Hugging Face transformers 5.x ``modeling_rope_utils.py`` (``_compute_*_parameters``
and ``dynamic_rope_update``), evaluated in float64, and the rotation is a complex multiplication.

Conventions shared with mila_py (the parts HF leaves to the model code):

- ``rotary_dim`` (0 = the whole head) rotates the first ``rotary_dim`` channels of every head with
  exponents over ``rotary_dim``; the other channels pass through.
- ``proportional`` pairs span the whole head, exponents over ``head_dim``, zero frequencies past
  ``rotary_dim / 2``.
- layout ``"half"`` pairs ``(i, i + n)`` with ``n`` the number of frequencies; ``"interleaved"``
  pairs ``(2i, 2i + 1)``.
- ``original_max_position_embeddings`` falls back to ``max_seq_len`` (HF: max_position_embeddings).
- ``dynamic`` and ``longrope`` take ``seq_len = max(position) + 1`` of each call, statelessly.
- The attention factor multiplies cos and sin.
- M-RoPE (``mrope_section``): positions ``[3, B, T]``; which axis drives which frequency is
  written from the models' ``recomposition_frequencies`` (Qwen2-VL / GLM-4V: split into sections,
  section ``i`` takes axis ``i % 3``; Qwen3-VL: start from axis 0, then overwrite the slices
  ``1::3`` below ``3 * section[1]`` with axis 1 and ``2::3`` below ``3 * section[2]`` with axis 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

ORIGINAL = "original_max_position_embeddings"


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's ``0.1 * m * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0


def _powers(base: float, dim: int, count: int) -> np.ndarray:
    """``base ** (2i / dim)`` for ``i < count``, float64."""
    exponents = np.array([2.0 * i / dim for i in range(count)], dtype=np.float64)
    return np.power(np.float64(base), exponents)


def _original(params: Mapping[str, Any], max_seq_len: int) -> int:
    value = params.get(ORIGINAL)
    return int(max_seq_len if value is None else value)


def frequencies(
    head_dim: int,
    rotary_dim: int,
    base: float,
    max_seq_len: int,
    scaling: Mapping[str, Any] | None,
    seq_len: int,
) -> tuple[np.ndarray, float]:
    """``(inv_freq float64 [n], attention)`` of a call whose largest position is ``seq_len - 1``.

    ``rotary_dim`` is the RopeConfig field (0 = whole head).
    """
    params = dict(scaling or {})
    kind = params.get("rope_type", params.get("type", "default"))
    dim = rotary_dim or head_dim
    half = dim // 2

    if kind == "default":
        return 1.0 / _powers(base, dim, half), 1.0

    if kind == "linear":
        return 1.0 / _powers(base, dim, half) / float(params["factor"]), 1.0

    if kind == "proportional":
        inv = np.zeros(head_dim // 2, dtype=np.float64)
        inv[:half] = 1.0 / _powers(base, head_dim, half)
        return inv / float(params.get("factor", 1.0)), 1.0

    if kind == "ntk_alpha":  # HunYuan: base * alpha^(head_dim / (head_dim - 2)), fixed
        stretched = base * float(params["alpha"]) ** (head_dim / (head_dim - 2.0))
        return 1.0 / _powers(stretched, dim, half), 1.0

    if kind == "dynamic":
        original = _original(params, max_seq_len)
        factor = float(params["factor"])
        length = max(seq_len, original)
        scaled = base * ((factor * length / original) - (factor - 1.0)) ** (dim / (dim - 2))
        return 1.0 / _powers(scaled, dim, half), 1.0

    if kind == "yarn":
        original = _original(params, max_seq_len)
        factor = params.get("factor")
        factor = max_seq_len / original if factor is None else float(factor)
        attention = params.get("attention_factor")
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        if attention is None:
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        fast = params.get("beta_fast") or 32
        slow = params.get("beta_slow") or 1

        def correction(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2.0 * math.pi)) / (2.0 * math.log(base))

        low, high = correction(fast), correction(slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        pos = _powers(base, dim, half)
        extrapolation = 1.0 - ramp
        inv = (1.0 / (factor * pos)) * (1.0 - extrapolation) + (1.0 / pos) * extrapolation
        return inv, float(attention)

    if kind == "longrope":
        original = _original(params, max_seq_len)
        factor = params.get("factor")
        factor = max_seq_len / original if factor is None else float(factor)
        attention = params.get("attention_factor")
        if attention is None:
            attention = (
                1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(original))
            )
        ext = params["long_factor"] if seq_len > original else params["short_factor"]
        ext = np.array([float(v) for v in ext], dtype=np.float64)
        return 1.0 / (ext * _powers(base, dim, half)), float(attention)

    if kind == "llama3":
        inv = 1.0 / _powers(base, dim, half)
        factor = float(params["factor"])
        low_ff = float(params["low_freq_factor"])
        high_ff = float(params["high_freq_factor"])
        old = _original(params, max_seq_len)
        low_wavelen, high_wavelen = old / low_ff, old / high_ff
        out = np.empty_like(inv)
        for i, f in enumerate(inv):
            wavelen = 2.0 * math.pi / f
            if wavelen < high_wavelen:
                out[i] = f
            elif wavelen > low_wavelen:
                out[i] = f / factor
            else:
                smooth = (old / wavelen - low_ff) / (high_ff - low_ff)
                out[i] = (1.0 - smooth) * f / factor + smooth * f
        return out, 1.0

    raise ValueError(f"reference: no formula for rope_type {kind!r}")


def softmax_scale_multiplier(scaling: Mapping[str, Any] | None) -> float:
    """DeepSeek YaRN: ``mscale(factor, mscale_all_dim) ** 2``; 1.0 otherwise."""
    params = dict(scaling or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "yarn" or not params.get("mscale_all_dim") or params.get("factor") is None:
        return 1.0
    return mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2


def mrope_frequency_positions(
    positions: Any, section: Any, interleaved: bool, n_b: int, n_t: int
) -> np.ndarray:
    """float64 ``[B, T, n]``: the position each frequency of each token turns by.

    ``positions`` ``[3, B, T]`` (broadcast) holds the temporal, height and width positions.
    """
    axes = np.broadcast_to(np.asarray(positions, dtype=np.float64), (3, n_b, n_t))
    per_axis = np.stack([axes[a] for a in range(3)], axis=-1)  # [B, T, 3]
    n = int(sum(section))
    if not interleaved:
        columns = []
        for i, width in enumerate(section):
            columns += [per_axis[..., i % 3]] * int(width)
        return np.stack(columns, axis=-1)
    chosen = np.repeat(per_axis[..., :1], n, axis=-1)  # every frequency on axis 0 ...
    for axis, first in ((1, 1), (2, 2)):  # ... then HF's slice(first, 3 * section, 3)
        idx = list(range(first, min(3 * int(section[axis]), n), 3))
        chosen[..., idx] = per_axis[..., axis : axis + 1]
    return chosen


def rotate(
    x: np.ndarray,
    positions: np.ndarray,
    n_heads: int,
    head_dim: int,
    inv_freq: np.ndarray,
    attention: float,
    layout: str,
    *,
    inverse: bool = False,
) -> np.ndarray:
    """Rotate ``x [B, T, n_heads * head_dim]`` at ``positions`` (broadcast to ``[B, T]``, or
    ``[B, T, n]``: a position per frequency), float64.

    Pair ``j`` of a head becomes ``(x1 + i x2) * attention * exp(+-i * position * inv_freq[j])``.
    """
    x = np.asarray(x, dtype=np.float64)
    n_b, n_t = x.shape[0], x.shape[1]
    n = len(inv_freq)
    pos = np.asarray(positions, dtype=np.float64)
    if pos.ndim < 3:
        pos = np.broadcast_to(pos, (n_b, n_t))[:, :, None]
    if layout == "half":
        first, second = np.arange(n), np.arange(n) + n
    elif layout == "interleaved":
        first, second = 2 * np.arange(n), 2 * np.arange(n) + 1
    else:
        raise ValueError(layout)
    heads = x.reshape(n_b, n_t, n_heads, head_dim).copy()
    angle = pos[:, :, None, :] * np.asarray(inv_freq, dtype=np.float64)[None, None, None, :]
    phase = attention * np.exp((-1j if inverse else 1j) * angle)  # [B, T, 1, n]
    z = (heads[..., first] + 1j * heads[..., second]) * phase
    heads[..., first] = z.real
    heads[..., second] = z.imag
    return heads.reshape(n_b, n_t, n_heads * head_dim)


@dataclass(frozen=True)
class Spec:
    """What the reference needs of a configuration (the plain fields, no derived values)."""

    channels: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int
    base: float = 10000.0
    rotary_dim: int = 0
    layout: str = "half"
    scaling: Mapping[str, Any] | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    @classmethod
    def of(cls, config: Any) -> Spec:
        """Copy the raw fields of a RopeConfig-like object (no method of it is called)."""
        layout = getattr(config.layout, "value", config.layout)
        scaling = None if config.scaling is None else {k: config.scaling[k] for k in config.scaling}
        return cls(
            int(config.channels),
            int(config.n_heads),
            int(config.n_kv_heads),
            int(config.max_seq_len),
            float(config.base),
            int(config.rotary_dim),
            str(layout),
            scaling,
            None if config.mrope_section is None else tuple(int(v) for v in config.mrope_section),
            bool(config.mrope_interleaved),
        )

    @property
    def head_dim(self) -> int:
        return self.channels // self.n_heads

    def frequencies(self, seq_len: int) -> tuple[np.ndarray, float]:
        return frequencies(
            self.head_dim, self.rotary_dim, self.base, self.max_seq_len, self.scaling, seq_len
        )

    def rotate_qk(
        self, q: np.ndarray, k: np.ndarray, positions: Any, *, inverse: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """float64 rotated ``(q, k)``; ``seq_len`` is ``max(positions) + 1`` as in one call.

        With ``mrope_section``, positions ``[3, B, T]`` (3-D) are per-axis positions."""
        positions = np.asarray(positions)
        inv_freq, attention = self.frequencies(int(positions.max()) + 1)
        if self.mrope_section is not None and positions.ndim == 3:
            n_b, n_t = np.shape(q)[0], np.shape(q)[1]
            positions = mrope_frequency_positions(
                positions, self.mrope_section, self.mrope_interleaved, n_b, n_t
            )
        args = (self.head_dim, inv_freq, attention, self.layout)
        return (
            rotate(q, positions, self.n_heads, *args, inverse=inverse),
            rotate(k, positions, self.n_kv_heads, *args, inverse=inverse),
        )
