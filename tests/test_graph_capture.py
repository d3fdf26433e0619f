"""``mila_py.devices.graph.capture`` on every device (``device``): the CPU runs a step's calls
eagerly every time; a ``CUDA:0`` (a GPU, or the kernel emulator's stream, which captures as a
GPU does) runs them once, captures them, and replays the graph, which reads its arrays' current
values, and refuses a call that allocates while it is captured."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_arrays import cupy, host

from mila_py import devices
from mila_py.devices.graph import capture


def test_a_step_replays_on_new_inputs_and_a_captured_one_refuses_allocations(device: str) -> None:
    on_cpu = device == "CPU"
    xp = np if on_cpu else cupy
    ctx = devices.create_execution_context(device)
    with ctx.activate():
        a, c = xp.ones(4, dtype=xp.float32), xp.zeros(4, dtype=xp.float32)
        step = capture(ctx, [lambda: xp.multiply(a, 2, out=c), lambda: xp.add(c, a, out=c)])
        step()
        assert step.eager is on_cpu and (step.graph is None) is on_cpu
        assert step.captures == (0 if on_cpu else 1)
        np.testing.assert_array_equal(host(c), [3] * 4)
        xp.copyto(a, xp.full(4, 5, dtype=xp.float32))
        step()
        np.testing.assert_array_equal(host(c), [15] * 4)
        assert step.captures == (0 if on_cpu else 1)  # captured once, replayed after
        failing = capture(ctx, [lambda: xp.multiply(a, 2)])  # a new array for the result
        if on_cpu:  # nothing is captured: the call runs
            failing()
        else:  # CuPy's allocator refuses (the emulator's too), and the stream can capture again
            with pytest.raises(RuntimeError):
                failing()
            assert not ctx.stream.is_capturing()
        assert failing.graph is None
        step()
        np.testing.assert_array_equal(host(c), [15] * 4)
