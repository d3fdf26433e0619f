"""Shared fixtures: the ``device`` every device-generic case runs on (the CPU, and ``CUDA:0`` on a
GPU or on the kernel emulator), ``cuda_device`` / ``cuda_ctx`` for the checks of CUDA against
the CPU, and the kernel emulator's library."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mila_py.devices.cuda import cuda_device_count

# transformers must never reach the Hub from a test: some config classes of older releases fetch a
# sub-config (a timm backbone) and retry for ~50 s without a network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HAS_CUDA = cuda_device_count() > 0
NO_CUDA_REASON = "no CUDA GPU / CuPy"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON)


def _emulator_skip_reason() -> str | None:
    """Why the emulated ``CUDA:0`` does not run here, or None where it does."""
    if HAS_CUDA:
        return "a real GPU is present: CUDA:0 runs on it instead of the kernel emulator"
    if shutil.which("g++") is None:
        return "the kernel emulator's CUDA:0 needs g++"
    return None


EMULATOR_SKIP_REASON = _emulator_skip_reason()

#: the ``CUDA:0`` s a test can run on: CuPy's on a GPU, or the kernel emulator's (its CUDA ops'
#: own kernels compiled with g++, NumPy arrays) on a machine without one; at most one is present
CUDA_PARAMS = [
    pytest.param("CUDA:0", id="CUDA:0", marks=[pytest.mark.cuda, requires_cuda]),
    pytest.param(
        "emulated-CUDA:0",
        id="emulated-CUDA:0",
        marks=pytest.mark.skipif(
            EMULATOR_SKIP_REASON is not None, reason=str(EMULATOR_SKIP_REASON)
        ),
    ),
]


def _on_device(request: pytest.FixtureRequest) -> Iterator[str]:
    """The device string of ``request.param``, with the kernel emulator's ``CUDA:0`` active for
    the test where the param is the emulated one (a test marked ``real_gpu`` skips there)."""
    if request.param != "emulated-CUDA:0":
        yield request.param
        return
    marker = request.node.get_closest_marker("real_gpu")
    if marker is not None:
        why = marker.args[0] if marker.args else "CuPy on a GPU"
        pytest.skip(f"needs a real GPU: {why}")
    from kernel_emulator import emulated_cuda_devices

    with emulated_cuda_devices(request.getfixturevalue("library")):
        yield "CUDA:0"


@pytest.fixture(params=["CPU", *CUDA_PARAMS])
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """``"CPU"`` always, and ``"CUDA:0"``: CuPy's when it sees a GPU, else the kernel
    emulator's where g++ exists (param id ``emulated-CUDA:0``); the absent ones skip with the
    reason."""
    yield from _on_device(request)


@pytest.fixture(params=CUDA_PARAMS)
def cuda_device(request: pytest.FixtureRequest) -> Iterator[str]:
    """``"CUDA:0"``, on a GPU or on the kernel emulator (see :func:`device`), for the checks
    that compare a CUDA component or op with the CPU one."""
    yield from _on_device(request)


@pytest.fixture
def cuda_ctx(cuda_device: str) -> Any:
    """An execution context of the ``CUDA:0`` under test (an emulated one on the emulator)."""
    from mila_py import devices

    return devices.create_execution_context(cuda_device)


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


@pytest.fixture(scope="session")
def library() -> Any:
    """The kernel emulator's library of every CUDA op's kernels (see ``kernel_emulator.py``)."""
    from kernel_emulator import ops_library

    return ops_library()


@pytest.fixture
def cuda(library: Any) -> Iterator[None]:
    """``CUDA:0`` emulated on the CPU for the duration of a test (NumPy arrays, C++ kernels)."""
    from kernel_emulator import emulated_cuda_devices

    with emulated_cuda_devices(library):
        yield


@pytest.fixture
def quiet_transformers() -> Iterator[None]:
    """transformers' logger at ERROR for the test (config classes warn about keys the tests set
    on purpose); request it with ``pytestmark = pytest.mark.usefixtures("quiet_transformers")``."""
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _restore_base_seed() -> Iterator[None]:
    """Every test starts from mila_py's default base seed, and one that sets another (to build
    a model as a script would) leaves the default behind for the tests after it."""
    from mila_py.init import initial_seed, manual_seed

    manual_seed(0)
    yield
    manual_seed(0)
    assert initial_seed() == 0
