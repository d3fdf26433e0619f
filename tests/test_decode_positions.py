"""A decode step's positions (:class:`~mila_py.ops.operation.DecodePositions`): the host array,
and on a device the int32 buffer the step's kernels read, written on the context's stream."""

from __future__ import annotations

from typing import Any

import numpy as np
from kernel_emulator import EmulatedContext

from mila_py.ops.operation import DecodePositions


def test_decode_positions_live_in_a_device_buffer_on_a_gpu() -> None:
    """A step's positions: on the CPU the host array alone; on a device also an int32 ``[B]``
    buffer of the context, allocated once and written by every ``set`` (CuPy: ``ndarray.set``
    on the context's stream, so the copy is ordered after the previous step's kernels)."""
    on_cpu = DecodePositions(3)
    on_cpu.set(np.array([4, 9, 2]), 2, 9)
    assert on_cpu.device is None
    np.testing.assert_array_equal(on_cpu.each, [4, 9, 2])
    assert (on_cpu.highest, on_cpu.uniform) == (9, False)

    emulated = EmulatedContext()
    positions = DecodePositions(3, emulated)
    buffer = positions.device
    assert buffer.dtype == np.int32 and buffer.shape == (3,)
    positions.set(np.array([4, 9, 2]), 2, 9)
    positions.set(7, 7, 7)
    assert positions.device is buffer and positions.uniform
    np.testing.assert_array_equal(buffer, [7, 7, 7])

    class DeviceArray:
        def __init__(self, shape: tuple[int, ...], dtype: Any) -> None:
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.writes: list[tuple[np.ndarray, Any]] = []

        def set(self, values: np.ndarray, stream: Any = None) -> None:
            assert values.shape == self.shape and values.dtype == self.dtype
            self.writes.append((values.copy(), stream))

    class Gpu(EmulatedContext):
        def allocate(self, shape: tuple[int, ...], dtype: Any, *, zero: bool = True) -> Any:
            return DeviceArray(shape, dtype)

    gpu = Gpu()
    gpu.xp, gpu.stream = object(), "the context's stream"  # CuPy's place: not NumPy
    on_gpu = DecodePositions(2, gpu)
    on_gpu.set(np.array([5, 3]), 3, 5)
    on_gpu.set(np.array([6, 4]), 4, 6)
    writes = on_gpu.device.writes
    assert [w[1] for w in writes] == [gpu.stream] * 2
    np.testing.assert_array_equal(writes[0][0], [5, 3])
    np.testing.assert_array_equal(writes[1][0], [6, 4])
