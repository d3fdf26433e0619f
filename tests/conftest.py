"""Shared fixtures: the ``device`` every device-generic case runs on, and the kernel emulator's
library and emulated ``CUDA:0`` for the ``*_emulated`` modules."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--emulate-gpu",
        action="store_true",
        help="on a machine without a GPU, run tests/cuda (only) on the kernel emulator's "
        "CUDA:0 with a NumPy stand-in for cupy (tests/emulated_cupy.py); tests marked "
        "real_gpu are skipped",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--emulate-gpu"):
        _start_gpu_emulation(config)


def _start_gpu_emulation(config: pytest.Config) -> None:
    """``--emulate-gpu``: before the GPU test files are imported, ``cupy`` is the stand-in,
    ``cuda_device_count()`` is 1 and ``CUDA:0`` is the kernel emulator's (until the run ends)."""
    if HAS_CUDA:
        raise pytest.UsageError("--emulate-gpu is for machines without a GPU: run tests/cuda as is")
    cuda_tests = Path(__file__).parent / "cuda"
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    if not paths or not all(p == cuda_tests or cuda_tests in p.parents for p in paths):
        raise pytest.UsageError(
            f"--emulate-gpu runs {cuda_tests} only (it replaces cupy for the whole process); "
            f"got {config.args}"
        )
    here = str(Path(__file__).parent)  # the helpers' folder (--import-mode=importlib omits it)
    if here not in sys.path:
        sys.path.insert(0, here)
    import emulated_cupy
    from kernel_emulator import COMPILER, emulated_cuda_devices, ops_library

    from mila_py.devices import cuda as cuda_module

    if COMPILER is None:
        raise pytest.UsageError("--emulate-gpu needs g++ (the kernel emulator compiles with it)")
    stack = contextlib.ExitStack()
    saved_cupy, saved_count = sys.modules.get("cupy"), cuda_module.cuda_device_count

    def restore() -> None:  # the process as it was, once the run ends
        cuda_module.cuda_device_count = saved_count  # type: ignore[assignment]
        if saved_cupy is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved_cupy

    stack.callback(restore)
    sys.modules["cupy"] = emulated_cupy.standin()
    cuda_module.cuda_device_count = lambda: 1  # type: ignore[assignment]
    stack.enter_context(emulated_cuda_devices(ops_library()))
    config.add_cleanup(stack.close)
    config.stash[_EMULATING] = True


_EMULATING = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.stash.get(_EMULATING, False):
        return
    for item in items:
        marker = item.get_closest_marker("real_gpu")
        if marker is not None:
            why = marker.args[0] if marker.args else "CuPy on a GPU"
            item.add_marker(pytest.mark.skip(reason=f"--emulate-gpu: needs a real GPU ({why})"))


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
