"""mila_py.devices.host_memory: MemAvailable within the process's cgroup limits, read from
fake procfs and cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mila_py.devices import host_memory
from mila_py.devices.host_memory import host_available_memory

MIB = 1 << 20


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc(tmp_path: Path, available_kib: int | None, cgroup_lines: str = "") -> Path:
    root = tmp_path / "proc"
    meminfo = "MemTotal:       24684092 kB\nMemFree:         1000000 kB\n"
    if available_kib is not None:
        meminfo += f"MemAvailable:   {available_kib} kB\n"
    write(root / "meminfo", meminfo + "Buffers:          123456 kB\n")
    write(root / "self" / "cgroup", cgroup_lines)
    return root


def cgroup_v2(tmp_path: Path, folders: dict[str, tuple[str, int, int]]) -> Path:
    """A unified hierarchy: ``{path: (memory.max, memory.current, inactive_file)}``."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory pids\n")
    for path, (limit, current, inactive) in folders.items():
        folder = root / path
        write(folder / "memory.max", f"{limit}\n")
        write(folder / "memory.current", f"{current}\n")
        write(folder / "memory.stat", f"anon 1\nactive_file 7\ninactive_file {inactive}\n")
    return root


def cgroup_v1(tmp_path: Path, folders: dict[str, tuple[int, int, int]]) -> Path:
    """A v1 memory hierarchy: ``{path: (limit_in_bytes, usage_in_bytes, total_inactive_file)}``."""
    root = tmp_path / "cgroup"
    for path, (limit, usage, inactive) in folders.items():
        folder = root / "memory" / path
        write(folder / "memory.limit_in_bytes", f"{limit}\n")
        write(folder / "memory.usage_in_bytes", f"{usage}\n")
        write(
            folder / "memory.stat",
            f"cache 5\ninactive_file 1\nhierarchical_memory_limit {limit}\n"
            f"total_inactive_file {inactive}\n",
        )
    return root


def test_mem_available_alone(tmp_path: Path) -> None:
    assert host_available_memory(proc=proc(tmp_path, 2048), cgroup=tmp_path / "none") == (
        2048 * 1024
    )


def test_cgroup_v2_limits_of_the_process_and_its_ancestors(tmp_path: Path) -> None:
    root = cgroup_v2(
        tmp_path,
        {
            "": ("max", 900 * MIB, 0),  # the root: no limit
            "jobs": (str(1000 * MIB), 700 * MIB, 100 * MIB),  # 1000 - (700 - 100) = 400
            "jobs/mine": (str(800 * MIB), 300 * MIB, 50 * MIB),  # 800 - 250 = 550
        },
    )
    lines = "12:memory:/ignored\n0::/jobs/mine\n"
    assert host_available_memory(proc=proc(tmp_path, 4096 * 1024, lines), cgroup=root) == (
        400 * MIB
    )
    # MemAvailable below every cgroup's room wins
    assert host_available_memory(proc=proc(tmp_path, 1024, lines), cgroup=root) == 1024 * 1024


def test_cgroup_v2_without_a_limit_is_mem_available(tmp_path: Path) -> None:
    root = cgroup_v2(tmp_path, {"": ("max", 900 * MIB, 0)})
    assert host_available_memory(proc=proc(tmp_path, 4096, "0::/\n"), cgroup=root) == 4096 * 1024


def test_a_container_sees_its_own_cgroup_at_the_root(tmp_path: Path) -> None:
    """The process's path is not under the mount (a cgroup namespace): the root's limit
    applies."""
    root = cgroup_v2(tmp_path, {"": (str(512 * MIB), 100 * MIB, 0)})
    paths = proc(tmp_path, 4096 * 1024, "0::/kubepods/pod1/c1\n")
    assert host_available_memory(proc=paths, cgroup=root) == 412 * MIB


def test_cgroup_v1_limit_less_usage_that_cannot_be_reclaimed(tmp_path: Path) -> None:
    no_limit = 9223372036854771712
    root = cgroup_v1(
        tmp_path,
        {
            "": (no_limit, 2000 * MIB, 0),
            "svc/one": (600 * MIB, 350 * MIB, 150 * MIB),  # 600 - 200 = 400
        },
    )
    lines = "5:cpu,cpuacct:/svc/one\n4:memory:/svc/one\n0::/\n"
    assert host_available_memory(proc=proc(tmp_path, 4096 * 1024, lines), cgroup=root) == (
        400 * MIB
    )
    unlimited = cgroup_v1(tmp_path / "other", {"": (no_limit, 10 * MIB, 0)})
    assert host_available_memory(proc=proc(tmp_path, 4096, "4:memory:/\n"), cgroup=unlimited) == (
        4096 * 1024
    )


def test_usage_over_the_limit_leaves_no_room(tmp_path: Path) -> None:
    root = cgroup_v2(tmp_path, {"": (str(100 * MIB), 150 * MIB, 0)})
    assert host_available_memory(proc=proc(tmp_path, 4096, "0::/\n"), cgroup=root) == 0


def test_without_procfs_or_cgroups_sysconf_answers_or_nothing_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    nowhere = tmp_path / "nowhere"
    assert host_available_memory(proc=nowhere, cgroup=nowhere) == 4096 * 1000

    def unknown(name: str) -> int:  # a platform that has no such names
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", unknown)
    assert host_available_memory(proc=nowhere, cgroup=nowhere) is None
    # a meminfo without MemAvailable (an old kernel) and no cgroup is no answer either
    monkeypatch.setattr(host_memory, "_sysconf_available", lambda: None)
    assert host_available_memory(proc=proc(tmp_path, None), cgroup=nowhere) is None


def test_this_machine_answers_something_plausible() -> None:
    """On Linux the real files are read: a positive number of bytes."""
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo")
    found = host_available_memory()
    assert found is not None and found > 0
