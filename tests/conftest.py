"""Shared fixtures: the ``device`` every device-generic case runs on."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mila_py.devices.cuda import cuda_device_count

HAS_CUDA = cuda_device_count() > 0
NO_CUDA_REASON = "no CUDA GPU / CuPy"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)


@pytest.fixture(
    params=[
        "CPU",
        pytest.param("CUDA:0", marks=[pytest.mark.cuda, requires_cuda]),
    ]
)
def device(request: pytest.FixtureRequest) -> str:
    """``"CPU"`` always, ``"CUDA:0"`` when CuPy sees a GPU (otherwise skipped with the reason)."""
    return request.param


def to_numpy(array: Any) -> np.ndarray:
    """The NumPy view of a NumPy array, or a host copy of a CuPy array (which has ``.get()``)."""
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)
    return np.asarray(get() if callable(get) else array)


@pytest.fixture
def host():
    """``host(array)`` -> NumPy array, whichever device the array lives on."""
    return to_numpy
