"""Device identifiers: the one place that turns ``"cuda:1"`` into a :class:`DeviceId`."""

from __future__ import annotations

import enum
import numbers
import re
from dataclasses import dataclass
from functools import total_ordering

__all__ = ["DeviceId", "DeviceLike", "DeviceType"]


class DeviceType(enum.Enum):
    """Kind of compute device an execution context runs on."""

    CPU = "CPU"
    CUDA = "CUDA"

    def __str__(self) -> str:
        return self.value


_ORDER = {DeviceType.CPU: 0, DeviceType.CUDA: 1}
_PATTERN = re.compile(r"^\s*(?P<type>[A-Za-z]+)\s*(?::\s*(?P<index>[0-9]+)\s*)?$")


@total_ordering
@dataclass(frozen=True)
class DeviceId:
    """A device: its type and index, e.g. ``DeviceId(DeviceType.CUDA, 1)`` printed ``"CUDA:1"``.

    Frozen, hashable and ordered (CPU before CUDA, then by index).
    """

    device_type: DeviceType
    index: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, DeviceType):
            raise TypeError(f"DeviceId: device_type must be a DeviceType, got {self.device_type!r}")
        if isinstance(self.index, bool) or not isinstance(self.index, numbers.Integral):
            raise TypeError(f"DeviceId: index must be an int, got {self.index!r}")
        object.__setattr__(self, "index", int(self.index))  # a NumPy integer, say
        if self.index < 0:
            raise ValueError(f"DeviceId: index must be >= 0, got {self.index}")
        if self.device_type is DeviceType.CPU and self.index != 0:
            raise ValueError(f"DeviceId: there is one CPU device (index 0), got CPU:{self.index}")

    @classmethod
    def parse(cls, spec: DeviceLike) -> DeviceId:
        """Parse ``"CPU"``, ``"cpu:0"``, ``"CUDA"``, ``"cuda:1"`` (any case) or pass a DeviceId through.

        Raises:
            ValueError: for malformed strings such as ``""``, ``"cuda:"``, ``"cuda:x"``, ``"tpu:0"``.
            TypeError: for anything that is neither a string nor a DeviceId.
        """
        if isinstance(spec, DeviceId):
            return spec
        if isinstance(spec, DeviceType):
            return cls(spec, 0)
        if not isinstance(spec, str):
            raise TypeError(f"device must be a str like 'CUDA:0' or a DeviceId, got {spec!r}")
        match = _PATTERN.match(spec)
        if match is None:
            raise ValueError(
                f"malformed device {spec!r}: expected 'CPU', 'CPU:0', 'CUDA' or 'CUDA:<index>'"
            )
        name = match.group("type").upper()
        try:
            device_type = DeviceType(name)
        except ValueError:
            raise ValueError(
                f"unknown device type {match.group('type')!r} in {spec!r}: expected CPU or CUDA"
            ) from None
        index = int(match.group("index")) if match.group("index") is not None else 0
        return cls(device_type, index)

    def __str__(self) -> str:
        return f"{self.device_type.value}:{self.index}"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, DeviceId):
            return NotImplemented
        return (_ORDER[self.device_type], self.index) < (_ORDER[other.device_type], other.index)


DeviceLike = str | DeviceId | DeviceType
