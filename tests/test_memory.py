"""mila_py.memory: MemoryStats, its arithmetic, counting rules and table rendering."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mila_py.memory import MemoryCategory, MemoryLocation, MemoryStats, format_bytes

FIELDS = [
    "device_parameter_bytes",
    "device_gradient_bytes",
    "device_state_bytes",
    "host_parameter_bytes",
    "host_gradient_bytes",
    "host_state_bytes",
]

P, G, S = MemoryCategory.PARAMETERS, MemoryCategory.GRADIENTS, MemoryCategory.STATE
DEV, HOST = MemoryLocation.DEVICE, MemoryLocation.HOST


def _stats(*values: int) -> MemoryStats:
    return MemoryStats(**dict(zip(FIELDS, values, strict=True)))


def test_fields_are_the_six_int_categories_defaulting_to_zero() -> None:
    assert [f.name for f in dataclasses.fields(MemoryStats)] == [*FIELDS, "dtype_bytes"]
    empty = MemoryStats()
    assert empty.by_dtype == {}
    for name in FIELDS:
        assert getattr(empty, name) == 0
        assert type(getattr(empty, name)) is int
    assert empty.total_bytes == 0


def test_is_frozen() -> None:
    stats = MemoryStats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.device_state_bytes = 5  # type: ignore[misc]


def test_numpy_integers_are_stored_as_python_ints() -> None:
    stats = MemoryStats(device_parameter_bytes=np.int64(12))
    assert stats.device_parameter_bytes == 12
    assert type(stats.device_parameter_bytes) is int


@pytest.mark.parametrize("value", [1.5, "3", None, True])
def test_non_int_fields_raise_type_error(value) -> None:
    with pytest.raises(TypeError):
        MemoryStats(device_state_bytes=value)


def test_negative_fields_raise_value_error() -> None:
    with pytest.raises(ValueError, match="host_gradient_bytes"):
        MemoryStats(host_gradient_bytes=-1)


def test_addition_is_fieldwise() -> None:
    a = _stats(1, 2, 3, 4, 5, 6)
    b = _stats(10, 20, 30, 40, 50, 60)
    total = a + b
    assert total == _stats(11, 22, 33, 44, 55, 66)
    assert b + a == total
    assert a + MemoryStats() == a
    assert a == _stats(1, 2, 3, 4, 5, 6)  # operands unchanged
    assert sum([a, b, a], MemoryStats()) == _stats(12, 24, 36, 48, 60, 72)
    assert sum([a, b, a]) == _stats(12, 24, 36, 48, 60, 72)  # from sum's start of 0


def test_adding_something_else_raises_type_error() -> None:
    with pytest.raises(TypeError):
        _ = MemoryStats() + 5  # type: ignore[operator]
    with pytest.raises(TypeError):
        _ = 5 + MemoryStats()  # type: ignore[operator]


def test_totals() -> None:
    s = _stats(1, 20, 300, 4000, 50000, 600000)
    assert s.device_total_bytes == 321
    assert s.host_total_bytes == 654000
    assert s.parameter_bytes == 4001
    assert s.gradient_bytes == 50020
    assert s.state_bytes == 600300
    assert s.total_bytes == 654321


def test_from_arrays_counts_nbytes_by_category_and_location() -> None:
    w = np.zeros((4, 8), np.float32)  # 128 B
    g = np.zeros((4, 8), np.float32)  # 128 B
    cache = np.zeros(10, np.float16)  # 20 B
    staging = np.zeros(3, np.float64)  # 24 B
    stats = MemoryStats.from_arrays(
        [(P, DEV, w), (G, DEV, g), (S, DEV, cache), (S, HOST, staging), (P, HOST, None)]
    )
    assert stats == MemoryStats(
        device_parameter_bytes=128,
        device_gradient_bytes=128,
        device_state_bytes=20,
        host_state_bytes=24,
    )


def test_from_arrays_counts_the_same_array_object_once() -> None:
    shared = np.zeros(100, np.float32)  # 400 B
    twin = np.zeros(100, np.float32)  # equal content, another buffer
    stats = MemoryStats.from_arrays([(S, DEV, shared), (S, DEV, shared), (S, DEV, twin)])
    assert stats.device_state_bytes == 800
    assert MemoryStats.from_arrays([]) == MemoryStats()


def test_from_arrays_counts_temporary_views_each_once() -> None:
    """Views made on the fly are freed as the count moves on; a freed view's id can be the
    next view's, which must still be counted."""
    base = np.zeros((8, 100), np.float32)
    stats = MemoryStats.from_arrays((S, DEV, base[i : i + 1]) for i in range(8))
    assert stats.device_state_bytes == 8 * 400


