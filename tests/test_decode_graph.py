"""Decode steps as CUDA graphs, on ``CUDA:0`` (a GPU, or the kernel emulator's).

A decode step replayed from its graph gives the eager step's logits only if every value that
changes from step to step is read from a device buffer, and these tests compare them: the
graph, the same plan run eagerly, and the components' own calls, at one position for all and at
ragged ones, over several steps and batch sizes (``cuda_device``). The emulated stream captures
a graph as a GPU does (``tests/emulated_cupy.py``: between ``begin_capture`` and
``end_capture`` the kernel launches and the array work on device arrays are recorded, not run,
and a launch of the graph runs exactly what was recorded); it also counts captures and graph
launches, which the emulated runs check, and its capture rules are checked on their own at
the end (emulator only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from cuda_arrays import EMULATED, host
from emulated_cupy import CaptureError, DeviceArray
from kernel_emulator import COMPILER, EmulatedContext
from layer_helpers import move_optional_parameters, never_capture

from mila_py import BuildContext, RuntimeMode
from mila_py.devices.cpu import CpuExecutionContext
from mila_py.devices.graph import capture, reads_host
from mila_py.models import Llama, LlamaConfig

needs_emulator = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

CFG = LlamaConfig(
    vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64
)
#: NTK scaling by the step's length past 12 positions: its RoPE rows depend on the length
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 12}


def saved(cfg: LlamaConfig, tmp_path: Any, seed: int = 3) -> Any:
    """Weights of ``cfg`` (biases and norm weights off their initial values) in a file."""
    model = Llama("llama", cfg, device="CPU")
    model.build(BuildContext((1, 8), RuntimeMode.TRAINING))
    move_optional_parameters(model, np.random.default_rng(seed))
    path = tmp_path / f"w{seed}.safetensors"
    model.save(path)
    return path


def inference(
    cfg: LlamaConfig, path: Any, shape: tuple[int, int], monkeypatch: Any = None
) -> Llama:
    """An INFERENCE build on ``CUDA:0``; given ``monkeypatch``, its decode steps never capture
    (as on a stream without graphs): they run eagerly."""
    model = Llama("llama", cfg, device="CUDA:0")
    model.build(BuildContext(shape, RuntimeMode.INFERENCE, prefill_size=4))
    model.load(path)
    if monkeypatch is not None:
        never_capture(monkeypatch, model)
    return model


@pytest.mark.parametrize(("tie", "extras"), [(False, False), (True, True)], ids=["plain", "qk"])
def test_graph_replays_equal_the_eager_step_and_the_components(
    cuda_device: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, tie: bool, extras: bool
) -> None:
    """The same decode program on three models with the same weights: steps replayed from
    their graphs (after one eager run each), the same steps run eagerly, and the components'
    own calls. One position for all, then ragged positions (sequence 0 rewound by 3), then
    B=1 in the B=2 build, then ragged again: the graph's logits are the eager step's bit for
    bit, and the components' to fp32 rounding; the KV caches too. (``qk``: tied embeddings,
    biases and the Q/K head norms, whose input is a strided view of the QKV buffer.)"""
    cfg = dataclasses.replace(
        CFG, tie_embeddings=tie, qkv_bias=extras, out_bias=extras, qk_norm=extras, mlp_bias=extras
    )
    path = saved(cfg, tmp_path)
    graphed = inference(cfg, path, (2, 40))
    eager = inference(cfg, path, (2, 40), monkeypatch)
    components = inference(cfg, path, (2, 40))
    x = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 30))
    for model in (graphed, eager, components):
        model.prefill(x[:, :6])
    program: list[tuple[int, Any]] = [(2, p) for p in range(6, 11)]  # one position for all
    program += [(2, np.array([p - 3, p])) for p in range(11, 15)]  # ragged
    program += [(1, 11), (1, 12)]  # B=1: sequence 0 goes on alone
    program += [(2, np.array([p - 2, p - 1])) for p in range(15, 19)]
    for n_b, where in program:
        column = x[:n_b, np.max(where)]
        got = host(graphed.decode(column, where))
        want = host(eager.decode(column, where))
        ref = host(components._decode_components(column[:, None], where))
        np.testing.assert_array_equal(got, want)
        assert np.abs(ref).max() > 0.1  # real logits, not those of zero weights
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(graphed.layers, eager.layers, strict=True):
        for cache in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(
                host(a.self_attn._state[cache]), host(b.self_attn._state[cache])
            )
    assert graphed._plans is not None and eager._plans is not None
    for n_b, plan in graphed._plans.items():
        runs = sum(1 for b, _ in program if b == n_b)
        assert plan.step.captures == 1 and plan.step.graph is not None
        if EMULATED:
            assert plan.step.graph.launches == runs - 1
        assert eager._plans[n_b].step.eager and eager._plans[n_b].step.graph is None
    assert graphed.cached_lengths == eager.cached_lengths == components.cached_lengths


def test_each_batch_size_captures_its_own_graph_once(cuda_device: str, tmp_path: Any) -> None:
    """The first decode of a batch size runs its step eagerly and captures it; the next ones
    launch that graph. Another batch size captures its own, once; the first one's stays."""
    path = saved(CFG, tmp_path)
    model = inference(CFG, path, (3, 32))
    model.prefill(np.arange(12).reshape(3, 4) % CFG.vocab_size)
    assert model._plans is not None
    assert all(plan.step.captures == 0 for plan in model._plans.values())  # prefill: no step
    for position in (4, 5, 6):
        model.decode(np.array([1, 2, 3]), position)
    three = model._plans[3].step
    assert three.captures == 1 and three.graph is not None
    for position in (7, 8):
        model.decode(np.array([5]), position)
    one = model._plans[1].step
    assert one.captures == 1 and one.graph is not None and one.graph is not three.graph
    model.decode(np.array([1, 2, 3]), np.array([9, 7, 7]))
    assert three.captures == one.captures == 1
    if EMULATED:
        assert model.execution_context.stream.captures == 2
        assert (three.graph.launches, one.graph.launches) == (3, 1)


