"""RoPE's CUDA kernel (``rope.cu``) as the kernel emulator runs it: what the emulator traps
where a GPU would fault or misread (misaligned vector accesses, launch bounds, dynamic shared
memory, instantiations NVRTC was not asked for, undeclared strided or writable parameters,
``None`` for a null pointer), and the source's own FP16 / BF16 conversions compiled with g++,
bit for bit against NumPy and ml_dtypes. Also: BF16 carried as uint16 bits through the Rope
component on a CuPy before 14 (no bfloat16 arrays), which the emulator's context imitates.

And what only the emulator can show of the Rope component on ``CUDA:0`` (the checks a GPU runs
too are in ``test_rope.py`` over ``device`` and ``test_rope_cuda_op.py`` over ``cuda_device``):
which ``rope_qk`` instantiation each geometry and memory layout launches (the emulator records
every launch and checks each vector access for the alignment the GPU requires), that every width
gives the bits of the widest, that the kernels give the bits of the CPU's fused (Numba) path,
that an array off whole elements is refused rather than launched (NumPy can place one there;
CuPy cannot), and decode programs on read-only buffers (NumPy's writeable flag, which CuPy
arrays lack).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_emulator import (
    COMPILER,
    EmulatedContext,
    KernelLibrary,
    emulated_context,
    emulated_cuda_devices,
)
from rope_helpers import (
    BF16,
    DECODE_CONFIGS,
    DECODE_PROGRAMS,
    FP32,
    INFERENCE,
    PRECISIONS,
    TRAINING,
    arange_positions,
    assert_close,
    expected_width,
    make_rope,
    random_qk,
    reference,
    rope_config,
    run_decode_program,
)

from mila_py import Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda import rope as cuda_rope
from mila_py.ops.cuda.rope import CudaRopeOp

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


def aligned_empty(n: int, dtype: Any, align: int = 256) -> np.ndarray:
    """``n`` elements starting at a multiple of ``align`` bytes (as CuPy allocates)."""
    dt = np.dtype(dtype)
    raw = np.empty(n * dt.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + n * dt.itemsize].view(dt)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


#: (rtol, atol) between the CUDA and CPU ops: one rounding of the storage format apart at most
#: (the CPU's NumPy path multiplies interleaved pairs as complex numbers, its own way)
PARITY: dict[Precision, tuple[float, float]] = {
    FP32: (2.0**-23, 1e-7),
    Precision.FP16: (2.0**-10, 1e-7),
    BF16: (2.0**-7, 1e-7),
}


def emulated_rope(
    config: RopeConfig,
    batch: int,
    tokens: int,
    precision: Precision = FP32,
    mode: RuntimeMode = INFERENCE,
) -> Rope:
    """A Rope on the emulated ``CUDA:0`` (its context records the kernels it launches)."""
    rope = make_rope(config, batch, tokens, mode=mode, precision=precision, device="CUDA:0")
    assert isinstance(rope.op, CudaRopeOp)
    assert isinstance(rope.execution_context, EmulatedContext)
    return rope


def launches(rope: Rope) -> list[str]:
    return rope.execution_context.launches  # type: ignore[no-any-return]


def assert_parity(actual: Any, expected: Any, precision: Precision) -> None:
    rtol, atol = PARITY[precision]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=rtol, atol=atol
    )


def name_of(precision: Precision, vec: int, layout: str) -> str:
    """The kernel instantiation launched."""
    return cuda_rope.kernel_name(precision, vec, layout == "interleaved")


def test_the_emulator_traps_what_the_gpu_would(cuda: None, monkeypatch, rng) -> None:
    """Misaligned vector accesses, too many threads for ``__launch_bounds__``, too little
    dynamic shared memory, and a template instantiation NVRTC was not asked for all raise."""
    cfg = rope_config((4, 2), 64)
    rope = make_rope(cfg, 2, 3, device="CUDA:0")
    assert isinstance(rope.op, CudaRopeOp)
    q0, k0 = random_qk(rng, cfg, 2, 3)
    buf = aligned_empty(q0.size + 1, np.float32)
    q, k = buf[1:].reshape(q0.shape), k0.copy()
    q[...] = q0
    with monkeypatch.context() as m:  # the widest access whatever the alignment
        m.setattr(CudaRopeOp, "vector_width", lambda self, *arrays: 4)
        with pytest.raises(RuntimeError, match="misaligned access"):
            rope.prefill(q, k, 0)
    with monkeypatch.context() as m:
        m.setattr(cuda_rope, "THREADS", 256)
        with pytest.raises(ValueError, match="256 threads per block, the kernel allows 128"):
            rope.prefill(q0.copy(), k0.copy(), 0)
    real_launch = _kernels.launch

    def short_shared(*args: Any, shared_mem: int = 0, **kw: Any) -> None:
        real_launch(*args, shared_mem=shared_mem // 2, **kw)  # room for cos, not for sin

    with monkeypatch.context() as m:
        m.setattr(_kernels, "launch", short_shared)
        with pytest.raises(RuntimeError, match="past the end of dynamic shared memory"):
            rope.prefill(q0.copy(), k0.copy(), 0)
    with monkeypatch.context() as m:
        m.setattr(rope.op, "_names", rope.op._names[-1:])  # rope_qk<float, 1, true> only
        with pytest.raises(ValueError, match="name_expressions"):
            rope.prefill(q0.copy(), k0.copy(), 0)


def test_strided_parameters_are_declared(library: KernelLibrary) -> None:
    """Only ``MILA_STRIDED`` pointers take views, a read-only array never meets a non-const
    pointer, and a null pointer is ``_kernels.NULL``, never ``None``."""
    kernel = library.kernels[cuda_rope.kernel_name(FP32, 1, False)]
    strided = {p.name for p in kernel.params if p.strided}
    assert strided == {"q_in", "q_out", "k_in", "k_out"}
    const = {p.name for p in kernel.params if p.pointer and p.const}
    assert const == {"q_in", "k_in", "cos_table", "sin_table", "positions"}
    x, y = np.zeros((1, 1, 4), np.float32), np.zeros((1, 1, 4), np.float32)
    table = np.zeros((4, 2), np.float32)
    shape = (np.int32(1), np.int32(1), np.int32(1), np.int32(4), np.int32(2))  # T, Hq, Hk, d, n
    args = [x, x, y, y, table, table, _kernels.NULL, np.int32(0), np.int64(0), *shape]
    args += [np.int64(4)] * 8 + [np.float32(1.0), np.int32(0)] + [np.int32(0)] * 3  # no M-RoPE
    name = cuda_rope.kernel_name(FP32, 1, False)
    with emulated_context(library) as ctx:
        launch = _kernels.launch
        launch(
            ctx, "rope.cu", name, (1,), 128, tuple(args), shared_mem=16, name_expressions=(name,)
        )
        bad = list(args)
        bad[4] = np.zeros((4, 4), np.float32)[:, :2]  # the table is not a MILA_STRIDED parameter
        with pytest.raises(ValueError, match=r"cos_table.*not C-contiguous"):
            launch(ctx, "rope.cu", name, (1,), 128, tuple(bad), name_expressions=(name,))
        bad = list(args)
        bad[1] = np.broadcast_to(x, (1, 1, 4))  # read-only, for the written q_out
        with pytest.raises(ValueError, match=r"q_out.*read-only"):
            launch(ctx, "rope.cu", name, (1,), 128, tuple(bad), name_expressions=(name,))
        bad = list(args)
        bad[6] = None  # CuPy 13 passes an unspecified value for None (cupy/cupy#9046)
        with pytest.raises(TypeError, match="None is not NULL"):
            launch(ctx, "rope.cu", name, (1,), 128, tuple(bad), name_expressions=(name,))
        bad = list(args)
        bad[0] = x.astype(np.float16)
        with pytest.raises(TypeError, match="float\\* given a float16 array"):
            launch(ctx, "rope.cu", name, (1,), 128, tuple(bad), name_expressions=(name,))


CONVERT_SOURCE = r"""
extern "C" __global__ void convert(
    const float* x, unsigned short* half_bits, unsigned short* bf16_bits, int n)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        half_bits[i] = from_f32<mila_half>(x[i]).bits;
        bf16_bits[i] = from_f32<mila_bf16>(x[i]).bits;
    }
}

