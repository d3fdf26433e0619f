"""What only Rope's CUDA op has, on ``CUDA:0`` (``cuda_device``: a GPU, or the kernel emulator
where none is present; the checks of CuPy itself carry ``real_gpu`` and skip there): the
kernels' instantiations and access widths (16-byte accesses, narrower ones at odd alignments,
the width chosen for views), large grids, explicit positions uploaded once per call and a
decode plan's positions read from their device buffer, refusals before any launch, the table
shared per device, device memory, streams, and foreign (DLPack, CUDA array interface, torch)
arrays.

Every case checks results against the independent float64 reference of ``rope_reference.py``
(precision-keyed tolerances). The Rope component's device-generic checks (forward, prefill,
decode, rotate, backward, layouts and views, positions, scaling types, refusals) run on every
device in ``test_rope.py``; what only the emulator can show is in
``test_rope_kernel_emulated.py``. Arrays go to the device and back through their bits for BF16,
so no case depends on CuPy compiling bfloat16 kernels of its own.
"""

from __future__ import annotations

import gc
from typing import Any

import cuda_arrays
import numpy as np
import pytest
from cuda_arrays import CUPY_BF16, EMULATED, cupy
from rope_helpers import (
    BF16,
    FP16,
    FP32,
    INFERENCE,
    PRECISIONS,
    TRAINING,
    arange_positions,
    assert_close,
    dtype_of,
    random_qk,
    reference,
    rope_config,
)

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig, clear_rope_cache, get_rope
from mila_py.devices import DeviceId
from mila_py.devices import cuda as cuda_module
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda import rope as cuda_rope

#: every test runs on the CUDA:0 under test (the kernel emulator's where no GPU is present)
pytestmark = pytest.mark.usefixtures("cuda_device")

DEVICE = "CUDA:0"
NO_BF16_REASON = (
    "this CuPy has no bfloat16 dtype (CuPy >= 14 has); BF16 is then checked with torch bf16 "
    "tensors in test_torch_tensors_are_rotated_in_place_through_dlpack"
)
#: the Rope component takes torch / DLPack / __cuda_array_interface__ arrays itself (the patch)
COMPONENT_ADOPTS = hasattr(Rope, "_device_arrays")
NO_ADOPT_REASON = (
    "the Rope component does not adopt foreign CUDA arrays yet (apply the proposed patch)"
)

#: FP32, FP16 and BF16 (BF16 skipped with the reason where CuPy lacks the dtype)
PRECISION_PARAMS = [
    FP32,
    FP16,
    pytest.param(BF16, marks=pytest.mark.skipif(not CUPY_BF16, reason=NO_BF16_REASON)),
]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240601)


# ---------------------------------------------------------------------------------- helpers


def up(x: np.ndarray) -> Any:
    """A C-contiguous device copy of a host array (BF16 moved as its bits)."""
    return cuda_arrays.dev(np.ascontiguousarray(x))


def down(x: Any) -> np.ndarray:
    """A host copy of a device array after every stream finished (BF16 moved as its bits)."""
    return cuda_arrays.host(x)


def bits(x: Any) -> bytes:
    host = x if isinstance(x, np.ndarray) else down(x)
    return np.ascontiguousarray(host).tobytes()


def device_index(x: Any) -> int:
    """The GPU holding device array ``x`` (the emulated CUDA:0's NumPy arrays: 0)."""
    return 0 if EMULATED else int(x.device.id)


def cuda_rope_of(
    config: RopeConfig,
    batch: int,
    tokens: int,
    *,
    mode: RuntimeMode = INFERENCE,
    precision: Precision = FP32,
    name: str = "rope",
) -> Rope:
    """A standalone CUDA Rope built for ``[batch, tokens, channels]``."""
    rope = Rope(name, config, device=DEVICE, precision=precision)
    rope.build(BuildContext((batch, tokens, config.channels), mode))
    return rope


# ---------------------------------------------------------------------------------- kernels


@pytest.mark.real_gpu("NVRTC modules and their kernels")
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_every_kernel_instantiation_compiles_and_is_cached(precision: Precision) -> None:
    file, names = "rope.cu", tuple(cuda_rope.kernel_names(precision))
    module = _kernels.module(file, 0, names)
    assert _kernels.module(file, 0, names) is module
    for name in names:
        function = _kernels.kernel(file, name, 0, names)
        assert _kernels.kernel(file, name, 0, names) is function
    assert len(names) == 2 * len(cuda_rope.vector_widths(precision))
    assert cuda_rope.vector_widths(precision)[0] * precision.itemsize == 16


