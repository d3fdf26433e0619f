"""MemoryStats and every rule for counting bytes.

Bytes are counted from the arrays components own (``nbytes``), never from allocator pools. An
array reachable from several components (the shared RoPE table) is counted once in an aggregate.
Each count is also split by the arrays' dtypes (``MemoryStats.by_dtype``): a BF16 network's
parameters and activations are BF16 bytes, its gradient buffers and norm statistics FP32.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MemoryCategory", "MemoryLocation", "MemoryStats", "format_bytes"]


class MemoryCategory(enum.Enum):
    PARAMETERS = "parameter"
    GRADIENTS = "gradient"
    STATE = "state"


class MemoryLocation(enum.Enum):
    DEVICE = "device"  # the compute device's memory: system RAM for the CPU
    HOST = "host"  # host-side buffers a device component keeps (staging, pinned)


#: the fields of MemoryStats that count bytes by category and location
_COUNTS = (
    "device_parameter_bytes",
    "device_gradient_bytes",
    "device_state_bytes",
    "host_parameter_bytes",
    "host_gradient_bytes",
    "host_state_bytes",
)


def dtype_name(dtype: Any) -> str:
    """The name bytes of ``dtype`` are counted under: the precision's (``"BF16"``, ``"FP32"``,
    ...) for float dtypes, else NumPy's (``"int64"``)."""
    from mila_py.precision import Precision

    try:
        return str(Precision.from_dtype(dtype))
    except TypeError:
        return np.dtype(dtype).name


@dataclass(frozen=True)
class MemoryStats:
    """Bytes by category on the compute device and on the host, and the same bytes by dtype.

    ``dtype_bytes``: ``(dtype name, bytes)`` pairs over every category and location (see
    :func:`dtype_name`; a mapping is accepted too), kept sorted by name; :attr:`by_dtype` reads
    them as a dict. They describe the same arrays as the six counts and take no part in
    ``==`` (stats made from counts alone have none).
    """

    device_parameter_bytes: int = 0
    device_gradient_bytes: int = 0
    device_state_bytes: int = 0
    host_parameter_bytes: int = 0
    host_gradient_bytes: int = 0
    host_state_bytes: int = 0
    dtype_bytes: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"MemoryStats.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"MemoryStats.{name} must be >= 0, got {value}")
            object.__setattr__(self, name, int(value))
        pairs = self.dtype_bytes
        items = pairs.items() if isinstance(pairs, Mapping) else pairs
        merged: dict[str, int] = {}
        for pair in items:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(
                    f"MemoryStats.dtype_bytes must hold (dtype name, bytes) pairs, got {pair!r}"
                )
            key, value = pair
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(
                    f"MemoryStats.dtype_bytes[{key!r}] must be an int >= 0, got {value!r}"
                )
            merged[key] = merged.get(key, 0) + int(value)
        object.__setattr__(self, "dtype_bytes", tuple(sorted(merged.items())))

    @property
    def by_dtype(self) -> dict[str, int]:
        """``{dtype name: bytes}`` over every category and location (empty for stats made from
        counts alone)."""
        return dict(self.dtype_bytes)

    @classmethod
    def from_arrays(
        cls, entries: Iterable[tuple[MemoryCategory, MemoryLocation, Any]]
    ) -> MemoryStats:
        """Count ``(category, location, array)`` entries, each distinct array object once."""
        seen: dict[int, Any] = {}  # holds each array, so a freed one's id cannot come back
        totals: dict[str, int] = {}
        by_dtype: dict[str, int] = {}
        for category, location, array in entries:
            if array is None or id(array) in seen:
                continue
            seen[id(array)] = array
            key = f"{location.value}_{category.value}_bytes"
            totals[key] = totals.get(key, 0) + int(array.nbytes)
            name = dtype_name(array.dtype)
            by_dtype[name] = by_dtype.get(name, 0) + int(array.nbytes)
        return cls(**totals, dtype_bytes=tuple(by_dtype.items()))

    def __add__(self, other: MemoryStats) -> MemoryStats:
        if not isinstance(other, MemoryStats):
            return NotImplemented
        return MemoryStats(
            **{name: getattr(self, name) + getattr(other, name) for name in _COUNTS},
            dtype_bytes=self.dtype_bytes + other.dtype_bytes,
        )

    def __radd__(self, other: object) -> MemoryStats:
        """``0 + stats`` is ``stats``, so ``sum(list_of_stats)`` works. (Sums add what each
        one counted: a buffer two networks share appears in both.)"""
        if other == 0:
            return self
        return NotImplemented

    @property
    def device_total_bytes(self) -> int:
        return self.device_parameter_bytes + self.device_gradient_bytes + self.device_state_bytes

    @property
    def host_total_bytes(self) -> int:
        return self.host_parameter_bytes + self.host_gradient_bytes + self.host_state_bytes

    @property
    def parameter_bytes(self) -> int:
        return self.device_parameter_bytes + self.host_parameter_bytes

    @property
    def gradient_bytes(self) -> int:
        return self.device_gradient_bytes + self.host_gradient_bytes

    @property
    def state_bytes(self) -> int:
        return self.device_state_bytes + self.host_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.device_total_bytes + self.host_total_bytes

    def __str__(self) -> str:
        rows = [
            ("parameters", self.device_parameter_bytes, self.host_parameter_bytes),
            ("gradients", self.device_gradient_bytes, self.host_gradient_bytes),
            ("state", self.device_state_bytes, self.host_state_bytes),
            ("total", self.device_total_bytes, self.host_total_bytes),
        ]
        cells = [("", "device", "host")] + [
            (name, format_bytes(dev), format_bytes(host)) for name, dev, host in rows
        ]
        widths = [max(len(row[i]) for row in cells) for i in range(3)]
        lines = []
        for i, row in enumerate(cells):
            lines.append(
                f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}".rstrip()
            )
            if i == 0 or i == len(rows) - 1:
                lines.append("-" * (sum(widths) + 4))
        if self.dtype_bytes:  # largest first
            ordered = sorted(self.dtype_bytes, key=lambda pair: (-pair[1], pair[0]))
            lines.append(
                "by dtype: " + ", ".join(f"{name} {format_bytes(n)}" for name, n in ordered)
            )
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """Human units with binary prefixes: ``format_bytes(1536) == '1.50 KiB'``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        # Compare the rounded value, so 1048575 B prints "1.00 MiB", never "1024.00 KiB".
        if round(value, 2) < 1024.0 or unit == "TiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
