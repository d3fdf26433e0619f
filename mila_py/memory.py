"""MemoryStats and every rule for counting bytes.

Bytes are counted from the arrays components own (``nbytes``), never from allocator pools. An
array reachable from several components (the shared RoPE table) is counted once in an aggregate.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["MemoryCategory", "MemoryLocation", "MemoryStats", "format_bytes"]


class MemoryCategory(enum.Enum):
    PARAMETERS = "parameter"
    GRADIENTS = "gradient"
    STATE = "state"


class MemoryLocation(enum.Enum):
    DEVICE = "device"  # the compute device's memory: system RAM for the CPU
    HOST = "host"  # host-side buffers a device component keeps (staging, pinned)


@dataclass(frozen=True)
class MemoryStats:
    """Bytes by category on the compute device and on the host."""

    device_parameter_bytes: int = 0
    device_gradient_bytes: int = 0
    device_state_bytes: int = 0
    host_parameter_bytes: int = 0
    host_gradient_bytes: int = 0
    host_state_bytes: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"MemoryStats.{f.name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"MemoryStats.{f.name} must be >= 0, got {value}")
            object.__setattr__(self, f.name, int(value))

    @classmethod
    def from_arrays(
        cls, entries: Iterable[tuple[MemoryCategory, MemoryLocation, Any]]
    ) -> MemoryStats:
        """Count ``(category, location, array)`` entries, each distinct array object once."""
        seen: dict[int, Any] = {}  # holds each array, so a freed one's id cannot come back
        totals: dict[str, int] = {}
        for category, location, array in entries:
            if array is None or id(array) in seen:
                continue
            seen[id(array)] = array
            key = f"{location.value}_{category.value}_bytes"
            totals[key] = totals.get(key, 0) + int(array.nbytes)
        return cls(**totals)

    def __add__(self, other: MemoryStats) -> MemoryStats:
        if not isinstance(other, MemoryStats):
            return NotImplemented
        return MemoryStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
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
