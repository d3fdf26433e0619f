"""The shared cos/sin tables of a RoPE configuration, and ``get_rope`` that caches them.

Angles are formed in float64 (``position * inv_freq``), their cos and sin taken in float64,
multiplied by the attention factor and rounded once to float32. Every ``Rope`` with the same
table-relevant configuration on the same device shares one :class:`RopeTable`, so N layers hold
one table (counted once in memory statistics).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from mila_py.devices import DeviceId, DeviceLike, DeviceType
from mila_py.rope.config import RopeConfig
from mila_py.rope.scaling import original_length

__all__ = ["RopeTable", "clear_rope_cache", "get_rope", "mrope_axes"]

_ROWS_PER_CHUNK = 8192


class RopeTable:
    """cos/sin tables ``[max_seq_len, n_freq]`` float32 (attention factor folded in) on one device.

    Attributes:
        config: the RopeConfig it was made for (head counts and layout are irrelevant to it).
        device_id: where the arrays live.
        inv_freq: float64 ``[n_freq]`` at rest (``seq_len <= original``).
        n_freq: rotated pairs per head; the first ``2 * n_freq`` channels of a head rotate.
        attention_scaling: factor folded into cos and sin.
        softmax_scale_multiplier: extra factor attention must apply to its softmax scale.
        cos, sin: the tables at rest. ``long_cos``/``long_sin``: LongRoPE's long tables (else None).
    """

    def __init__(self, config: RopeConfig, device: DeviceLike = "CPU") -> None:
        self.config = config
        self.device_id = DeviceId.parse(device)
        entry = config.rope_type_entry
        self._entry = entry
        self._params = dict(config.scaling or {})
        self.original_len = original_length(config.scaling, config.max_seq_len)
        inv_freq, attention = self._frequencies(seq_len=None)
        self.inv_freq = inv_freq
        self.n_freq = int(inv_freq.shape[0])
        self.attention_scaling = float(attention)
        self.softmax_scale_multiplier = (
            float(entry.softmax_scale(self._params)) if entry.softmax_scale is not None else 1.0
        )
        host_cos, host_sin = self._host_rows(np.arange(config.max_seq_len), inv_freq, attention)
        self.cos, self.sin = self._to_device(host_cos), self._to_device(host_sin)
        self.long_cos = self.long_sin = None
        self._long: tuple[np.ndarray, float] | None = None
        if entry.length_dependent == "switch":
            long_freq, long_attention = self._frequencies(seq_len=self.original_len + 1)
            self._long = (long_freq, long_attention)
            long_cos, long_sin = self._host_rows(
                np.arange(config.max_seq_len), long_freq, long_attention
            )
            self.long_cos, self.long_sin = self._to_device(long_cos), self._to_device(long_sin)

    # ------------------------------------------------------------------ frequencies
    def _frequencies(self, seq_len: int | None) -> tuple[np.ndarray, float]:
        params = dict(self._params)
        if seq_len is not None:
            params["seq_len"] = int(seq_len)
        cfg = self.config
        inv_freq, attention = self._entry.fn(
            cfg.head_dim, cfg.rotated_dim, float(cfg.base), cfg.max_seq_len, params
        )
        inv_freq = np.asarray(inv_freq, dtype=np.float64)
        allowed = sorted({cfg.rotated_dim // 2, cfg.head_dim // 2})
        if inv_freq.ndim != 1 or inv_freq.shape[0] not in allowed:
            # another count would pair the half layout's channels wrongly, in silence
            raise ValueError(
                f"rope_type {cfg.rope_type!r} returned inv_freq of shape {inv_freq.shape}; "
                f"expected [rotated_dim // 2] or [head_dim // 2], i.e. one of {allowed}"
            )
        if not np.all(np.isfinite(inv_freq)) or not np.isfinite(attention):
            raise ValueError(f"rope_type {cfg.rope_type!r} returned non-finite frequencies")
        return inv_freq, float(attention)

    @staticmethod
    def _host_rows(
        positions: np.ndarray,
        inv_freq: np.ndarray,
        attention: float,
        axes: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin float32 ``positions.shape + [n_freq]`` (with ``axes``: positions ``[3, ...]``
        and shape ``positions.shape[1:] + [n_freq]``, frequency ``j`` at ``positions[axes[j]]``)."""
        shape = np.shape(positions) if axes is None else np.shape(positions)[1:]
        by_axis = np.asarray(positions, dtype=np.float64).reshape(1 if axes is None else 3, -1)
        n_rows = int(np.prod(shape, dtype=np.int64))
        cos = np.empty((n_rows, inv_freq.size), dtype=np.float32)
        sin = np.empty_like(cos)
        for start in range(0, n_rows, _ROWS_PER_CHUNK):
            stop = min(start + _ROWS_PER_CHUNK, n_rows)
            if axes is None:
                angles = np.multiply.outer(by_axis[0, start:stop], inv_freq)
            else:  # [rows, n_freq]: each frequency at the position of its axis
                angles = by_axis[axes, start:stop].T * inv_freq
            cos[start:stop] = np.cos(angles) * attention
            sin[start:stop] = np.sin(angles) * attention
        return cos.reshape((*shape, inv_freq.size)), sin.reshape((*shape, inv_freq.size))

    def _to_device(self, host: np.ndarray) -> Any:
        if self.device_id.device_type is DeviceType.CPU:
            return host
        from mila_py.devices.cuda import shared_context

        ctx = shared_context(self.device_id)
        array = ctx.to_device(host)
        ctx.synchronize()  # every stream may read the table from now on
        return array

    # ------------------------------------------------------------------ lookups
    @property
    def per_length(self) -> bool:
        """True for types with new frequencies for every length past the original (dynamic)."""
        return self._entry.length_dependent == "per_length"

    @property
    def static_len(self) -> int:
        """Every call of ``seq_len <=`` this reads :attr:`cos` and :attr:`sin` (a call whose
        positions all lie below it): the original context where a longer call takes LongRoPE's
        long tables or rows of its own (length-dependent types), else ``max_seq_len``."""
        if self.per_length or self.long_cos is not None:
            return min(self.original_len, self.config.max_seq_len)
        return self.config.max_seq_len

    def tables_for(self, seq_len: int) -> tuple[Any, Any] | None:
        """The ``(cos, sin)`` tables for a call whose largest position is ``seq_len - 1``.

        Returns None when the type needs rows computed for this length (see :meth:`rows`).
        """
        if seq_len > self.original_len:
            if self.long_cos is not None:
                return self.long_cos, self.long_sin
            if self.per_length:
                return None
        return self.cos, self.sin

    def rows(
        self, positions: np.ndarray, seq_len: int, axes: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Host float32 cos/sin ``positions.shape + [n_freq]`` for a call of length ``seq_len``,
        equal to the table rows where a table applies.

        Used for length-dependent types past the original context, where no table fits, and for
        M-RoPE where a path cannot pick each frequency's row itself; a GPU op uploads them on
        its own stream.

        Args:
            positions: ints; with ``axes``, ``[3, ...]`` positions of the M-RoPE axes (the rows
                then have shape ``positions.shape[1:] + [n_freq]``).
            seq_len: ``max(positions) + 1`` of the call.
            axes: the position axis of each frequency (:meth:`RopeConfig.mrope_axes`), or None.
        """
        inv_freq, attention = self.frequencies(seq_len)
        index = None if axes is None else np.asarray(axes, dtype=np.intp)
        return self._host_rows(positions, inv_freq, attention, index)

    def call_rows(
        self,
        shape: tuple[int, int],
        offset: int,
        positions: np.ndarray | None,
        seq_len: int,
        axes: Any = None,
    ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
        """:meth:`rows` for every token of a call ``[B, T]``, and what indexes them instead of
        the call's own positions: ``(cos, sin, offset, positions)``.

        Without ``positions`` the rows are those of ``offset .. offset + T - 1``, indexed by
        ``t`` (offset 0). With ``positions`` (``[B, T]``, or ``[3, B, T]`` with ``axes``, both
        broadcastable) they are one row per token, indexed by ``arange(B * T)`` as ``[B, T]``.
        """
        n_b, n_t = shape
        if positions is None:
            cos, sin = self.rows(np.arange(offset, offset + n_t), seq_len)
            return cos, sin, 0, None
        lead = () if axes is None else (3,)
        wanted = np.broadcast_to(positions, (*lead, n_b, n_t)).reshape(*lead, -1)
        cos, sin = self.rows(wanted, seq_len, axes)
        return cos, sin, 0, np.arange(n_b * n_t, dtype=np.int64).reshape(n_b, n_t)

    def frequencies(self, seq_len: int | None = None) -> tuple[np.ndarray, float]:
        """``(inv_freq float64, attention_scaling)`` in effect for a call of length ``seq_len``."""
        if seq_len is None or seq_len <= self.original_len:
            return self.inv_freq, self.attention_scaling
        if self._long is not None:
            return self._long
        return (
            self._frequencies(seq_len)
            if self.per_length
            else (self.inv_freq, self.attention_scaling)
        )

    def arrays(self) -> list[Any]:
        """Every table array (state memory); the float64 frequency vectors (``n_freq`` values,
        host bookkeeping) are not counted."""
        return [a for a in (self.cos, self.sin, self.long_cos, self.long_sin) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"RopeTable({cfg.rope_type}, head_dim={cfg.head_dim}, n_freq={self.n_freq}, "
            f"max_seq_len={cfg.max_seq_len}, base={cfg.base}, {self.device_id}, "
            f"{self.nbytes} bytes)"
        )


_CACHE: weakref.WeakValueDictionary[tuple[Any, ...], RopeTable] = weakref.WeakValueDictionary()
_CACHE_LOCK = threading.Lock()


def get_rope(config: RopeConfig, device: DeviceLike = "CPU") -> RopeTable:
    """The shared :class:`RopeTable` for ``config`` on ``device`` (thread-safe).

    One table exists per distinct table configuration (head_dim, rotated dims, base, max_seq_len,
    scaling) and device while anything holds it; later calls return the same object.

    Raises:
        TypeError: ``config`` is not a RopeConfig.
        ValueError: a scaling type returned unusable frequencies.
    """
    if not isinstance(config, RopeConfig):
        raise TypeError(f"get_rope: expected a RopeConfig, got {config!r}")
    device_id = DeviceId.parse(device)
    key = (config.rope_type_entry, *config.table_key(), device_id)
    with _CACHE_LOCK:
        table = _CACHE.get(key)
        if table is None:
            table = RopeTable(config, device_id)
            _CACHE[key] = table
        return table


def clear_rope_cache() -> None:
    """Forget cached tables (components that hold one keep it)."""
    with _CACHE_LOCK:
        _CACHE.clear()


def mrope_axes(config: RopeConfig, table: RopeTable) -> np.ndarray | None:
    """int64 ``[n_freq]``: the position axis of each frequency of an M-RoPE config (None
    otherwise), checked against the frequencies its scaling type gives.

    Raises:
        ValueError: ``mrope_section`` does not cover the table's frequencies.
    """
    if config.mrope_section is None:
        return None
    axes = np.asarray(config.mrope_axes(), dtype=np.int64)
    if axes.size != table.n_freq:
        raise ValueError(
            f"RopeConfig: mrope_section {list(config.mrope_section)} covers {axes.size} "
            f"frequencies, but rope_type {config.rope_type!r} gives {table.n_freq}"
        )
    return axes
