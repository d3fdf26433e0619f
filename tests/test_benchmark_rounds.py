"""The round-robin timing of ``benchmarks/rope_cuda.py``, with timers that replay given times.

The script's figures (mila_py's row times, each peer's, the decode rows' host wall time) are
timed once per round, every figure in turn, and each is the median over its rounds. These
tests check that machinery without a GPU: the order, the medians, failures, the table.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rope_cuda
from rope_cuda import HOST_WALL, Row, Timing, run_round, settle, table


class Replay:
    """A timer whose ``samples`` calls ``fn`` once and returns the next round's samples."""

    def __init__(self, rounds: list[list[float]], log: list[str], name: str) -> None:
        self.rounds, self.log, self.name = list(rounds), log, name

    def samples(self, fn: Any, *, calls: int, repeats: int) -> list[float]:
        self.log.append(self.name)
        fn()
        got = self.rounds.pop(0)
        assert len(got) == repeats
        return got


def test_every_round_times_each_figure_in_turn_from_a_moving_start() -> None:
    log: list[str] = []
    row = Row("forward", "fp32", 100)
    timings = [
        Timing(row, what, lambda: None, Replay([[1.0]] * 3, log, what or "mila"), calls=4)
        for what in ("", "Liger", "HF eager")
    ]
    for r in range(3):
        run_round(timings, repeats=1, first=r * len(timings) // 3)
    assert log == ["mila", "Liger", "HF eager", "Liger", "HF eager", "mila",
                   "HF eager", "mila", "Liger"]  # fmt: skip
    assert all(t.rounds == [1.0, 1.0, 1.0] for t in timings)


def test_a_figure_is_the_median_of_its_round_medians_so_a_slow_round_does_not_set_it() -> None:
    log: list[str] = []
    row = Row("decode B=1 (pos int)", "fp32", 1000)
    mine = [[2.0, 3.0, 100.0], [3.0, 3.0, 3.0], [40.0, 50.0, 60.0]]  # round medians 3, 3, 50
    peer = [[9.0] * 3, [12.0] * 3, [6.0] * 3]
    host = [[4.0] * 3, [5.0] * 3, [7.0] * 3]
    timings = [
        Timing(row, "", lambda: None, Replay(mine, log, "mila"), calls=1),
        Timing(row, "Liger", lambda: None, Replay(peer, log, "peer"), calls=1),
        Timing(row, HOST_WALL, lambda: None, Replay(host, log, "host"), calls=1),
    ]
    for r in range(3):
        run_round(timings, repeats=3, first=r)
    settle(timings)
    assert row.seconds == 3.0
    assert row.spread == pytest.approx(50.0 / 3.0 - 1)
    assert row.peers == {"Liger": 9.0}
    assert row.host_wall == 5.0


def test_a_figure_that_raises_is_noted_and_left_out_of_later_rounds() -> None:
    log: list[str] = []
    row = Row("forward", "bf16", 100)

    def boom() -> None:
        raise MemoryError("out of device memory")

    timings = [
        Timing(row, "", lambda: None, Replay([[1.0]] * 2, log, "mila"), calls=1),
        Timing(row, "Liger", boom, Replay([[1.0]] * 2, log, "peer"), calls=1),
    ]
    for _ in range(2):
        run_round(timings, repeats=1, first=0)
    settle(timings)
    assert log == ["mila", "peer", "mila"]
    assert timings[1].failed == "MemoryError" and "Liger failed: MemoryError" in row.note
    assert row.seconds == 1.0 and "Liger" not in row.peers


def test_the_table_gives_ratios_to_the_copy_and_the_peers_and_dashes_for_what_is_missing() -> None:
    copy = Row("copy 1 GiB (ceiling)", "-", 2_000, seconds=1e-6)  # 2 GB/s
    fwd = Row("forward B=1 T=8192", "fp32", 1_000, seconds=1e-6, peers={"Liger": 3e-6},
              spread=0.05)  # fmt: skip
    dec = Row("decode B=1 (pos int)", "fp32", 10, host_wall=7.5e-6)  # not timed yet
    text = table([copy, fwd, dec], ["Liger", "HF eager"])
    lines = text.splitlines()
    assert lines[0].startswith("copy ceiling: 2 GB/s")
    fwd_line = next(line for line in lines if line.startswith("forward"))
    assert "50.0%" in fwd_line and "5.0%" in fwd_line  # half the copy's bandwidth; spread
    assert fwd_line.split()[-2:] == ["3.00", "-"]  # Liger 3x slower; HF eager not timed
    dec_line = next(line for line in lines if line.startswith("decode"))
    assert "nan" not in text and "host wall 7.5 us/call" in dec_line
    assert math.isnan(dec.seconds) and dec_line.split()[5:10] == ["-"] * 5  # time .. Liger


def test_the_script_without_a_gpu_says_so_and_exits_0(monkeypatch, capsys) -> None:
    monkeypatch.setattr(rope_cuda, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["rope_cuda.py", "--quick"])
    assert rope_cuda.main() == 0
    assert "no CUDA GPU" in capsys.readouterr().out


def test_the_whole_script_runs_its_rounds_on_the_emulated_gpu(
    library, monkeypatch, tmp_path, capsys
) -> None:
    """``main()`` end to end at its ``--quick`` sizes on ``CUDA:0`` emulated (kernels run on
    the CPU; host timers stand in for CUDA events, a small host copy for the ceiling): every
    row is timed in both rounds and the table and JSON come out, so a GPU call is not spent on
    finding a slip in the script."""
    import json
    import types

    import numpy as np
    from kernel_emulator import emulated_cuda_devices

    class HostEvents(rope_cuda.HostTimer):  # CupyTimer(cupy, stream) on the emulated context
        def __init__(self, cupy: Any, stream: Any) -> None:
            super().__init__(lambda: None)

    def copy_ceiling(cupy: Any) -> Any:
        src = np.arange(1 << 16, dtype=np.float32)
        dst = np.empty_like(src)
        return (Row("copy 1 GiB (ceiling)", "-", 2 * src.nbytes),
                lambda: np.copyto(dst, src), HostEvents(None, None))  # fmt: skip

    fake_cupy = types.SimpleNamespace(
        __version__="emulated",
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"emulated"})
        ),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(rope_cuda, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(rope_cuda, "CupyTimer", HostEvents)
    monkeypatch.setattr(rope_cuda, "copy_ceiling", copy_ceiling)
    monkeypatch.setattr(rope_cuda, "warm_up", lambda fn, sync, seconds=0.0: fn())
    out = tmp_path / "rope.json"
    argv = ["rope_cuda.py", "--quick", "--no-peers", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with emulated_cuda_devices(library):
        assert rope_cuda.main() == 0
    text = capsys.readouterr().out
    assert "after round 2 of 2" in text and "decode B=64 (pos per seq)" in text
    payload = json.loads(out.read_text())
    cases = {(r["case"], r["dtype"]) for r in payload["rows"]}
    assert ("forward B=2 T=128", "bf16") in cases and ("M-RoPE rotate B=1 T=256", "fp32") in cases
    assert all(not math.isnan(r["seconds"]) and r["seconds"] > 0 for r in payload["rows"])
    decode = [r for r in payload["rows"] if r["case"].startswith("decode")]
    assert len(decode) == 6 and all(r["host_wall"] > 0 for r in decode)
    assert all(len(f["seconds_per_round"]) == 2 and not f["failed"] for f in payload["figures"])


def test_each_timed_run_starts_after_an_untimed_lead_call() -> None:
    """CupyTimer and TorchTimer record ``start`` only once a lead call has queued its work, so
    the first timed call's host work is not timed as GPU idle time; the run's per-call figure
    divides by the timed calls only."""
    import types

    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = True) -> None:
            self.at = 0.0

        def record(self, stream: Any = None) -> None:
            self.at = float(log.count("call"))  # "milliseconds": the calls queued so far
            log.append("record")

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: Event) -> float:
            return end.at - self.at

    stream = types.SimpleNamespace(synchronize=lambda: None)
    fake_cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            Event=Event, get_elapsed_time=lambda start, end: end.at - start.at
        )
    )
    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: None)
    )
    timers = [rope_cuda.CupyTimer(fake_cupy, stream), rope_cuda.TorchTimer(fake_torch)]
    for timer in timers:
        log.clear()
        got = timer.samples(lambda: log.append("call"), calls=4, repeats=2)
        timed = log[log.index("record") - 1 :]  # the warm-up's calls come first
        assert timed == ["call", "record", *["call"] * 4, "record"] * 2
        assert got == [pytest.approx(4 / 1e3 / 4)] * 2  # 4 "ms" over the 4 timed calls