# ---------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("rotary_dim", [0, 64], ids=["full", "partial64of128"])
def test_llama_head_dim_takes_16_byte_accesses(
    heads: tuple[int, int], layout: str, rotary_dim: int, precision: Precision, rng
) -> None:
    cfg = rope_config(heads, head_dim=128, max_seq_len=4096, layout=layout, rotary_dim=rotary_dim)
    batch, tokens = 2, 33
    rope = cuda_rope_of(cfg, batch, tokens, precision=precision)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    q, k = up(q0), up(k0)
    assert rope.op.vector_width(q, k) * precision.itemsize == 16
    rope.prefill(q, k, 3000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 3000))
    assert_close(down(q), ref_q, precision)
    assert_close(down(k), ref_k, precision)


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_large_calls(precision: Precision, layout: str, rng) -> None:
    """Many blocks (one per token) and a grid well past one wave of the GPU."""
    cfg = rope_config((8, 2), head_dim=64, max_seq_len=8192, layout=layout)
    batch, tokens = 3, 2000
    rope = cuda_rope_of(cfg, batch, tokens, precision=precision)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    q, k = up(q0), up(k0)
    rope.prefill(q, k, 5000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 5000))
    assert_close(down(q), ref_q, precision)
    assert_close(down(k), ref_k, precision)


# ---------------------------------------------------------------------------------- positions


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("batch", "tokens", "mrope"),
    [(1, 1, False), (3, 1, False), (600, 1, False), (8, 64, False), (21, 1, True),
     (171, 1, True)],
    ids=lambda v: str(int(v)),
)  # fmt: skip
def test_explicit_positions_of_any_count(
    monkeypatch, batch: int, tokens: int, mrope: bool, layout: str, precision: Precision, rng
) -> None:
    """Explicit positions (``[B, T]``, or ``[3, B, T]`` with M-RoPE), few or many, go to the
    kernel in one upload per call, as int32 in the shape the kernel indexes, and rotate as the
    float64 reference."""
    section = {"mrope_section": (4, 2, 2)} if mrope else {}  # the 8 frequencies of 16
    cfg = rope_config((4, 2), 16, layout=layout, **section)
    rope = cuda_rope_of(cfg, batch, tokens, precision=precision)
    ctx = rope.execution_context
    shape = (3, batch, tokens) if mrope else (batch, tokens)
    positions = rng.integers(0, cfg.max_seq_len, size=shape)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    uploads: list[np.ndarray] = []
    real_to_device = ctx.to_device
    monkeypatch.setattr(ctx, "to_device",
                        lambda a: uploads.append(np.array(a)) or real_to_device(a))  # fmt: skip
    q, k = up(q0), up(k0)
    if tokens == 1:
        rope.decode(q, k, positions[..., 0])
    else:
        rope.rotate(q, k, positions)
    (upload,) = uploads  # int32, in the shape the kernel indexes
    assert upload.dtype == np.int32 and upload.shape == shape
    np.testing.assert_array_equal(upload, positions)
    if EMULATED:
        vec = rope.op.vector_width(q, k)
        launched = rope.execution_context.launches[-1]
        assert launched == cuda_rope.kernel_name(precision, vec, layout == "interleaved")
    got_q, got_k = down(q), down(k)
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(got_q, ref_q, precision)
    assert_close(got_k, ref_k, precision)


@pytest.mark.parametrize("batch", [5, 600])
def test_a_decode_plan_step_reads_its_positions_from_the_device_buffer(
    monkeypatch, batch: int, rng
) -> None:
    """A decode plan's step (one position for all, or one per sequence) reads the step's
    positions from their device buffer (written by ``DecodePositions.set`` on the context's
    stream): no upload per step, and the bits of the component's own decode."""
    from mila_py.ops.operation import DecodePositions

    cfg = rope_config((4, 2), 16)
    rope = cuda_rope_of(cfg, batch, 1)
    ctx = rope.execution_context
    q = up(np.zeros((batch, 1, cfg.channels), np.float32))
    k = up(np.zeros((batch, 1, cfg.kv_channels), np.float32))
    positions = DecodePositions(batch, ctx)
    step = rope.op.bind_decode(q, k, positions)
    uploads: list[int] = []
    real_to_device = ctx.to_device
    monkeypatch.setattr(ctx, "to_device", lambda a: uploads.append(1) or real_to_device(a))
    for ragged in (True, False, True):
        each = rng.integers(0, cfg.max_seq_len, size=batch) if ragged else np.full(batch, 900)
        q0, k0 = random_qk(rng, cfg, batch, 1)
        q[...], k[...] = up(q0), up(k0)
        uploads.clear()
        with ctx.activate():
            positions.set(each, int(each.min()), int(each.max()))
            step()
        assert uploads == []  # (the component's decode below uploads its positions)
        if EMULATED:  # one launch of the kernel
            assert ctx.launches[-1].startswith("rope_qk<")
        checked_q, checked_k = up(q0), up(k0)
        rope.decode(checked_q, checked_k, each)
        assert bits(q) == bits(checked_q) and bits(k) == bits(checked_k)