def test_str_is_an_aligned_table_with_human_units() -> None:
    s = MemoryStats(
        device_parameter_bytes=1536,
        device_gradient_bytes=3 * 1024**2,
        device_state_bytes=10,
        host_state_bytes=5 * 1024**3,
    )
    text = str(s)
    lines = text.splitlines()
    rows = [line for line in lines if line and set(line) != {"-"}]
    assert len(rows) == 5
    header, *body = rows
    assert header.split() == ["device", "host"]
    assert [row.split()[0] for row in body] == ["parameters", "gradients", "state", "total"]
    # Every row is the same width and the numbers are right-aligned under their headers.
    assert len({len(row) for row in rows}) == 1
    device_end = header.index("device") + len("device")
    for row in body:
        assert row[device_end - 1] != " "
        assert row.endswith("B")
    assert "1.50 KiB" in body[0]
    assert "3.00 MiB" in body[1]
    assert "10 B" in body[2]
    assert "5.00 GiB" in body[2]
    # 1536 + 3 MiB + 10 on the device: 3147274 B = 3.00 MiB; 5 GiB on the host.
    assert body[3].split()[1:] == ["3.00", "MiB", "5.00", "GiB"]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (10 * 1024 + 512, "10.50 KiB"),
        (1024**2, "1.00 MiB"),
        (1024**2 - 1, "1.00 MiB"),
        (int(2.25 * 1024**3), "2.25 GiB"),
        (1024**4, "1.00 TiB"),
        (4096 * 1024**4, "4096.00 TiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_never_prints_1024_of_a_unit() -> None:
    for n in (1024**2 - 1, 1024**3 - 1, 1024**4 - 1, 1024**2 - 3):
        value = float(format_bytes(n).split()[0])
        assert value < 1024, format_bytes(n)


def test_bytes_are_counted_by_dtype_too() -> None:
    """``from_arrays`` splits the same bytes by dtype (precision names for floats); sums merge
    them; ``str()`` lists them largest first; they take no part in ``==``."""
    import ml_dtypes

    stats = MemoryStats.from_arrays(
        [
            (P, DEV, np.zeros(10, ml_dtypes.bfloat16)),  # 20 B
            (G, DEV, np.zeros(10, np.float32)),  # 40 B
            (S, HOST, np.zeros(3, np.int64)),  # 24 B
            (S, DEV, np.zeros(2, np.float32)),  # 8 B
        ]
    )
    assert stats.by_dtype == {"BF16": 20, "FP32": 48, "int64": 24}
    assert sum(stats.by_dtype.values()) == stats.total_bytes
    assert (stats + stats).by_dtype == {"BF16": 40, "FP32": 96, "int64": 48}
    assert str(stats).splitlines()[-1] == "by dtype: FP32 48 B, int64 24 B, BF16 20 B"
    assert stats == dataclasses.replace(stats, dtype_bytes=())
    assert MemoryStats(dtype_bytes={"FP32": 4}).by_dtype == {"FP32": 4}
    with pytest.raises(ValueError, match="dtype_bytes"):
        MemoryStats(dtype_bytes={"FP32": -1})
    with pytest.raises(TypeError, match="dtype_bytes"):
        MemoryStats(dtype_bytes=[("FP32",)])  # type: ignore[list-item]