extern "C" __global__ void widen(
    const unsigned short* bits, float* from_half, float* from_bf16, int n)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        mila_half h;
        mila_bf16 b;
        h.bits = b.bits = bits[i];
        from_half[i] = to_f32(h);
        from_bf16[i] = to_f32(b);
    }
}
"""


@pytest.fixture(scope="module")
def converters() -> KernelLibrary:
    """The RoPE source's own 16-bit conversions (PTX cvt for FP16, integer code for BF16)."""
    return KernelLibrary([_kernels.source("rope.cu") + CONVERT_SOURCE])


def _floats_to_round(rng: np.random.Generator) -> np.ndarray:
    """float32 values around every 16-bit value: exact ones, ties, one ulp either side of the
    ties, overflow and underflow edges, infinities, NaNs, and random bit patterns."""
    bits = np.arange(1 << 16, dtype=np.uint32)
    values = [
        bits.astype(np.uint16).view(np.float16).astype(np.float32),  # every fp16 value
        (bits << 16).view(np.float32),  # every bf16 value
    ]
    for exact in list(values):
        finite = np.sort(exact[np.isfinite(exact)])
        ties = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
        values += [ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, -np.inf)]
    edges = [65504, 65519.996, 65520, 65536, 3.4e38, 2.0**-24, 2.0**-25, 2.0**-26, 1e-45, 0.0]
    values.append(np.array(edges + [-e for e in edges], np.float32))
    values.append(rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32))
    values[-1] = values[-1].view(np.float32)
    return np.concatenate(values).astype(np.float32)