@pytest.mark.parametrize("scaling", ["none", "dynamic", "longrope"])
def test_a_decode_plan_step_across_the_original_context(scaling: str, rng) -> None:
    """The op's bound decode (a decode plan's call) across the original context (1024):
    dynamic NTK's rows are computed per call past it and LongRoPE switches tables, so for
    positions that may cross it (below 4096) their call goes through the general path, which
    reads the positions on the host (no CUDA graph can replay it); below a limit of 1024 the
    table is one, and the call reads the step's device positions alone, as without scaling.
    Every step rotates as the float64 reference."""
    from mila_py.devices.graph import replayable
    from mila_py.ops.operation import DecodePositions

    n = 8
    scalings = {
        "none": None,
        "dynamic": {
            "rope_type": "dynamic",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 1.7 * i for i in range(n)],
            "original_max_position_embeddings": 1024,
        },
    }
    cfg = rope_config((3, 1), 16, max_seq_len=4096, scaling=scalings[scaling])
    batch = 2
    rope = cuda_rope_of(cfg, batch, 1)
    ctx = rope.execution_context
    q = up(np.zeros((batch, 1, cfg.channels), np.float32))
    k = up(np.zeros((batch, 1, cfg.kv_channels), np.float32))
    under = DecodePositions(batch, ctx, limit=1024)
    assert replayable(rope.op.bind_decode(q, k, under))
    positions = DecodePositions(batch, ctx)
    step = rope.op.bind_decode(q, k, positions)
    assert replayable(step) == (scaling == "none")
    for position in (1022, 1023, 1024, 1025, 3000, 7):
        q0, k0 = random_qk(rng, cfg, batch, 1)
        q[...], k[...] = up(q0), up(k0)
        with ctx.activate():
            positions.set(position, position, position)
            step()
        ref_q, ref_k = reference(cfg, q0, k0, np.full((batch, 1), position))
        assert_close(down(q), ref_q, FP32)
        assert_close(down(k), ref_k, FP32)


# ---------------------------------------------------------------------------------- layouts in memory


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("shift", [1, 2, 3], ids=lambda s: f"shift{s}")
def test_odd_alignments_take_narrower_accesses(
    layout: str, precision: Precision, shift: int, rng
) -> None:
    """Q and K starting a few elements past an aligned address: correct, with narrower accesses
    (a one-element shift forces the element-by-element kernel)."""
    cfg = rope_config((4, 2), head_dim=128, layout=layout)
    batch, tokens = 2, 9
    rope = cuda_rope_of(cfg, batch, tokens, precision=precision)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    dt = dtype_of(precision)
    q_buf = up(np.concatenate([np.zeros(shift, dt), q0.reshape(-1)]))
    k_buf = up(np.concatenate([np.zeros(shift, dt), k0.reshape(-1)]))
    q = q_buf[shift:].reshape(q0.shape)
    k = k_buf[shift:].reshape(k0.shape)
    vec = rope.op.vector_width(q, k)
    offset_bytes = shift * precision.itemsize
    assert vec * precision.itemsize == min(16, offset_bytes & -offset_bytes)  # its lowest set bit
    if shift == 1:
        assert vec == 1
    rope.prefill(q, k, 1234)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 1234))
    got_q, got_k = down(q), down(k)
    assert_close(got_q, ref_q, precision)
    assert_close(got_k, ref_k, precision)
    assert not np.any(down(q_buf[:shift]).astype(np.float32))  # nothing written before Q


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_vector_width_choice(precision: Precision) -> None:
    widest = 16 // precision.itemsize
    rope = Rope("r", rope_config((4, 2), head_dim=128), device=DEVICE, precision=precision)
    rope.build(BuildContext((2, 8, 512), INFERENCE))
    dt = cupy.uint16 if precision.itemsize == 2 else cupy.float32  # only addresses matter here
    q, k = cupy.zeros((2, 8, 512), dt), cupy.zeros((2, 8, 256), dt)
    assert rope.op.vector_width(q, k) == widest
    wide = cupy.zeros((2, 8, 512 + 1), dt)  # rows of an odd number of elements
    assert rope.op.vector_width(wide[:, :, :512], k) == 1
    assert rope.op.vector_width(wide[:, :1, :512], k[:, :1]) == widest  # T == 1: no T stride
    assert rope.op.vector_width(wide[:1, :1, :512], k[:1, :1]) == widest
    assert rope.op.vector_width(wide[:1, :, :512], k[:1]) == 1
    small = Rope("s", rope_config((3, 1), head_dim=12), device=DEVICE, precision=precision)
    small.build(BuildContext((1, 1, 36), INFERENCE))
    q, k = cupy.zeros((1, 1, 36), dt), cupy.zeros((1, 1, 12), dt)
    # n_freq = 6 pairs, head_dim = 12: 2-element accesses divide both, 4 do not
    assert small.op.vector_width(q, k) == 2


