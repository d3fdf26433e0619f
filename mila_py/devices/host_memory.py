"""System memory this process can still take: what ``Component.build`` checks a CPU build
(and a GPU build's host buffers) against before it allocates.

The answer is the least of the kernel's ``MemAvailable`` and the room left under every memory
cgroup limit that applies to the process (a container's limit is usually far below the
machine's memory). Where none of them is readable (macOS, say), ``os.sysconf`` answers if it
can; otherwise the answer is None and no build is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["host_available_memory"]

_PROC = Path("/proc")
_CGROUP = Path("/sys/fs/cgroup")
#: cgroup v1 writes "no limit" as the largest page-aligned int64 (about 2**63); anything this
#: large is no limit
_NO_LIMIT = 2**62


def host_available_memory(*, proc: Path = _PROC, cgroup: Path = _CGROUP) -> int | None:
    """Bytes of system memory this process can allocate now, or None where it is unknown.

    Args:
        proc: where procfs is mounted (``meminfo`` and ``self/cgroup`` are read there).
        cgroup: where the cgroup file systems are mounted (v2 unified, or v1 with a
            ``memory`` folder).

    Returns:
        the least of ``MemAvailable`` and, for each memory cgroup limit over the process (its
        own cgroup and its ancestors), the limit minus the memory charged there that cannot be
        reclaimed (usage less the inactive file cache, which the kernel drops before it
        refuses an allocation); ``os.sysconf``'s available pages where none of these files is
        readable; None where that fails too.
    """
    found = (_meminfo_available(proc / "meminfo"), _cgroup_room(proc, cgroup))
    known = [n for n in found if n is not None]
    return min(known) if known else _sysconf_available()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _keyed(text: str | None, key: str) -> int | None:
    """The integer after ``key`` in a ``key value`` (or ``key: value``) listing."""
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[0] == key:
            try:
                return int(parts[1])
            except ValueError:
                return None
    return None


def _number(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:  # cgroup v2 "max": no limit
        return None


def _meminfo_available(path: Path) -> int | None:
    kib = _keyed(_read(path), "MemAvailable")
    return None if kib is None else kib * 1024


def _own_paths(proc: Path) -> tuple[str | None, str | None]:
    """The process's cgroup path in the v2 hierarchy and in v1's memory hierarchy."""
    unified = memory = None
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if fields[0] == "0" and fields[1] == "":
            unified = fields[2]
        elif "memory" in fields[1].split(","):
            memory = fields[2]
    return unified, memory


def _folders(root: Path, own: str | None) -> Iterator[Path]:
    """The process's cgroup folder under ``root`` and every ancestor up to ``root`` (only
    ``root`` where the process's path is not there: a container sees its own cgroup as the
    root of the mount)."""
    start = root / own.strip("/") if own else root
    if not start.is_dir():
        start = root
    folder = start
    while True:
        yield folder
        if folder == root or root not in folder.parents:
            return
        folder = folder.parent


def _cgroup_room(proc: Path, cgroup: Path) -> int | None:
    """The least room under the memory limits of the process's cgroups, None without one."""
    unified, memory = _own_paths(proc)
    rooms: list[int] = []
    if (cgroup / "cgroup.controllers").is_file():  # v2
        for folder in _folders(cgroup, unified):
            limit = _number(folder / "memory.max")
            usage = _number(folder / "memory.current")
            if limit is None or usage is None:
                continue
            inactive = _keyed(_read(folder / "memory.stat"), "inactive_file") or 0
            rooms.append(limit - max(usage - inactive, 0))
    elif (cgroup / "memory").is_dir():  # v1
        for folder in _folders(cgroup / "memory", memory):
            stat = _read(folder / "memory.stat")
            limits = [
                _number(folder / "memory.limit_in_bytes"),
                _keyed(stat, "hierarchical_memory_limit"),
            ]
            usage = _number(folder / "memory.usage_in_bytes")
            known = [n for n in limits if n is not None and n < _NO_LIMIT]
            if not known or usage is None:
                continue
            inactive = _keyed(stat, "total_inactive_file") or _keyed(stat, "inactive_file") or 0
            rooms.append(min(known) - max(usage - inactive, 0))
    return max(min(rooms), 0) if rooms else None


def _sysconf_available() -> int | None:
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # a platform without these names
        return None
    return pages * size if pages > 0 and size > 0 else None
