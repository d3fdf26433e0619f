"""The helpers of ``benchmarks/generate.py`` that need no model: how many greedy tokens two
runs agree on, and the check of the 1B shape's BF16 targets from the table's rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from generate import Row, agreement, target_checks

from mila_py import Precision


def test_agreement_is_the_prefix_equal_in_every_sequence() -> None:
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert agreement(a, a.copy()) == 4
    b = a.copy()
    b[1, 2] = 0  # the second sequence parts at its third token
    b[0, 3] = 0
    assert agreement(a, b) == 2
    b[0, 0] = 9
    assert agreement(a, b) == 0


def _row(
    batch: int, precision: Precision = Precision.BF16, model: str = "1B", **seconds: float
) -> Row:
    times = {
        "prefill_mila": 1.0,
        "prefill_hf": 1.0,
        "decode_mila": 1.0,
        "floor": 1.0,
        "decode_hf": 1.0,
    }
    return Row(model, precision, batch, **{**times, **seconds}, decode_fp32=None, agree=0)


def test_targets_are_checked_from_the_rows_they_concern() -> None:
    rows = [
        _row(1, decode_mila=1.4e-3, floor=1.0e-3),  # 1.4x the floor: met
        _row(8, prefill_mila=0.9, prefill_hf=1.0, decode_mila=1.0, decode_hf=1.9),
    ]
    checks = target_checks(rows, prompt=512)
    assert [met for _, met in checks] == [True, True, False]  # prefill, floor, decode vs HF
    assert "prefill B=8" in checks[0][0] and "1.11" in checks[0][0]
    assert "decode B=1" in checks[1][0] and "1.40" in checks[1][0]
    assert "decode B=8" in checks[2][0] and "1.90" in checks[2][0]


def test_targets_need_the_1b_bf16_rows_and_the_512_token_prompt_for_prefill() -> None:
    assert target_checks([_row(1, model="~10M"), _row(8, precision=Precision.FP32)], 512) == []
    checks = target_checks(
        [_row(8, prefill_mila=2.0, decode_hf=2.5), _row(1, decode_mila=2.0)], prompt=256
    )
    assert [text.split(":")[0] for text, _ in checks] == ["decode B=1", "decode B=8"]
    assert [met for _, met in checks] == [False, True]  # 2x the floor; 2.5x HF's decode