def test_non_contiguous_last_axis_is_refused_before_launch(rng) -> None:
    cfg = rope_config((2, 1), head_dim=8)
    rope = cuda_rope_of(cfg, 2, 3)
    q0, k0 = random_qk(rng, cfg, 2, 3)
    q = cupy.asfortranarray(up(q0))
    k = up(k0)
    with pytest.raises(ValueError, match="contiguous"):
        rope.forward(q, k)
    assert bits(q) == bits(q0) and bits(k) == bits(k0)


# ---------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("upstream", ["contiguous", "fused-views"])
def test_backward_into_views_of_the_gradient_buffers(
    upstream: str, layout: str, precision: Precision, rng
) -> None:
    """``R^T dq`` into the component's gradient buffers (views of them for a smaller call than
    the build), as the float64 reference; the upstream gradients contiguous, or views of a fused
    dQKV buffer one element past an aligned address (other strides than the outputs',
    element-by-element accesses), and never modified. The rest of the buffers is left alone."""
    hq, hk, d = 4, 2, 64
    cfg = rope_config((hq, hk), head_dim=d, layout=layout, rotary_dim=32)
    batch, tokens = 3, 7
    rope = cuda_rope_of(cfg, batch + 1, tokens + 2, mode=TRAINING, precision=precision)
    full = [down(g) for g in rope.input_gradients]
    for positions in (None, rng.integers(0, cfg.max_seq_len, size=(batch, tokens))):
        dq0, dk0 = random_qk(rng, cfg, batch, tokens, precision)
        if upstream == "contiguous":
            dq, dk = up(dq0), up(dk0)
        else:
            width = 1 + (hq + 2 * hk) * d
            buf0 = np.full((batch, tokens, width), np.nan, dtype_of(precision))
            buf0[..., 1 : 1 + hq * d], buf0[..., 1 + hq * d : 1 + (hq + hk) * d] = dq0, dk0
            buf = up(buf0)
            dq, dk = buf[..., 1 : 1 + hq * d], buf[..., 1 + hq * d : 1 + (hq + hk) * d]
            assert rope.op.vector_width(dq, dk) == 1
        dq_in, dk_in = rope.backward(dq, dk, positions=positions)
        if EMULATED and upstream != "contiguous":  # element by element
            launched = rope.execution_context.launches[-1]
            assert launched == cuda_rope.kernel_name(precision, 1, layout == "interleaved")
        assert bits(dq) == bits(dq0) and bits(dk) == bits(dk0)  # upstream gradients unchanged
        for out, grad in zip((dq_in, dk_in), rope.input_gradients, strict=True):  # views of them
            assert _kernels.address(out) == _kernels.address(grad)
            assert out.strides == grad.strides
        each = arange_positions(batch, tokens) if positions is None else positions
        ref_q, ref_k = reference(cfg, dq0, dk0, each, inverse=True)
        assert_close(down(dq_in), ref_q, precision)
        assert_close(down(dk_in), ref_k, precision)
        for grad, before in zip(rope.input_gradients, full, strict=True):  # the rest left alone
            after = down(grad)
            assert bits(after[batch:]) == bits(before[batch:])
            assert bits(after[:, tokens:]) == bits(before[:, tokens:])


