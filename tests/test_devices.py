"""mila_py.devices: DeviceType, DeviceId and its parser, available_devices, execution contexts."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mila_py.devices as devices
from mila_py.devices import (
    CpuExecutionContext,
    CudaExecutionContext,
    DeviceId,
    DeviceType,
    ExecutionContext,
    available_devices,
    create_execution_context,
)
from mila_py.devices import cuda as cuda_module
from mila_py.devices.overlap import arrays_overlap, same_view, self_overlaps

CPU0 = DeviceId(DeviceType.CPU, 0)


# ---------------------------------------------------------------------------- DeviceType
def test_device_type_members() -> None:
    assert [t.name for t in DeviceType] == ["CPU", "CUDA"]
    assert str(DeviceType.CPU) == "CPU"
    assert str(DeviceType.CUDA) == "CUDA"


# ---------------------------------------------------------------------------- DeviceId
def test_device_id_fields_and_default_index() -> None:
    d = DeviceId(DeviceType.CUDA, 3)
    assert d.device_type is DeviceType.CUDA
    assert d.index == 3
    assert DeviceId(DeviceType.CPU) == CPU0


def test_device_id_is_frozen() -> None:
    d = DeviceId(DeviceType.CUDA, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.index = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.device_type = DeviceType.CPU  # type: ignore[misc]
    assert d == DeviceId(DeviceType.CUDA, 1)


def test_device_id_is_hashable_and_compares_by_value() -> None:
    a = DeviceId(DeviceType.CUDA, 1)
    b = DeviceId(DeviceType.CUDA, 1)
    assert a is not b
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b, CPU0, DeviceId(DeviceType.CUDA, 0)}) == 3
    table = {a: "first"}
    assert table[b] == "first"
    assert a != DeviceId(DeviceType.CUDA, 2)
    assert a != "CUDA:1"


def test_device_id_ordering_cpu_first_then_index() -> None:
    cuda = [DeviceId(DeviceType.CUDA, i) for i in (10, 2, 0, 1)]
    ordered = sorted([*cuda, CPU0])
    assert [str(d) for d in ordered] == ["CPU:0", "CUDA:0", "CUDA:1", "CUDA:2", "CUDA:10"]
    cpu, cuda0 = CPU0, DeviceId(DeviceType.CUDA, 0)
    assert cpu < cuda0
    assert not cuda0 < cpu
    assert DeviceId(DeviceType.CUDA, 2) > DeviceId(DeviceType.CUDA, 1)
    assert DeviceId(DeviceType.CUDA, 1) <= DeviceId(DeviceType.CUDA, 1)
    assert DeviceId(DeviceType.CUDA, 1) >= DeviceId(DeviceType.CUDA, 1)
    assert not DeviceId(DeviceType.CUDA, 1) < DeviceId(DeviceType.CUDA, 1)


def test_device_id_does_not_order_against_other_types() -> None:
    with pytest.raises(TypeError):
        _ = CPU0 < "CUDA:0"  # type: ignore[operator]


@pytest.mark.parametrize(
    ("device_type", "index", "error"),
    [
        (DeviceType.CUDA, -1, ValueError),
        (DeviceType.CUDA, 1.0, TypeError),
        (DeviceType.CUDA, True, TypeError),
        (DeviceType.CUDA, "1", TypeError),
        (DeviceType.CPU, 1, ValueError),
        ("CUDA", 0, TypeError),
        (None, 0, TypeError),
    ],
)
def test_device_id_rejects_bad_fields(device_type, index, error) -> None:
    with pytest.raises(error):
        DeviceId(device_type, index)


def test_device_id_str() -> None:
    assert str(DeviceId(DeviceType.CUDA, 1)) == "CUDA:1"
    assert str(CPU0) == "CPU:0"


@pytest.mark.parametrize(
    ("spec", "device_type", "index"),
    [
        ("cuda:1", DeviceType.CUDA, 1),
        ("CUDA:1", DeviceType.CUDA, 1),
        ("Cuda:1", DeviceType.CUDA, 1),
        ("cUdA:12", DeviceType.CUDA, 12),
        ("cuda", DeviceType.CUDA, 0),
        ("CUDA:0", DeviceType.CUDA, 0),
        ("cpu", DeviceType.CPU, 0),
        ("CPU", DeviceType.CPU, 0),
        ("Cpu:0", DeviceType.CPU, 0),
    ],
)
def test_parse_valid(spec: str, device_type: DeviceType, index: int) -> None:
    parsed = DeviceId.parse(spec)
    assert parsed == DeviceId(device_type, index)
    assert parsed.device_type is device_type
    assert parsed.index == index


@pytest.mark.parametrize(
    "spec",
    ["", "   ", "cuda:", "cuda:x", "tpu:0", "tpu", ":0", "cuda:-1", "cuda:1:2", "cuda1", "cpu:1"],
)
def test_parse_malformed_raises_value_error(spec: str) -> None:
    with pytest.raises(ValueError):
        DeviceId.parse(spec)


def test_parse_unknown_type_message_names_the_input() -> None:
    with pytest.raises(ValueError, match="tpu"):
        DeviceId.parse("tpu:0")


@pytest.mark.parametrize("spec", [0, None, 1.5, ["CPU"]])
def test_parse_wrong_type_raises_type_error(spec) -> None:
    with pytest.raises(TypeError):
        DeviceId.parse(spec)


def test_parse_passes_device_ids_and_types_through() -> None:
    d = DeviceId(DeviceType.CUDA, 4)
    assert DeviceId.parse(d) is d
    assert DeviceId.parse(DeviceType.CUDA) == DeviceId(DeviceType.CUDA, 0)
    assert DeviceId.parse(DeviceType.CPU) == CPU0


@pytest.mark.parametrize("d", [CPU0, DeviceId(DeviceType.CUDA, 0), DeviceId(DeviceType.CUDA, 7)])
def test_str_and_parse_round_trip(d: DeviceId) -> None:
    assert DeviceId.parse(str(d)) == d
    assert DeviceId.parse(str(d).lower()) == d


# ---------------------------------------------------------------------------- available_devices
def test_available_devices_lists_cpu_then_every_gpu() -> None:
    found = available_devices()
    assert found[0] == CPU0
    assert all(isinstance(d, DeviceId) for d in found)
    assert found == sorted(found)
    assert len(set(found)) == len(found)
    expected_gpus = cuda_module.cuda_device_count()
    assert [d for d in found if d.device_type is DeviceType.CUDA] == [
        DeviceId(DeviceType.CUDA, i) for i in range(expected_gpus)
    ]


def test_available_devices_follows_the_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    assert available_devices() == [
        CPU0,
        DeviceId(DeviceType.CUDA, 0),
        DeviceId(DeviceType.CUDA, 1),
    ]
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    assert available_devices() == [CPU0]


# ---------------------------------------------------------------------------- CPU context
@pytest.mark.parametrize("spec", ["CPU", "cpu", "cpu:0", CPU0, DeviceType.CPU])
def test_create_cpu_context(spec) -> None:
    ctx = create_execution_context(spec)
    assert isinstance(ctx, CpuExecutionContext)
    assert isinstance(ctx, ExecutionContext)
    assert ctx.device_id == CPU0
    assert ctx.device_type is DeviceType.CPU
    assert ctx.xp is np
    assert "CPU:0" in repr(ctx)


@pytest.mark.parametrize("spec", ["", "cuda:", "cuda:x", "tpu:0"])
def test_create_context_rejects_malformed_devices(spec: str) -> None:
    with pytest.raises(ValueError):
        create_execution_context(spec)


def test_cpu_context_rejects_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CPU"):
        CpuExecutionContext(DeviceId(DeviceType.CUDA, 0))
    with pytest.raises(ValueError, match="CPU"):
        CpuExecutionContext("cuda:0")


@pytest.mark.parametrize("spec", ["CPU", "cpu:0", DeviceType.CPU, None])
def test_cpu_context_takes_any_device_spelling(spec) -> None:
    assert CpuExecutionContext(spec).device_id == CPU0


def test_device_index_may_be_a_numpy_integer() -> None:
    device = DeviceId(DeviceType.CUDA, np.int64(1))
    assert device == DeviceId(DeviceType.CUDA, 1) and type(device.index) is int
    assert hash(device) == hash(DeviceId(DeviceType.CUDA, 1)) and str(device) == "CUDA:1"
    with pytest.raises(TypeError, match="index must be an int"):
        DeviceId(DeviceType.CUDA, np.float64(1.0))


def test_cuda_context_rejects_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        CudaExecutionContext(CPU0)


def test_cpu_context_allocates_zeroed_arrays_of_the_requested_dtype() -> None:
    ctx = CpuExecutionContext()
    a = ctx.allocate((3, 5), np.float16)
    assert isinstance(a, np.ndarray)
    assert a.shape == (3, 5)
    assert a.dtype == np.float16
    assert not a.any()
    b = ctx.allocate((4,), np.float32, zero=False)
    assert b.shape == (4,)
    assert b.dtype == np.float32
    assert ctx.is_device_array(a)
    assert not ctx.is_device_array([0.0, 1.0])


def test_cpu_context_to_host_copies_like_the_cuda_context() -> None:
    # a record taken with to_host must not change when the model reuses its output buffer
    ctx = CpuExecutionContext()
    on_device = ctx.to_device(np.arange(6, dtype=np.float32))
    back = ctx.to_host(on_device)
    assert isinstance(back, np.ndarray) and not np.shares_memory(back, on_device)
    on_device[0] = 100.0
    back[1] = -5.0
    assert back[0] == 0.0 and on_device[1] == 1.0
    assert ctx.to_host([1, 2]).tolist() == [1, 2]


def test_cpu_context_to_device_copies_and_to_host_returns_numpy() -> None:
    ctx = CpuExecutionContext()
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    on_device = ctx.to_device(source)
    assert on_device is not source
    source[0, 0] = 100.0
    assert on_device[0, 0] == 0.0
    np.testing.assert_array_equal(ctx.to_host(on_device), on_device)
    np.testing.assert_array_equal(ctx.to_device([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]]))
    ctx.synchronize()  # a no-op that must not fail


def test_cpu_context_takes_torch_cpu_tensors_without_a_copy() -> None:
    """A torch CPU tensor (any ``__dlpack__`` producer on the host) becomes a NumPy view of the
    same memory, bf16 included, so a component rotates it in place; other inputs pass through."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    from mila_py import BuildContext, Precision, RuntimeMode
    from mila_py.components import Rope, RopeConfig

    ctx = create_execution_context("CPU")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    view = ctx.as_device_array(t)
    assert isinstance(view, np.ndarray) and view.shape == (2, 3) and view.dtype == np.float32
    view[1, 2] = -1.0
    assert t[1, 2].item() == -1.0  # the same memory
    bf16 = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    bits = ctx.as_device_array(bf16)
    assert bits.dtype == np.dtype(ml_dtypes.bfloat16) and bits.tolist() == [1.5, -2.0]
    for other in (np.ones(2), [1, 2], "x", None):
        assert ctx.as_device_array(other) is other
    for dtype in (torch.float32, torch.bfloat16):  # bf16 goes through its bits: refused too
        with pytest.raises(TypeError, match=r"requires grad.*detach\(\)"):
            ctx.as_device_array(torch.ones(2, dtype=dtype, requires_grad=True))
    ctx.release_foreign()  # nothing to order on the CPU

    cfg = RopeConfig(channels=64, n_heads=4, n_kv_heads=2, max_seq_len=32)
    for precision, dtype in ((Precision.FP32, torch.float32), (Precision.BF16, torch.bfloat16)):
        rope = Rope("rope", cfg, device="CPU", precision=precision)
        rope.build(BuildContext((1, 8, 64), RuntimeMode.INFERENCE))
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 8, 64, generator=gen).to(dtype)
        k = torch.randn(1, 8, 32, generator=gen).to(dtype)
        before = q.clone()
        q_np, k_np = ctx.as_device_array(q.clone()), ctx.as_device_array(k.clone())
        rope.forward(q_np, k_np)  # the reference: NumPy arrays of their own
        rope.forward(ctx.as_device_array(q), ctx.as_device_array(k))  # the tensors, in place
        assert not torch.equal(q, before)
        assert np.array_equal(ctx.as_device_array(q), q_np)
        assert np.array_equal(ctx.as_device_array(k), k_np)