def test_fp16_and_bf16_conversions_round_to_nearest_even(converters: KernelLibrary, rng) -> None:
    """The kernel's storage conversions against NumPy (fp16) and ml_dtypes (bf16), bit for bit
    on every non-NaN input; NaN stays NaN (PTX gives the canonical fp16 NaN 0x7fff)."""
    x = _floats_to_round(rng)
    half, bf16 = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    ctx = EmulatedContext()
    converters.launch(ctx, "", "convert", (1,), 256, (x, half, bf16, np.int32(x.size)))
    nan = np.isnan(x)
    with np.errstate(over="ignore", invalid="ignore"):  # the infinities and NaNs on purpose
        want_half = x.astype(np.float16).view(np.uint16)
        want_bf16 = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(half[~nan], want_half[~nan])
    np.testing.assert_array_equal(bf16[~nan], want_bf16[~nan])
    assert (half[nan] == 0x7FFF).all()
    assert np.isnan(bf16[nan].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert ((bf16[nan] & 0x8000) == (x[nan].view(np.uint32) >> 16 & 0x8000)).all()  # sign kept
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    from_half, from_bf16 = np.empty(every.size, np.float32), np.empty(every.size, np.float32)
    converters.launch(
        ctx, "", "widen", (1,), 256, (every, from_half, from_bf16, np.int32(every.size))
    )
    np.testing.assert_array_equal(from_half, every.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(from_bf16, every.view(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_bf16_as_uint16_bits_on_a_cupy_without_bfloat16(
    cuda: None, monkeypatch, layout: str, rng
) -> None:
    """A CuPy older than 14 has no bfloat16 dtype: its context carries BF16 arrays as their
    uint16 bits (torch bf16 tensors arrive so through DLPack). A BF16 Rope built there takes
    and writes those bits: the bits the BF16 Rope of a CuPy 14 writes, in prefill, ragged
    decode and backward. A bfloat16 array is refused there, untouched."""
    cfg = rope_config((4, 2), 64, layout=layout)
    q0, k0 = random_qk(rng, cfg, 2, 3, BF16)
    dq0, dk0 = random_qk(rng, cfg, 2, 3, BF16)
    positions = np.array([40, 7])
    native = make_rope(cfg, 2, 3, mode=TRAINING, precision=BF16, device="CUDA:0")
    want_q, want_k = q0.copy(), k0.copy()
    native.prefill(want_q, want_k, 9)
    want_dq, want_dk = (x.copy() for x in native.backward(dq0, dk0))
    want_q1, want_k1 = q0[:, :1].copy(), k0[:, :1].copy()
    native.decode(want_q1, want_k1, positions)

    monkeypatch.setattr(EmulatedContext, "bfloat16_native", False)  # contexts made from here on
    rope = make_rope(cfg, 2, 3, mode=TRAINING, precision=BF16, device="CUDA:0")
    assert not rope.execution_context.bfloat16_native
    q, k = q0.view(np.uint16).copy(), k0.view(np.uint16).copy()
    rope.prefill(q, k, 9)
    assert same_bits(q, want_q) and same_bits(k, want_k)
    dq, dk = rope.backward(dq0.view(np.uint16), dk0.view(np.uint16))
    assert dq.dtype == np.uint16 and same_bits(dq, want_dq) and same_bits(dk, want_dk)
    q1, k1 = q0[:, :1].view(np.uint16).copy(), k0[:, :1].view(np.uint16).copy()
    rope.decode(q1, k1, positions)
    assert same_bits(q1, want_q1) and same_bits(k1, want_k1)
    as_bf16 = q0.copy()
    with pytest.raises(TypeError, match="dtype"):
        rope.prefill(as_bf16, k0.copy(), 0)
    assert same_bits(as_bf16, q0)


# ---------------------------------------------------------------------------------- launches

#: (Hq, Hk), head_dim, rotary_dim, and the widths (elements) the op must pick for aligned,
#: contiguous Q and K: (FP32 half, FP32 interleaved, 16-bit half, 16-bit interleaved)
GEOMETRIES = {
    "llama-d128": ((8, 2), 128, 0, (4, 4, 8, 8)),
    "gqa32x8-partial64": ((32, 8), 128, 64, (4, 4, 8, 8)),  # 640 items > 128 threads
    "partial8of16": ((6, 2), 16, 8, (4, 4, 4, 8)),
    "d12": ((5, 1), 12, 0, (2, 4, 2, 4)),
    "d10-partial4": ((8, 4), 10, 4, (2, 2, 2, 2)),  # the head, not the rows, limits the width
    "mha-d6": ((3, 3), 6, 0, (1, 2, 1, 2)),
    "d2": ((2, 1), 2, 0, (1, 2, 1, 2)),
}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_each_geometry_launches_its_widest_aligned_kernel(
    cuda: None, geometry: str, layout: str, precision: Precision, rng
) -> None:
    """Aligned, contiguous Q and K of each geometry: the instantiation of the widest access
    the head, the rotated span and the addresses allow, as the CPU and the reference."""
    heads, head_dim, rotary_dim, widths = GEOMETRIES[geometry]
    cfg = rope_config(heads, head_dim, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 5
    rope = emulated_rope(cfg, batch, tokens, precision)
    cpu = make_rope(cfg, batch, tokens, precision=precision)
    vec = widths[(precision.itemsize == 2) * 2 + (layout == "interleaved")]
    for offset in (0, 7, cfg.max_seq_len - tokens):
        q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
        q = aligned_empty(q0.size, q0.dtype).reshape(q0.shape)
        k = aligned_empty(k0.size, k0.dtype).reshape(k0.shape)
        q[...], k[...] = q0, k0
        if offset == 0:
            rope.forward(q, k)
        else:
            rope.prefill(q, k, offset)
        assert launches(rope)[-1] == name_of(precision, vec, layout)
        cpu_q, cpu_k = q0.copy(), k0.copy()
        cpu.prefill(cpu_q, cpu_k, offset)
        assert_parity(q, cpu_q, precision)
        assert_parity(k, cpu_k, precision)
        ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, offset))
        assert_close(q, ref_q, precision)
        assert_close(k, ref_k, precision)
        if rotary_dim:  # channels past the rotated ones: bit for bit the input
            rest = np.s_[..., rotary_dim:]
            for x, x0, h in ((q, q0, heads[0]), (k, k0, heads[1])):
                shape = (batch, tokens, h, head_dim)
                assert same_bits(x.reshape(shape)[rest], x0.reshape(shape)[rest])


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_bit_for_bit_with_the_cpu_fused_path(
    cuda: None, layout: str, precision: Precision, rng
) -> None:
    """The kernels use the CPU kernels' order of operations and no FMA: identical bits."""
    cfg = rope_config((4, 2), 64, rotary_dim=48, layout=layout)
    rope = emulated_rope(cfg, 3, 7, precision)
    cpu = make_rope(cfg, 3, 7, precision=precision)
    if not cpu.op.uses_fused:
        pytest.skip("the CPU op's fused (Numba) path is not in use")
    q0, k0 = random_qk(rng, cfg, 3, 7, precision)
    q, k = q0.copy(), k0.copy()
    rope.prefill(q, k, 1500)
    cpu_q, cpu_k = q0.copy(), k0.copy()
    cpu.prefill(cpu_q, cpu_k, 1500)
    assert same_bits(q, cpu_q) and same_bits(k, cpu_k)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 8], ids=lambda s: f"shift{s}")
def test_every_vector_width_gives_the_same_bits(
    cuda: None, shift: int, layout: str, precision: Precision, rng
) -> None:
    """Q and K (or the upstream gradients of backward) ``shift`` elements past an aligned
    address: each width down to one element is taken (and checked aligned by the emulator),
    forward and inverse, all with the bits of the aligned call."""
    cfg = rope_config((4, 2), 128, layout=layout)
    batch, tokens = 2, 3
    rope = emulated_rope(cfg, batch, tokens, precision, mode=TRAINING)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    aligned_q, aligned_k = q0.copy(), k0.copy()
    rope.prefill(aligned_q, aligned_k, 77)
    aligned_dq, aligned_dk = (x.copy() for x in rope.backward(q0, k0))
    q_buf, k_buf = (
        aligned_empty(q0.size + shift, q0.dtype),
        aligned_empty(k0.size + shift, q0.dtype),
    )
    q_buf[:shift] = k_buf[:shift] = np.nan
    q, k = q_buf[shift:].reshape(q0.shape), k_buf[shift:].reshape(k0.shape)
    q[...], k[...] = q0, k0
    rope.prefill(q, k, 77)
    vec = expected_width(precision, layout, 128, 64, [shift * precision.itemsize])
    if shift == 1:
        assert vec == 1
    if shift in (0, 8):
        assert vec * precision.itemsize == 16
    assert launches(rope)[-1] == name_of(precision, vec, layout)
    assert same_bits(q, aligned_q) and same_bits(k, aligned_k)
    assert np.isnan(q_buf[:shift].astype(np.float32)).all()  # nothing written before Q
    assert np.isnan(k_buf[:shift].astype(np.float32)).all()
    q[...], k[...] = q0, k0
    dq_in, dk_in = rope.backward(q, k)
    assert launches(rope)[-1] == name_of(precision, vec, layout)
    assert same_bits(dq_in, aligned_dq) and same_bits(dk_in, aligned_dk)


def test_arrays_off_whole_elements_are_refused(cuda: None, rng) -> None:
    """A float32 Q two bytes past an aligned address: no access width is aligned, so the op
    raises instead of launching (a misaligned load would trap on the GPU)."""
    cfg = rope_config((2, 1), 8)
    rope = emulated_rope(cfg, 1, 3)
    q0, k0 = random_qk(rng, cfg, 1, 3)
    raw = aligned_empty(q0.nbytes + 2, np.uint8)
    q = raw[2:].view(np.float32).reshape(q0.shape)
    q[...] = q0
    k = k0.copy()
    with pytest.raises(ValueError, match="whole elements"):
        rope.prefill(q, k, 0)
    assert same_bits(q, q0) and same_bits(k, k0)
    assert not launches(rope)


def test_one_op_through_changing_layouts(cuda: None, rng) -> None:
    """The op keeps the width of each alignment it has seen: one op, called on aligned, shifted,
    fused-QKV and sliced views in turn (and again), launches each time the width and strides of
    that call, not of an earlier one."""
    cfg = rope_config((4, 2), 16)
    hq, hk, d = 4, 2, 16
    rope = emulated_rope(cfg, 2, 4)
    cpu = make_rope(cfg, 2, 4)
    item = FP32.itemsize

    def plain(shift: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        q = aligned_empty(2 * 4 * hq * d + shift, np.float32)[shift:].reshape(2, 4, hq * d)
        k = aligned_empty(2 * 4 * hk * d + shift, np.float32)[shift:].reshape(2, 4, hk * d)
        return q, k, [shift * item]

    def fused(before: int, after: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        width = before + (hq + 2 * hk) * d + after
        qkv = aligned_empty(2 * 4 * width, np.float32).reshape(2, 4, width)
        k_at = before + hq * d
        q, k = qkv[..., before:k_at], qkv[..., k_at : k_at + hk * d]
        return q, k, [before * item, k_at * item, width * item]

    def sliced() -> tuple[np.ndarray, np.ndarray, list[int]]:
        q = aligned_empty(3 * 6 * hq * d, np.float32).reshape(3, 6, hq * d)[1:, 2:]
        k = aligned_empty(3 * 6 * hk * d, np.float32).reshape(3, 6, hk * d)[1:, 2:]
        return q, k, [(6 + 2) * hq * d * item, (6 + 2) * hk * d * item]

    cases = [plain(0), plain(1), fused(0, 0), plain(2), fused(2, 1), sliced(), plain(0)]
    for q, k, spans in [*cases, cases[1], cases[4]]:
        q[...] = rng.standard_normal(q.shape)
        k[...] = rng.standard_normal(k.shape)
        cpu_q, cpu_k = q.copy(), k.copy()
        rope.prefill(q, k, 33)
        cpu.prefill(cpu_q, cpu_k, 33)
        vec = expected_width(FP32, "half", d, d // 2, spans)
        assert launches(rope)[-1] == name_of(FP32, vec, "half")
        assert_parity(q, cpu_q, FP32)
        assert_parity(k, cpu_k, FP32)


# ---------------------------------------------------------------------------------- decode programs


@settings(max_examples=40, deadline=None)
@given(program=DECODE_PROGRAMS, config=DECODE_CONFIGS, seed=st.integers(0, 2**16))
def test_any_program_of_decodes_matches_a_fresh_checked_component(  # type: ignore[no-untyped-def]
    library, program, config, seed
) -> None:
    """As on the CPU (``test_rope.py``): decode calls in any order on two buffer pairs,
    with bad positions, read-only, reshaped or retyped buffers, each equal to a fresh
    component's call on copies. (A read-only NumPy buffer exists only in emulation, where the
    emulator refuses it at launch; CuPy arrays have no writeable flag.)"""
    with emulated_cuda_devices(library):
        run_decode_program(program, np.random.default_rng(seed), device="CUDA:0", config=config)
