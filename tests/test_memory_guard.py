"""Component.build refuses a build the device cannot hold, before it allocates anything:
``required_memory`` against the execution context's available memory."""

from __future__ import annotations

import tracemalloc
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mila_py import BuildContext, Component, MemoryStats, Network, RuntimeMode
from mila_py.components import Linear, LinearConfig, RmsNorm, RmsNormConfig
from mila_py.devices import CpuExecutionContext, CudaExecutionContext, DeviceId, DeviceType
from mila_py.memory import format_bytes
from mila_py.models import Llama, LlamaConfig

TRAIN = BuildContext((2, 8, 512), RuntimeMode.TRAINING)
LLAMA = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)


def linear() -> Linear:
    return Linear("lin", LinearConfig(512, 512), device="CPU")


def network() -> Network:
    net = Network("net", device="CPU")
    net.add_component(Linear("proj", LinearConfig(512, 512)))  # each part gets (2, 8, 512)
    net.add_component(RmsNorm("norm", RmsNormConfig(512)))
    return net


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Set ``available["bytes"]`` to what the CPU reports; every call is counted."""
    state: dict[str, Any] = {"bytes": None, "calls": 0}

    def reported(self: CpuExecutionContext) -> int | None:
        state["calls"] += 1
        return state["bytes"]

    monkeypatch.setattr(CpuExecutionContext, "available_memory", reported)
    return state


def test_a_build_that_does_not_fit_is_refused_before_it_allocates(
    available: dict[str, Any],
) -> None:
    lin = linear()
    needed = lin.required_memory(TRAIN).total_bytes
    assert needed > 2 * 512 * 512 * 4  # the weight and its gradient at least
    available["bytes"] = needed // 4
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError) as info:
            lin.build(TRAIN)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "Linear 'lin'" in message
    assert f"needs {format_bytes(needed)} ({needed:,} bytes) of CPU:0 memory" in message
    assert f"{format_bytes(needed // 4)} ({needed // 4:,} bytes) is available" in message
    assert "check_memory=False" in message
    assert peak < 512 * 512 * 4 // 4  # not even a quarter of the weight was allocated
    assert not lin.is_built
    assert lin.get_parameters() == [] and lin.get_memory_stats() == MemoryStats()
    available["bytes"] = needed  # exactly enough
    lin.build(TRAIN)
    assert lin.is_built and lin.get_memory_stats().total_bytes == needed


def test_check_memory_false_builds_anyway(available: dict[str, Any]) -> None:
    available["bytes"] = 1
    lin = linear()
    lin.build(TRAIN, check_memory=False)
    assert lin.is_built and available["calls"] == 0


def test_the_root_checks_the_whole_tree_once(available: dict[str, Any]) -> None:
    net = network()
    ctx = BuildContext((2, 8, 512), RuntimeMode.TRAINING)
    needed = net.required_memory(ctx).total_bytes
    available["bytes"] = needed - 1
    with pytest.raises(MemoryError, match="Network 'net'"):
        net.build(ctx)
    assert not net.is_built and not any(c.is_built for c in net)
    assert available["calls"] == 1
    available["bytes"] = needed  # each part alone fits a smaller amount: none checks again
    net.build(ctx)
    assert available["calls"] == 2
    assert net.get_memory_stats().total_bytes == needed


def test_required_memory_is_what_the_build_holds_and_leaves_the_tree_unbuilt() -> None:
    for make in (linear, network):
        component = make()
        before = {id(c): dict(c.__dict__) for c in component._walk()}
        predicted = component.required_memory(TRAIN)
        assert {id(c): dict(c.__dict__) for c in component._walk()} == before
        assert not component.is_built
        component.build(TRAIN)
        assert component.get_memory_stats() == predicted
    with pytest.raises(RuntimeError, match="is built"):
        component.required_memory(TRAIN)


def test_unknown_available_memory_checks_nothing(
    available: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sized: list[object] = []
    monkeypatch.setattr(Component, "required_memory", lambda self, ctx: sized.append(ctx))
    lin = linear()
    lin.build(TRAIN)  # available["bytes"] is None: unknown
    assert lin.is_built and sized == []


def test_a_llama_that_does_not_fit_is_refused_and_can_be_built_later(
    available: dict[str, Any],
) -> None:
    model = Llama("llama", LLAMA, device="CPU")
    ctx = BuildContext((2, 64), RuntimeMode.INFERENCE)
    needed = model.required_memory(ctx).total_bytes
    available["bytes"] = needed // 2
    with pytest.raises(MemoryError, match=r"Llama 'llama'.*needs .* of CPU:0 memory"):
        model.build(ctx)
    assert not model.is_built and model.get_memory_stats() == MemoryStats()
    available["bytes"] = None
    model.build(ctx)
    assert model.get_memory_stats().total_bytes == needed


def test_from_pretrained_checks_unless_told_not_to(
    available: dict[str, Any], tmp_path: Path
) -> None:
    from mila_py.interop.hf import save_hf_checkpoint

    source = Llama("llama", LLAMA, device="CPU")
    source.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    save_hf_checkpoint(source, tmp_path / "ckpt")
    available["bytes"] = 1024
    with pytest.raises(MemoryError, match="check_memory=False"):
        Llama.from_pretrained(tmp_path / "ckpt", seq_len=8)
    model = Llama.from_pretrained(tmp_path / "ckpt", seq_len=8, check_memory=False)
    np.testing.assert_array_equal(model.norm.weight, source.norm.weight)


class HostOnlyContext(CpuExecutionContext):
    """A GPU's context as far as accounting goes (its NumPy arrays are host memory)."""

    def __init__(self, free: int) -> None:
        super().__init__()
        self.device_id = DeviceId(DeviceType.CUDA, 0)
        self.free = free

    def available_memory(self) -> int | None:
        return self.free


class Buffers(Component):
    def _on_building(self, build_context: BuildContext) -> None:
        self._add_state("staging", self._allocate((1024,), np.float32))


def test_a_gpu_build_checks_its_host_buffers_against_system_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mila_py.component as component_module

    monkeypatch.setattr(component_module, "host_available_memory", lambda: 1000)
    part = Buffers("staging")
    part.set_execution_context(HostOnlyContext(free=10**12))
    ctx = BuildContext((1,), RuntimeMode.INFERENCE)
    assert part.required_memory(ctx).host_state_bytes == 4096
    with pytest.raises(MemoryError, match=r"4\.00 KiB \(4,096 bytes\) of host memory"):
        part.build(ctx)
    monkeypatch.setattr(component_module, "host_available_memory", lambda: 4096)
    part.build(ctx)
    assert part.is_built


def test_cuda_available_memory_adds_what_the_pool_holds_free() -> None:
    """memGetInfo's free bytes plus the free bytes of CuPy's default pool, on the context's
    device (a stand-in CuPy: no GPU needed)."""
    entered: list[int] = []

    class Device:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            entered.append(-1)

    pool = types.SimpleNamespace(free_bytes=lambda: 300)
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(memGetInfo=lambda: (5000, 8000))),
        get_default_memory_pool=lambda: pool,
    )
    ctx = CudaExecutionContext.__new__(CudaExecutionContext)
    ctx._cupy = cupy
    ctx.device = Device()
    assert ctx.available_memory() == 5300
    assert entered == [1, -1]
    ctx._cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace()))
    assert ctx.available_memory() is None  # a CuPy that cannot tell: no check