# ---------------------------------------------------------------------------------- errors


def test_bad_calls_raise_before_any_launch(rng) -> None:
    """Positions past the table or negative, positions that are not integers, a call past the
    table at the op and a reversed last axis: each raises with Q and K unchanged, before the
    kernel is launched (the emulator's record shows no launch)."""
    cfg = rope_config((4, 2), 16, max_seq_len=64)
    rope = cuda_rope_of(cfg, 2, 8, mode=TRAINING)
    q0, k0 = random_qk(rng, cfg, 2, 8)
    q, k = up(q0), up(k0)
    launched = len(rope.execution_context.launches) if EMULATED else 0
    bad: list[tuple[Any, type[Exception], str]] = [
        (lambda: rope.prefill(q, k, 57), ValueError, "position 64"),
        (lambda: rope.prefill(q, k, -1), ValueError, ">= 0"),
        (lambda: rope.decode(q[:, :1], k[:, :1], 64), ValueError, "position 64"),
        (lambda: rope.decode(q[:, :1], k[:, :1], np.array([3, 64])), ValueError, "position 64"),
        (lambda: rope.decode(q[:, :1], k[:, :1], np.array([3, -2])), ValueError, ">= 0"),
        (lambda: rope.rotate(q, k, np.full((2, 8), 64)), ValueError, "position 64"),
        (lambda: rope.rotate(q, k, np.full((2, 8), 1.0)), TypeError, "integers"),
        (lambda: rope.backward(q, k, positions=np.full((2, 8), 99)), ValueError, "position 99"),
        (lambda: rope.op.apply(q, k, offset=60, seq_len=65), ValueError, "beyond the table"),
        (lambda: rope.op.apply(q[:, :, ::-1], k, seq_len=8), ValueError, "contiguous"),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
        assert bits(q) == bits(q0) and bits(k) == bits(k0)
    if EMULATED:
        assert len(rope.execution_context.launches) == launched


@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
def test_q_and_k_sharing_memory_are_refused_before_launch(precision: Precision, rng) -> None:
    """Device arrays are told apart by address and strides on the host: disjoint views of one
    fused buffer pass; an off-by-4 split, a stride-0 batch axis and a dk inside the dq_in
    buffer are refused with nothing changed."""
    cfg = rope_config((3, 1), head_dim=8, max_seq_len=64)
    rope = cuda_rope_of(cfg, 2, 4, mode=TRAINING, precision=precision)
    q0, k0 = random_qk(rng, cfg, 2, 4, precision)
    fused0 = np.concatenate([q0, k0], axis=2)
    fused = up(fused0)
    launched = len(rope.execution_context.launches) if EMULATED else 0
    with pytest.raises(ValueError, match="share memory"):
        rope.forward(fused[:, :, :24], fused[:, :, 20:28])
    q = up(q0)
    aliased = cupy.lib.stride_tricks.as_strided(q, q.shape, (0, *q.strides[1:]))
    with pytest.raises(ValueError, match="elements that share memory"):
        rope.forward(aliased, up(k0))
    assert bits(fused) == bits(fused0) and bits(q) == bits(q0)
    first_q, first_k = rope.backward(up(q0), up(k0))
    saved = bits(first_q), bits(first_k)
    with pytest.raises(ValueError, match="dk lies in this component's dq_in"):
        rope.backward(up(q0), first_q[:, :, :8])
    assert (bits(first_q), bits(first_k)) == saved
    if EMULATED:  # refused before launch: only the accepted backward launched
        assert len(rope.execution_context.launches) == launched + 1
    rope.forward(fused[:, :, :24], fused[:, :, 24:])  # disjoint: rotated
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 4))
    assert_close(down(fused)[:, :, :24], ref_q, precision)
    assert_close(down(fused)[:, :, 24:], ref_k, precision)


@pytest.mark.real_gpu("host and device arrays are both NumPy under emulation")
def test_host_arrays_are_refused_with_the_device_in_the_message(rng) -> None:
    cfg = rope_config((3, 1), head_dim=8)
    rope = cuda_rope_of(cfg, 2, 4)
    q, k = random_qk(rng, cfg, 2, 4)
    with pytest.raises(TypeError, match="CUDA:0"):
        rope.forward(q, k)


# ---------------------------------------------------------------------------------- tables, memory