@pytest.mark.parametrize("context", [32, 12])
def test_a_length_dependent_scaling_decodes_eagerly(
    cuda_device: str, tmp_path: Any, context: int
) -> None:
    """Dynamic NTK scaling: past its original 12 positions, RoPE's rows depend on each step's
    length, which the step reads on the host: a build whose context reaches past them
    decodes eagerly (no capture), one whose context stays within them captures its step. Both
    decode as the components do."""
    cfg = dataclasses.replace(CFG, rope_scaling=DYNAMIC)
    path = saved(cfg, tmp_path)
    model, components = (inference(cfg, path, (2, context)) for _ in range(2))
    x = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, context))
    for m in (model, components):
        m.prefill(x[:, :6])
    for position in range(6, context):
        where = position if position < 9 else np.array([position - 1, position])
        got = host(model.decode(x[:, position], where))
        want = host(components._decode_components(x[:, position, None], where))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert model._plans is not None
    step = model._plans[2].step
    if context > 12:
        assert step.eager and step.graph is None and step.captures == 0
    else:
        assert not step.eager and step.captures == 1 and step.graph is not None
        if EMULATED:
            assert step.graph.launches == context - 7


@needs_emulator
def test_the_emulator_catches_a_step_that_reads_host_positions_in_replay(
    cuda: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulated graph replays what was captured, as a GPU does: a cache write that indexes
    the cache by the step's host position (the generic write), were it not marked as reading
    the host, would be captured at its first position and replayed there, so later steps
    lose their keys and their logits go wrong. Marked (as it is), it runs eagerly: right.
    (Emulator only: what CuPy does with that write inside a capture is CuPy's.)"""
    from mila_py.ops import operation
    from mila_py.ops.cuda.attention import CudaAttentionOp

    def generic(op: Any, *args: Any) -> Any:
        return operation.bind_cache_write(op.context.xp, *args)

    def unmarked(op: Any, *args: Any) -> Any:
        write = generic(op, *args)
        return lambda: write()

    path = saved(CFG, tmp_path)
    x = np.random.default_rng(6).integers(0, CFG.vocab_size, size=(1, 16))
    reference = inference(CFG, path, (1, 16))
    reference.prefill(x[:, :4])
    want = [reference.decode(x[:, p], p) for p in range(4, 12)]
    for write, caught in ((generic, False), (unmarked, True)):
        monkeypatch.setattr(CudaAttentionOp, "bind_cache_write", write)
        model = inference(CFG, path, (1, 16))
        model.prefill(x[:, :4])
        got = [model.decode(x[:, p], p) for p in range(4, 12)]
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)  # the eager run
        wrong = [
            not np.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want, strict=True)
        ]
        assert any(wrong) == caught
        assert model._plans is not None and model._plans[1].step.eager != caught