def test_contexts_are_independent_objects() -> None:
    a = create_execution_context("CPU")
    b = create_execution_context("CPU")
    assert a is not b
    assert a.device_id == b.device_id


# ---------------------------------------------------------------------------- device-generic
def test_context_round_trip_on_every_device(device: str, host) -> None:
    ctx = devices.create_execution_context(device)  # looked up now: the emulated CUDA:0's too
    assert ctx.device_id == DeviceId.parse(device)
    data = np.linspace(-2.0, 3.0, 12, dtype=np.float32).reshape(3, 4)
    on_device = ctx.to_device(data)
    assert ctx.is_device_array(on_device)
    back = ctx.to_host(on_device)
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, data)
    zeros = ctx.allocate((2, 3), np.float32)
    ctx.synchronize()
    np.testing.assert_array_equal(host(zeros), np.zeros((2, 3), np.float32))


# ---------------------------------------------------------------------------- CUDA without CuPy / GPU
def _hide_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import cupy` raise ImportError.
    monkeypatch.setitem(sys.modules, "cupy", None)


def _fake_cupy(monkeypatch: pytest.MonkeyPatch, count) -> None:
    def get_device_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=types.SimpleNamespace(getDeviceCount=get_device_count)
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_cuda_without_cupy_says_what_is_missing_and_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide_cupy(monkeypatch)
    assert cuda_module.cuda_device_count() == 0
    with pytest.raises(RuntimeError) as info:
        create_execution_context("CUDA:0")
    message = str(info.value)
    assert "CuPy" in message
    assert 'pip install -e ".[cuda12]"' in message


def test_cuda_with_cupy_but_no_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, 0)
    assert cuda_module.cuda_device_count() == 0
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        create_execution_context("cuda:0")


def test_cuda_device_count_is_zero_when_the_driver_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, RuntimeError("cudaErrorNoDevice"))
    assert cuda_module.cuda_device_count() == 0
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        create_execution_context("CUDA:0")


def test_cuda_index_beyond_the_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cupy(monkeypatch, 1)
    assert cuda_module.cuda_device_count() == 1
    with pytest.raises(RuntimeError, match=r"CUDA:3.*1 GPU"):
        create_execution_context("CUDA:3")


def test_importing_mila_py_does_not_import_cupy() -> None:
    code = "import sys, mila_py, mila_py.devices; print('cupy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------------------- real GPU
@pytest.mark.cuda
@pytest.mark.skipif(cuda_module.cuda_device_count() == 0, reason="no CUDA GPU / CuPy")
def test_cuda_context_owns_a_stream_and_allocates_on_its_device() -> None:
    import cupy

    ctx = create_execution_context("CUDA:0")
    assert isinstance(ctx, CudaExecutionContext)
    assert ctx.xp is cupy
    assert isinstance(ctx.stream, cupy.cuda.Stream)
    assert ctx.stream is not cupy.cuda.Stream.null
    a = ctx.allocate((4, 4), np.float32)
    assert isinstance(a, cupy.ndarray)
    assert a.device.id == 0
    assert ctx.is_device_array(a)
    assert not ctx.is_device_array(np.zeros(3))
    with ctx.activate():
        assert cupy.cuda.get_current_stream() == ctx.stream
        a += 1
    ctx.synchronize()
    np.testing.assert_array_equal(ctx.to_host(a), np.ones((4, 4), np.float32))


# ---------------------------------------------------------------------------------- overlap


class _DeviceLikeArray:
    """An array known only by its ``__cuda_array_interface__`` (address, shape, strides, None
    for C order, and type), as another library's device array is: exercises the path that
    never touches NumPy's own arrays."""

    def __init__(self, x: np.ndarray) -> None:
        self.__cuda_array_interface__ = {
            "data": (x.__array_interface__["data"][0], False),
            "shape": x.shape,
            "strides": None if x.flags.c_contiguous else x.strides,
            "typestr": x.dtype.str,
            "version": 3,
        }


def _views(draw: st.DrawFn, buffer: np.ndarray) -> np.ndarray:
    """A random view of ``buffer`` [6, 7, 8]: a slice with steps (negative too) per axis, maybe
    transposed."""
    index = []
    for n in buffer.shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        step = draw(st.sampled_from([1, 1, 2, 3, -1]))
        index.append(
            slice(start, stop, step)
            if step > 0
            else slice(stop - 1, None if start == 0 else start - 1, step)
        )
    view = buffer[tuple(index)]
    return view.transpose(draw(st.permutations(range(3))))


@st.composite
def _view_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    buffer = np.zeros((6, 7, 8), np.float32)
    return _views(draw, buffer), _views(draw, buffer)


@settings(max_examples=300, deadline=None)
@given(_view_pairs())
def test_arrays_overlap_is_numpys_exact_answer_on_either_path(pair) -> None:
    a, b = pair
    expected = bool(np.shares_memory(a, b))
    assert arrays_overlap(a, b) is expected
    assert arrays_overlap(_DeviceLikeArray(a), _DeviceLikeArray(b)) is expected
    assert arrays_overlap(a, np.zeros(a.shape, a.dtype)) is False


def test_fused_qkv_views_do_not_overlap_but_an_off_by_one_split_does() -> None:
    qkv = np.zeros((2, 5, 48), ml_dtypes.bfloat16)  # 16-bit: NumPy cannot buffer it, we can
    q, k, v = qkv[..., :32], qkv[..., 32:40], qkv[..., 40:]
    for wrap in (lambda x: x, _DeviceLikeArray):
        assert not arrays_overlap(wrap(q), wrap(k)) and not arrays_overlap(wrap(k), wrap(v))
        assert arrays_overlap(wrap(qkv[..., :33]), wrap(k))
        assert arrays_overlap(wrap(q[1:]), wrap(qkv[1, 4]))
    assert not arrays_overlap(q[:, :0], q) and same_view(q, qkv[..., :32])
    scalar = qkv[0, 0, 33:34].reshape(())  # 0-d, C order: strides None in the interface
    assert arrays_overlap(_DeviceLikeArray(scalar), _DeviceLikeArray(k))
    assert not arrays_overlap(_DeviceLikeArray(scalar), _DeviceLikeArray(q))
    owner = np.zeros(4, np.float32)  # arrays that own their memory: overlap only themselves
    assert arrays_overlap(owner, owner) and not arrays_overlap(owner, np.zeros(4, np.float32))
    assert not arrays_overlap(np.zeros(0), np.zeros(0)) and arrays_overlap(owner, owner[1:])
    assert not same_view(q, q[:, ::-1]) and not same_view(q, q.astype(np.float16))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.lists(st.integers(-24, 24), min_size=3, max_size=3),
)
def test_self_overlaps_never_misses_a_shared_address(shape, strides) -> None:
    base = np.zeros(400, np.float32)[200:]  # room for negative strides
    strides = tuple(4 * s for s in strides[: len(shape)])
    x = np.lib.stride_tricks.as_strided(base, tuple(shape), strides)
    addresses = [
        sum(i * s for i, s in zip(index, strides, strict=True)) for index in np.ndindex(*shape)
    ]
    if len(set(addresses)) < len(addresses):  # brute force: two elements at one address
        assert self_overlaps(x) and self_overlaps(_DeviceLikeArray(x))


@settings(max_examples=200, deadline=None)
@given(_view_pairs())
def test_views_numpy_makes_never_self_overlap(pair) -> None:
    for view in pair:
        assert not self_overlaps(view) and not self_overlaps(_DeviceLikeArray(view))
        assert not self_overlaps(view.reshape(-1) if view.flags.c_contiguous else view)
    assert self_overlaps(np.broadcast_to(np.zeros(3, np.float32), (2, 3)))


def test_a_sizing_context_copies_without_recursing() -> None:
    """``copy.copy`` asks for attributes before ``__init__`` runs; the wrapper's forwarding
    must answer AttributeError, not recurse."""
    import copy

    from mila_py.devices.sizing import SizingContext

    sizing = SizingContext(CpuExecutionContext())
    twin = copy.copy(sizing)
    assert twin.device_id == CPU0 and twin.allocate((3, 2), np.float32).nbytes == 24
    with pytest.raises(AttributeError):
        SizingContext.__new__(SizingContext).stream  # noqa: B018