def test_shared_table_per_configuration_and_device() -> None:
    cfg = rope_config((4, 2), head_dim=64, max_seq_len=3000)
    a = cuda_rope_of(cfg, 1, 1, name="a")
    b = cuda_rope_of(rope_config((8, 8), head_dim=64, max_seq_len=3000), 1, 1, name="b")
    assert a.table is b.table  # head counts do not matter to the table
    assert get_rope(cfg, DEVICE) is a.table
    assert get_rope(cfg, DeviceId.parse("cuda:0")) is a.table
    host = get_rope(cfg, "CPU")
    assert host is not a.table
    for array in a.table.arrays():
        assert isinstance(array, cupy.ndarray) and device_index(array) == 0
        assert array.dtype == np.float32
    assert bits(a.table.cos) == bits(host.cos)  # formed once on the host, uploaded as fp32
    assert bits(a.table.sin) == bits(host.sin)


@pytest.mark.real_gpu("CuPy's memory pool")
@pytest.mark.parametrize("precision", PRECISION_PARAMS, ids=str)
def test_memory_stats_equal_the_pool_delta_of_the_build(precision: Precision) -> None:
    """Device bytes counted by get_memory_stats() are exactly what the build took from CuPy's pool.

    Every size is a multiple of the pool's 512-byte rounding, so the two must agree to the byte.
    """
    cfg = rope_config((4, 2), head_dim=64, max_seq_len=1536, base=12345.0)
    clear_rope_cache()
    cuda_module.shared_context(
        DeviceId.parse(DEVICE)
    )  # exists before the measurement (it allocates nothing)
    pool = cupy.get_default_memory_pool()
    first = Rope("first", cfg, device=DEVICE, precision=precision)
    second = Rope("second", cfg, device=DEVICE, precision=precision)
    gc.collect()
    gc.disable()
    try:
        before = pool.used_bytes()
        first.build(BuildContext((2, 64, cfg.channels), TRAINING))
        cupy.cuda.runtime.deviceSynchronize()
        middle = pool.used_bytes()
        second.build(BuildContext((2, 64, cfg.channels), TRAINING))
        cupy.cuda.runtime.deviceSynchronize()
        after = pool.used_bytes()
    finally:
        gc.enable()
    stats = first.get_memory_stats()
    item = precision.itemsize
    grads = 2 * 64 * (cfg.channels + cfg.kv_channels) * item
    table = 2 * 1536 * 32 * 4
    assert stats.device_gradient_bytes == grads
    assert stats.device_state_bytes == table == first.table.nbytes
    assert stats.host_total_bytes == 0
    assert middle - before == stats.device_total_bytes
    assert after - middle == grads  # the second Rope shares the table
    assert second.table is first.table


# ---------------------------------------------------------------------------------- streams


@pytest.mark.real_gpu("streams")
def test_user_code_on_the_default_stream_needs_no_synchronize(rng) -> None:
    """The context's stream is ordered with the legacy default stream both ways."""
    cfg = rope_config((8, 2), head_dim=128, max_seq_len=8192)
    batch, tokens = 4, 2048
    rope = cuda_rope_of(cfg, batch, tokens)
    q0, k0 = random_qk(rng, cfg, batch, tokens)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 100))
    for _ in range(3):
        q, k = cupy.asarray(q0), cupy.asarray(k0)  # queued on the default stream
        rope.prefill(q, k, 100)  # queued on the context's stream
        got_q, got_k = q.get(), k.get()  # read on the default stream, no explicit synchronize
        assert_close(got_q, ref_q, FP32)
        assert_close(got_k, ref_k, FP32)


# ---------------------------------------------------------------------------------- foreign arrays


class _CudaArrayInterfaceOnly:
    """Exposes only another array's ``__cuda_array_interface__`` (like Numba device arrays)."""

    def __init__(self, array: Any) -> None:
        self._array = array

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._array.__cuda_array_interface__


class _DLPackOnly:
    """Exposes only another array's DLPack methods (like a JAX array)."""

    def __init__(self, array: Any) -> None:
        self._array = array

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()