@needs_emulator
def test_capture_on_the_emulated_stream_records_device_work_and_refuses_host_work() -> None:
    """``capture`` on the emulated stream: the first call runs the calls, then records them;
    each later call replays the record on the arrays' current values. A call that reads a
    device value on the host, allocates, or copies host data to the device during the capture
    raises, and the capture is over after it (the stream captures again later). Marked calls
    and the CPU run eagerly."""
    ctx = EmulatedContext()
    a, b, c = (ctx.to_device(np.full(3, v, np.float32)) for v in (1.0, 2.0, 0.0))
    step = capture(ctx, [lambda: np.add(a, b, out=c), lambda: np.multiply(c, c, out=c)])
    step()
    assert step.graph is not None and step.graph.launches == 0
    np.testing.assert_array_equal(c, [9, 9, 9])
    a[...] = 3.0  # a new input for the replay
    step()
    np.testing.assert_array_equal(c, [25, 25, 25])
    assert step.graph.launches == 1 and ctx.stream.captures == 1
    host = np.ones(3, np.float32)
    for bad, what in (
        (lambda: float(a[0]), "read on the host"),
        (lambda: np.add(a, b), "allocates"),
        (lambda: np.empty(3), "allocates"),
        (lambda: a.get(), "get"),
        (lambda: np.add(a, host, out=c), "host array"),
        (lambda: c.__setitem__(slice(None), host), "host data"),
        (lambda: ctx.to_host(a), "to the host"),
        (ctx.synchronize, "synchronized"),
    ):
        failing = capture(ctx, [lambda: np.add(a, b, out=c), bad])
        with pytest.raises(CaptureError, match=what):
            failing()  # runs the calls (fine), then captures them (not)
        assert not ctx.stream.is_capturing() and failing.graph is None
        assert isinstance(ctx.allocate((2,), np.float32), DeviceArray)  # constructors back
    marked = capture(ctx, [reads_host(lambda: np.add(a, b, out=c))])
    marked()
    marked()
    assert marked.eager and marked.graph is None
    cpu = capture(CpuExecutionContext(), [lambda: np.add(a, b, out=c)])
    cpu()
    assert cpu.eager and cpu.graph is None


@needs_emulator
def test_a_call_a_library_refuses_to_capture_leaves_the_step_eager() -> None:
    """CuPy refuses some library calls while a stream captures (its cuBLAS calls raise
    NotImplementedError): the capture is dropped, the warm-up's results stand, and the step
    runs eagerly from then on, giving the same results."""
    ctx = EmulatedContext()
    a, b, c = (ctx.to_device(np.full(3, v, np.float32)) for v in (1.0, 2.0, 0.0))

    def library_call() -> None:
        if ctx.stream.is_capturing():
            raise NotImplementedError("calling cuBLAS API during stream capture is unsupported")
        np.multiply(c, 2.0, out=c)

    step = capture(ctx, [lambda: np.add(a, b, out=c), library_call])
    step()
    np.testing.assert_array_equal(c, [6, 6, 6])
    assert step.eager and step.graph is None and not ctx.stream.is_capturing()
    a[...] = 3.0
    step()
    np.testing.assert_array_equal(c, [10, 10, 10])
    assert step.captures == 1  # never tried again