@pytest.mark.real_gpu("foreign device arrays")
@pytest.mark.parametrize("wrap", [_CudaArrayInterfaceOnly, _DLPackOnly], ids=["cai", "dlpack"])
def test_as_device_array_views_foreign_arrays_without_a_copy(wrap, rng) -> None:
    cfg = rope_config((4, 2), head_dim=64)
    rope = cuda_rope_of(cfg, 2, 3)
    ctx = rope.execution_context
    q0, k0 = random_qk(rng, cfg, 2, 3)
    q_owner, k_owner = up(q0), up(k0)
    q, k = ctx.as_device_array(wrap(q_owner)), ctx.as_device_array(wrap(k_owner))
    assert isinstance(q, cupy.ndarray) and q.data.ptr == q_owner.data.ptr
    assert k.data.ptr == k_owner.data.ptr
    rope.prefill(q, k, 1000)
    ctx.release_foreign()
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 3, 1000))
    assert_close(down(q_owner), ref_q, FP32)  # rotated in the owner's memory
    assert_close(down(k_owner), ref_k, FP32)
    assert ctx.as_device_array(q0) is q0  # host arrays pass through, for the usual TypeError
    assert ctx.as_device_array(q_owner) is q_owner


@pytest.mark.real_gpu("foreign device arrays")
@pytest.mark.skipif(not COMPONENT_ADOPTS, reason=NO_ADOPT_REASON)
@pytest.mark.parametrize("wrap", [_CudaArrayInterfaceOnly, _DLPackOnly], ids=["cai", "dlpack"])
def test_rope_component_takes_foreign_arrays_directly(wrap, rng) -> None:
    cfg = rope_config((4, 2), head_dim=64)
    batch, tokens = 2, 5
    rope = cuda_rope_of(cfg, batch, tokens, mode=TRAINING)
    q0, k0 = random_qk(rng, cfg, batch, tokens)
    q_owner, k_owner = up(q0), up(k0)
    rope.prefill(wrap(q_owner), wrap(k_owner), 1000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 1000))
    assert_close(down(q_owner), ref_q, FP32)
    assert_close(down(k_owner), ref_k, FP32)
    positions = rng.integers(0, cfg.max_seq_len, size=(batch, tokens))
    q_owner, k_owner = up(q0), up(k0)
    rope.rotate(wrap(q_owner), wrap(k_owner), positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(down(q_owner), ref_q, FP32)
    q_owner, k_owner = up(q0[:, :1]), up(k0[:, :1])
    rope.decode(wrap(q_owner), wrap(k_owner), np.array([3, 2047]))
    ref_q, ref_k = reference(cfg, q0[:, :1], k0[:, :1], np.array([[3], [2047]]))
    assert_close(down(q_owner), ref_q, FP32)
    assert_close(down(k_owner), ref_k, FP32)
    dq_in, dk_in = rope.backward(wrap(up(q0)), wrap(up(k0)), positions=positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions, inverse=True)
    assert_close(down(dq_in), ref_q, FP32)
    assert_close(down(dk_in), ref_k, FP32)
    with pytest.raises(TypeError, match="CUDA:0"):
        rope.forward(q0, k0)


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _torch_precision_ok(precision: Precision) -> None:
    if precision is BF16 and not CUPY_BF16 and not COMPONENT_ADOPTS:
        pytest.skip(
            "CuPy without bfloat16: torch bf16 arrives as uint16 bits, which the Rope component "
            "accepts only with the proposed patch (storage dtype)"
        )


TORCH_DTYPES = {FP32: "float32", FP16: "float16", BF16: "bfloat16"}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_torch_tensors_are_rotated_in_place_through_dlpack(precision: Precision, rng) -> None:
    torch = _torch_cuda()
    _torch_precision_ok(precision)
    cfg = rope_config((32, 8), head_dim=128, max_seq_len=4096)
    batch, tokens = 2, 16
    rope = cuda_rope_of(cfg, batch, tokens, precision=precision)
    ctx = rope.execution_context
    dtype = getattr(torch, TORCH_DTYPES[precision])
    tq = torch.randn(batch, tokens, cfg.channels, device="cuda", dtype=torch.float32).to(dtype)
    tk = torch.randn(batch, tokens, cfg.kv_channels, device="cuda", dtype=torch.float32).to(dtype)
    q0, k0 = tq.float().cpu().numpy(), tk.float().cpu().numpy()
    q, k = ctx.as_device_array(tq), ctx.as_device_array(tk)
    assert q.data.ptr == tq.data_ptr() and k.data.ptr == tk.data_ptr()
    assert q.dtype == ctx.storage_dtype(precision.numpy_dtype)  # uint16 bits on CuPy < 14
    rope.prefill(q, k, 3000)
    ctx.release_foreign()
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 3000))
    assert_close(tq.float().cpu().numpy(), ref_q, precision)
    assert_close(tk.float().cpu().numpy(), ref_k, precision)


def test_to_host_of_a_side_stream_tensor_keeps_no_producer() -> None:
    """to_host only reads a foreign array (the import orders its producer, the copy ends
    with a synchronize): the producer's stream is not kept for release_foreign, which would
    make later work wait on a stream that may be gone."""
    torch = _torch_cuda()
    rope = cuda_rope_of(rope_config((2, 1)), 1, 2)
    ctx = rope.execution_context
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.arange(6, device="cuda")
    side.synchronize()
    np.testing.assert_array_equal(ctx.to_host(t), np.arange(6))
    assert not ctx._foreign_streams and not ctx._foreign_unordered


def test_torch_side_stream_is_ordered_both_ways(rng) -> None:
    """Tensors produced on a torch side stream: the kernel waits for them, and torch's later
    work on that stream waits for the kernel (release_foreign), with no host synchronization."""
    torch = _torch_cuda()
    cfg = rope_config((8, 2), head_dim=128, max_seq_len=8192)
    batch, tokens = 4, 2048
    rope = cuda_rope_of(cfg, batch, tokens)
    ctx = rope.execution_context
    q0, k0 = random_qk(rng, cfg, batch, tokens)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(2):
            tq = torch.from_numpy(q0).to("cuda", non_blocking=True) * 1.0
            tk = torch.from_numpy(k0).to("cuda", non_blocking=True) * 1.0
            q, k = ctx.as_device_array(tq), ctx.as_device_array(tk)
            rope.prefill(q, k, 7)
            ctx.release_foreign()
            out_q, out_k = tq * 2.0, tk * 2.0  # queued on the side stream after the kernel
    side.synchronize()
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 7))
    assert_close(out_q.cpu().numpy() / 2.0, ref_q, FP32)
    assert_close(out_k.cpu().numpy() / 2.0, ref_k, FP32)


def test_torch_fused_qkv_view_through_the_cuda_array_interface(rng) -> None:
    torch = _torch_cuda()
    hq, hk, d = 4, 2, 64
    cfg = rope_config((hq, hk), head_dim=d)
    rope = cuda_rope_of(cfg, 2, 5)
    ctx = rope.execution_context
    qkv = torch.randn(2, 5, (hq + 2 * hk) * d, device="cuda")
    before = qkv.cpu().numpy()
    q = ctx.as_device_array(_CudaArrayInterfaceOnly(qkv[:, :, : hq * d]))
    k = ctx.as_device_array(_CudaArrayInterfaceOnly(qkv[:, :, hq * d : (hq + hk) * d]))
    rope.prefill(q, k, 100)
    ctx.release_foreign()
    after = qkv.cpu().numpy()
    ref_q, ref_k = reference(
        cfg,
        before[:, :, : hq * d],
        before[:, :, hq * d : (hq + hk) * d],
        arange_positions(2, 5, 100),
    )
    assert_close(after[:, :, : hq * d], ref_q, FP32)
    assert_close(after[:, :, hq * d : (hq + hk) * d], ref_k, FP32)
    assert np.array_equal(after[:, :, (hq + hk) * d :], before[:, :, (hq + hk) * d :])


@pytest.mark.skipif(not COMPONENT_ADOPTS, reason=NO_ADOPT_REASON)
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_rope_component_takes_torch_tensors_directly(precision: Precision, rng) -> None:
    torch = _torch_cuda()
    _torch_precision_ok(precision)
    cfg = rope_config((4, 2), head_dim=64)
    rope = cuda_rope_of(cfg, 2, 5, mode=TRAINING, precision=precision)
    dtype = getattr(torch, TORCH_DTYPES[precision])
    tq = torch.randn(2, 5, cfg.channels, device="cuda").to(dtype)
    tk = torch.randn(2, 5, cfg.kv_channels, device="cuda").to(dtype)
    q0, k0 = tq.float().cpu().numpy(), tk.float().cpu().numpy()
    rope.prefill(tq, tk, 1000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 5, 1000))
    assert_close(tq.float().cpu().numpy(), ref_q, precision)
    assert_close(tk.float().cpu().numpy(), ref_k, precision)
    rope.decode(tq[:, :1], tk[:, :1], torch.tensor([3, 7], device="cuda"))
    dq_in, dk_in = rope.backward(tq, tk)
    assert isinstance(dq_in, cupy.ndarray) and isinstance(dk_in, cupy.ndarray)
    with pytest.raises(TypeError, match="CUDA:0"):
        rope.forward(tq.cpu(), tk.cpu())
