"""RoPE's CUDA op on the CPU: the Rope component on an emulated ``CUDA:0``, its kernel run as C++.

Under :func:`kernel_emulator.emulated_cuda_devices` a ``Rope(device="CUDA:0")`` runs
:class:`~mila_py.ops.cuda.rope.CudaRopeOp` unchanged (host checks, table uploads, vector-width
choice, launch arguments) on NumPy arrays, and the ``rope_qk`` instantiation it picks runs from
its CUDA source: threads as fibers, the cos/sin row staged in dynamic shared memory, 16-bit
values carried as raw bits and converted by the kernel's own code (BF16) or by the emulated PTX
``cvt`` (FP16), every vector access checked for the alignment the GPU requires.

Each case is compared with the CPU component on the same inputs. Both compute in fp32 with the
same order of operations, so results agree to within one rounding of the storage format
(:data:`PARITY`); with the CPU's fused (Numba) path they agree bit for bit. Memory next to Q and
K (V, padding) is checked untouched. What this cannot check (NVRTC, CuPy, streams, the real
``cvt`` instructions, timing) is left to ``tests/test_rope_cuda.py`` on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_emulator import (
    COMPILER,
    EmulatedContext,
    emulated_cuda_devices,
)
from rope_helpers import (
    BF16,
    DECODE_CONFIGS,
    DECODE_PROGRAMS,
    FP16,
    FP32,
    INFERENCE,
    NARROW_POSITIONS,
    PRECISIONS,
    TRAINING,
    arange_positions,
    assert_close,
    check_negative_positions_refused,
    dtype_of,
    make_rope,
    random_qk,
    reference,
    rope_config,
    run_decode_program,
)

from mila_py import Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.ops.cuda import rope as cuda_rope
from mila_py.ops.cuda.rope import CudaRopeOp

pytestmark = pytest.mark.skipif(COMPILER is None, reason="the kernel emulator needs g++")

DEVICE = "CUDA:0"
#: (rtol, atol) between the CUDA and CPU ops: one rounding of the storage format apart at most
#: (the CPU's NumPy path multiplies interleaved pairs as complex numbers, its own way)
PARITY: dict[Precision, tuple[float, float]] = {
    FP32: (2.0**-23, 1e-7),
    FP16: (2.0**-10, 1e-7),
    BF16: (2.0**-7, 1e-7),
}
BITS = {FP32: np.uint32, FP16: np.uint16, BF16: np.uint16}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240607)


# ---------------------------------------------------------------------------------- helpers


def cuda_rope_of(
    config: RopeConfig,
    batch: int,
    tokens: int,
    precision: Precision = FP32,
    mode: RuntimeMode = INFERENCE,
) -> Rope:
    rope = make_rope(config, batch, tokens, mode=mode, precision=precision, device=DEVICE)
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


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def aligned_empty(n: int, dtype: Any, align: int = 256) -> np.ndarray:
    """``n`` elements starting at a multiple of ``align`` bytes (as CuPy allocates)."""
    dt = np.dtype(dtype)
    raw = np.empty(n * dt.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + n * dt.itemsize].view(dt)


def expected_width(precision: Precision, layout: str, head_dim: int, n_freq: int, spans) -> int:
    """The widest access the op documents: every byte offset and row stride in ``spans`` and the
    rotated span (``n`` for "half", ``2n`` for "interleaved") and head a multiple of it."""
    item = precision.itemsize
    span = 2 * n_freq if layout == "interleaved" else n_freq
    for nbytes in (16, 8, 4, 2):
        vec = nbytes // item
        if vec < 2:
            break
        if span % vec == 0 and head_dim % vec == 0 and all(s % nbytes == 0 for s in spans):
            return vec
    return 1


def rotate_like_the_cpu(
    rope: Rope, cpu: Rope, q0: np.ndarray, k0: np.ndarray, positions: Any, precision: Precision
) -> tuple[np.ndarray, np.ndarray]:
    """``rope.rotate`` of copies of ``q0``, ``k0``, checked against the CPU component on the same
    inputs and the float64 reference; returns the rotated copies."""
    q, k = q0.copy(), k0.copy()
    rope.rotate(q, k, positions)
    cpu_q, cpu_k = q0.copy(), k0.copy()
    cpu.rotate(cpu_q, cpu_k, positions)
    assert_parity(q, cpu_q, precision)
    assert_parity(k, cpu_k, precision)
    ref_q, ref_k = reference(rope.config, q0, k0, positions)
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)
    return q, k


def name_of(precision: Precision, vec: int, layout: str) -> str:
    """The kernel instantiation launched."""
    return cuda_rope.kernel_name(precision, vec, layout == "interleaved")


# ---------------------------------------------------------------------------------- geometry

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
def test_forward_and_prefill_match_cpu(
    cuda: None, geometry: str, layout: str, precision: Precision, rng
) -> None:
    heads, head_dim, rotary_dim, widths = GEOMETRIES[geometry]
    cfg = rope_config(heads, head_dim, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 5
    rope = cuda_rope_of(cfg, batch, tokens, precision)
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
    rope = cuda_rope_of(cfg, 3, 7, precision)
    cpu = make_rope(cfg, 3, 7, precision=precision)
    if not cpu.op.uses_fused:
        pytest.skip("the CPU op's fused (Numba) path is not in use")
    q0, k0 = random_qk(rng, cfg, 3, 7, precision)
    q, k = q0.copy(), k0.copy()
    rope.prefill(q, k, 1500)
    cpu_q, cpu_k = q0.copy(), k0.copy()
    cpu.prefill(cpu_q, cpu_k, 1500)
    assert same_bits(q, cpu_q) and same_bits(k, cpu_k)


# ---------------------------------------------------------------------------------- memory layouts


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
    rope = cuda_rope_of(cfg, batch, tokens, precision, mode=TRAINING)
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


#: fused QKV rows: (elements before Q, elements between Q and K, elements after V)
FUSED = {
    "plain": (0, 0, 0),
    "k-at-odd-element": (0, 1, 0),
    "q-and-k-shifted-2": (2, 0, 0),
    "odd-row-stride": (0, 0, 1),
    "shift4-row-pad4": (4, 0, 4),
}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize(
    ("heads", "head_dim", "rotary_dim"),
    [((4, 1), 12, 8), ((3, 3), 64, 0), ((6, 2), 16, 0)],
    ids=["mqa-d12-partial", "mha-d64", "gqa-d16"],
)
def test_views_of_a_fused_qkv_buffer(
    cuda: None,
    heads: tuple[int, int],
    head_dim: int,
    rotary_dim: int,
    fused: str,
    layout: str,
    precision: Precision,
    rng,
) -> None:
    """Q and K as strided views of one QKV buffer: rotated through the views (row strides
    passed to the kernel), the widest access their offsets allow, V and padding untouched."""
    hq, hk = heads
    d = head_dim
    before, gap, after = FUSED[fused]
    cfg = rope_config(heads, d, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 5
    rope = cuda_rope_of(cfg, batch, tokens, precision)
    cpu = make_rope(cfg, batch, tokens, precision=precision)
    q_at, k_at = before, before + hq * d + gap
    width = k_at + 3 * hk * d + after  # K, V, padding
    n_freq = rope.table.n_freq
    item = precision.itemsize
    for method in ("prefill", "decode", "rotate"):
        n_t = 1 if method == "decode" else tokens
        qkv = aligned_empty(batch * n_t * width, dtype_of(precision)).reshape(batch, n_t, width)
        qkv[...] = rng.standard_normal(qkv.shape)
        qkv[..., :before] = np.nan
        qkv[..., q_at + hq * d : k_at] = np.nan
        qkv[..., width - after :] = np.nan
        qkv0 = qkv.copy()
        q, k = qkv[..., q_at : q_at + hq * d], qkv[..., k_at : k_at + hk * d]
        arg: Any = {
            "prefill": 900,
            "decode": np.array([7, 1999]),
            "rotate": rng.integers(0, cfg.max_seq_len, size=(batch, tokens)),
        }[method]
        getattr(rope, method)(q, k, arg)
        vec = expected_width(precision, layout, d, n_freq, [q_at * item, k_at * item, width * item])
        assert launches(rope)[-1] == name_of(precision, vec, layout)
        cpu_q = np.ascontiguousarray(qkv0[..., q_at : q_at + hq * d])
        cpu_k = np.ascontiguousarray(qkv0[..., k_at : k_at + hk * d])
        getattr(cpu, method)(cpu_q, cpu_k, arg)
        assert_parity(q, cpu_q, precision)
        assert_parity(k, cpu_k, precision)
        untouched = np.ones(width, bool)
        untouched[q_at : q_at + hq * d] = untouched[k_at : k_at + hk * d] = False
        assert same_bits(qkv[..., untouched], qkv0[..., untouched])  # V, padding, NaN canaries


def test_a_batch_slice_and_a_token_slice(cuda: None, rng) -> None:
    """Views along B and T (strides of the larger buffer): only the slice is rotated."""
    cfg = rope_config((4, 2), 16)
    rope = cuda_rope_of(cfg, 3, 8)
    cpu = make_rope(cfg, 3, 8)
    q_big, k_big = random_qk(rng, cfg, 4, 10)
    q0, k0 = q_big.copy(), k_big.copy()
    view = np.s_[1:4, 2:9]
    rope.prefill(q_big[view], k_big[view], 40)
    cpu_q, cpu_k = q0[view].copy(), k0[view].copy()
    cpu.prefill(cpu_q, cpu_k, 40)
    assert_parity(q_big[view], cpu_q, FP32)
    assert_parity(k_big[view], cpu_k, FP32)
    outside = np.ones(q_big.shape[:2], bool)
    outside[view] = False
    assert same_bits(q_big[outside], q0[outside]) and same_bits(k_big[outside], k0[outside])


# ---------------------------------------------------------------------------------- positions


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_decode_per_sequence_positions_and_at_one_position(
    cuda: None, layout: str, precision: Precision, rng
) -> None:
    cfg = rope_config((5, 1), 12, layout=layout, max_seq_len=64)
    batch = 4
    rope = cuda_rope_of(cfg, batch, 64, precision)
    cpu = make_rope(cfg, batch, 64, precision=precision)
    q0, k0 = random_qk(rng, cfg, batch, 64, precision)
    whole_q, whole_k = q0.copy(), k0.copy()
    rope.forward(whole_q, whole_k)
    for t in (0, 13, 63):  # one position for every sequence: the rows of forward
        q, k = q0[:, t : t + 1].copy(), k0[:, t : t + 1].copy()
        rope.decode(q, k, t if t % 2 else np.int64(t))
        assert same_bits(q, whole_q[:, t : t + 1]) and same_bits(k, whole_k[:, t : t + 1])
    positions = np.array([3, 63, 0, 17])
    rows = np.arange(batch), positions  # token p of sequence b: forward rotated it at p
    q, k = q0[rows][:, None], k0[rows][:, None]
    rope.decode(q, k, positions)
    cpu_q, cpu_k = q0[rows][:, None], k0[rows][:, None]
    cpu.decode(cpu_q, cpu_k, positions)
    assert_parity(q, cpu_q, precision)
    assert_parity(k, cpu_k, precision)
    for b, p in enumerate(positions):
        assert same_bits(q[b, 0], whole_q[b, p]) and same_bits(k[b, 0], whole_k[b, p])


@pytest.mark.parametrize(
    "make_positions",
    [
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)),
        lambda rng, b, t: rng.integers(1000, 2048, size=(t,)),
        lambda rng, b, t: rng.integers(0, 2048, size=(b, 1)),
        lambda rng, b, t: rng.integers(0, 2048, size=(b, t)).astype(np.int32),
        lambda rng, b, t: np.full((b, t), 2047),
    ],
    ids=["BT", "T", "B1", "int32", "last-row"],
)
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotate_at_explicit_positions(
    cuda: None, layout: str, precision: Precision, make_positions, rng
) -> None:
    cfg = rope_config((6, 2), 16, rotary_dim=12, layout=layout)
    batch, tokens = 3, 5
    rope = cuda_rope_of(cfg, batch, tokens, precision)
    cpu = make_rope(cfg, batch, tokens, precision=precision)
    positions = make_positions(rng, batch, tokens)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    rotate_like_the_cpu(rope, cpu, q0, k0, positions, precision)


#: M-RoPE: (head_dim, rotary_dim, section, interleaved, layout, scaling)
MROPE = {
    "qwen2vl": (16, 0, (2, 3, 3), False, "half", None),
    "qwen3vl": (32, 0, (6, 5, 5), True, "half", None),
    "glm4v-partial": (16, 8, (2, 1, 1), False, "interleaved", None),
    "dynamic-rows": (
        16, 0, (2, 3, 3), False, "half",
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256},
    ),
}  # fmt: skip


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("case", list(MROPE))
def test_mrope_positions_per_axis(cuda: None, case: str, precision: Precision, rng) -> None:
    """Positions ``[3, B, T]``: the kernel picks each frequency's row by its axis (or, past a
    dynamic type's original length, rotates by rows made on the host), forward and backward."""
    head_dim, rotary_dim, section, interleaved, layout, scaling = MROPE[case]
    cfg = rope_config(
        (4, 2), head_dim, rotary_dim=rotary_dim, layout=layout, scaling=scaling,
        mrope_section=section, mrope_interleaved=interleaved,
    )  # fmt: skip
    batch, tokens = 2, 5
    rope = cuda_rope_of(cfg, batch, tokens, precision, mode=TRAINING)
    cpu = make_rope(cfg, batch, tokens, precision=precision, mode=TRAINING)
    positions = rng.integers(0, 1500, size=(3, batch, tokens))
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    q, k = rotate_like_the_cpu(rope, cpu, q0, k0, positions, precision)
    dq, dk = rope.backward(q, k, positions[:, :1])  # [3, 1, T]: broadcast over sequences
    cpu_dq, cpu_dk = cpu.backward(q, k, positions[:, :1])
    assert_parity(dq, cpu_dq, precision)
    assert_parity(dk, cpu_dk, precision)
    # decode: a position per axis and sequence
    q1, k1 = q0[:, :1].copy(), k0[:, :1].copy()
    rope.decode(q1, k1, positions[:, :, 0])
    ref_q, ref_k = reference(cfg, q0[:, :1], k0[:, :1], positions[:, :, :1])
    assert_close(q1, ref_q, precision)
    assert_close(k1, ref_k, precision)


# ---------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial8of12"])
@pytest.mark.parametrize("upstream", ["contiguous", "fused-views"])
def test_backward_is_the_inverse_rotation_into_the_gradient_buffers(
    cuda: None, upstream: str, rotary_dim: int, layout: str, precision: Precision, rng
) -> None:
    """``R^T dq`` into the component's buffers (views of them for a smaller call than the
    build); the upstream gradients contiguous, or views of a fused dQKV buffer one element past
    an aligned address (other strides than the outputs', element-by-element accesses)."""
    hq, hk, d = 3, 1, 12
    cfg = rope_config((hq, hk), d, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 6
    rope = cuda_rope_of(cfg, batch + 1, tokens + 2, precision, mode=TRAINING)
    cpu = make_rope(cfg, batch, tokens, precision=precision, mode=TRAINING)
    full = [x.copy() for x in rope.input_gradients]
    for positions in (None, rng.integers(0, cfg.max_seq_len, size=(batch, tokens))):
        dq0, dk0 = random_qk(rng, cfg, batch, tokens, precision)
        if upstream == "contiguous":
            dq, dk = dq0.copy(), dk0.copy()
        else:
            width = 1 + (hq + 2 * hk) * d
            buf = aligned_empty(batch * tokens * width, dq0.dtype).reshape(batch, tokens, width)
            buf[...] = np.nan
            dq, dk = buf[..., 1 : 1 + hq * d], buf[..., 1 + hq * d : 1 + (hq + hk) * d]
            dq[...], dk[...] = dq0, dk0
        dq_in, dk_in = rope.backward(dq, dk, positions=positions)
        if upstream != "contiguous":
            assert launches(rope)[-1] == name_of(precision, 1, layout)
        assert same_bits(dq, dq0) and same_bits(dk, dk0)  # upstream gradients not modified
        assert np.shares_memory(dq_in, rope.input_gradients[0])
        cpu_dq_in, cpu_dk_in = cpu.backward(dq0.copy(), dk0.copy(), positions=positions)
        assert_parity(dq_in, cpu_dq_in, precision)
        assert_parity(dk_in, cpu_dk_in, precision)
        pos = arange_positions(batch, tokens) if positions is None else positions
        ref_q, ref_k = reference(cfg, dq0, dk0, pos, inverse=True)
        assert_close(dq_in, ref_q, precision)
        assert_close(dk_in, ref_k, precision)
        if rotary_dim:  # out of place: the kernel copies the channels it does not rotate
            shape = (batch, tokens, hq, d)
            assert same_bits(dq_in.reshape(shape)[..., 8:], dq0.reshape(shape)[..., 8:])
        for grad, before in zip(rope.input_gradients, full, strict=True):  # the rest left alone
            assert same_bits(grad[batch:], before[batch:])
            assert same_bits(grad[:, tokens:], before[:, tokens:])


# ---------------------------------------------------------------------------------- scaling


def _scalings(n: int) -> dict[str, dict[str, Any]]:
    """Scaling dicts (``n`` pairs, for LongRoPE's lists); original context 1024 of 4096."""
    orig = 1024
    return {
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig,
        },
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig},
        "dynamic": {
            "rope_type": "dynamic",
            "factor": 4.0,
            "original_max_position_embeddings": orig,
        },
        "longrope": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(n)],
            "long_factor": [1.0 + 1.7 * i for i in range(n)],
            "original_max_position_embeddings": orig,
        },
    }


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("name", list(_scalings(1)))
def test_scaling_types(
    cuda: None, name: str, rotary_dim: int, layout: str, precision: Precision, rng
) -> None:
    """Fixed tables (llama3, yarn with its attention factor), LongRoPE's long table, and
    dynamic NTK past the original context: rows computed per call and uploaded, read through
    uploaded positions (or offset 0)."""
    head_dim, max_seq = 16, 4096
    n = (rotary_dim or head_dim) // 2
    cfg = rope_config(
        (3, 1),
        head_dim,
        rotary_dim=rotary_dim,
        max_seq_len=max_seq,
        layout=layout,
        scaling=_scalings(n)[name],
    )
    batch, tokens = 2, 4
    rope = cuda_rope_of(cfg, batch, tokens, precision)
    cpu = make_rope(cfg, batch, tokens, precision=precision)
    calls: list[tuple[str, Any]] = [
        ("prefill", 1000),
        ("prefill", 1024 - 2),  # crosses the original context
        ("prefill", max_seq - tokens),
        ("rotate", rng.integers(1000, max_seq, size=(batch, tokens))),
        ("rotate", rng.integers(0, 1024, size=(tokens,))),
        ("decode", np.array([1000, 3999])),
        ("decode", max_seq - 1),
    ]
    for method, arg in calls:
        n_t = 1 if method == "decode" else tokens
        q0, k0 = random_qk(rng, cfg, batch, n_t, precision)
        q, k = q0.copy(), k0.copy()
        getattr(rope, method)(q, k, arg)
        cpu_q, cpu_k = q0.copy(), k0.copy()
        getattr(cpu, method)(cpu_q, cpu_k, arg)
        assert_parity(q, cpu_q, precision)
        assert_parity(k, cpu_k, precision)
    if name == "yarn":
        assert rope.attention_scaling > 1.0


# ---------------------------------------------------------------------------------- decode loops


def _decode_loop_cases(n: int) -> dict[str, Any]:
    scalings = _scalings(n)
    return {"none": None, "dynamic": scalings["dynamic"], "longrope": scalings["longrope"]}


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize("scaling", ["none", "dynamic", "longrope"])
def test_a_decode_loop_on_the_same_buffers_matches_the_cpu(
    cuda: None, scaling: str, precision: Precision, rng
) -> None:
    """A decode loop writes each new token into the same Q/K buffers, at positions across the
    original context (1024) where dynamic NTK computes rows per call and LongRoPE switches
    tables: every step as the CPU's."""
    cfg = rope_config((3, 1), 16, max_seq_len=4096, scaling=_decode_loop_cases(8)[scaling])
    batch = 2
    rope = cuda_rope_of(cfg, batch, 1, precision)
    cpu = make_rope(cfg, batch, 1, precision=precision)
    q, k = random_qk(rng, cfg, batch, 1, precision)
    for position in (5, 6, 7, 1022, 1023, 1024, 1500, 4095, 3, np.int64(9), 1023):
        q0, k0 = random_qk(rng, cfg, batch, 1, precision)
        q[...], k[...] = q0, k0  # the loop's new token, in place
        rope.decode(q, k, position)
        cpu_q, cpu_k = q0.copy(), k0.copy()
        cpu.decode(cpu_q, cpu_k, position)
        assert_parity(q, cpu_q, precision)
        assert_parity(k, cpu_k, precision)


#: (B, T, M-RoPE)
EXPLICIT = {
    "decode-B4": (4, 1, False),
    "decode-B600": (600, 1, False),
    "rotate-8x64": (8, 64, False),
    "mrope-decode-B21": (21, 1, True),
    "mrope-rotate-2x30": (2, 30, True),
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("case", list(EXPLICIT))
def test_explicit_positions_go_to_the_kernel_as_int32_device_memory(
    cuda: None, monkeypatch, case: str, layout: str, rng
) -> None:
    """Explicit positions (``[B, T]``, ``[3, B, T]`` with M-RoPE) are uploaded once per call as
    int32, in the shape the kernel indexes, and rotate as the CPU does."""
    batch, tokens, mrope = EXPLICIT[case]
    section = {"mrope_section": (2, 1, 1)} if mrope else {}
    cfg = rope_config((2, 1), 8, layout=layout, **section)
    rope = cuda_rope_of(cfg, batch, tokens)
    cpu = make_rope(cfg, batch, tokens)
    uploads: list[np.ndarray] = []
    ctx = rope.execution_context
    real_to_device = ctx.to_device
    monkeypatch.setattr(ctx, "to_device",
                        lambda a: uploads.append(np.array(a)) or real_to_device(a))  # fmt: skip
    shape = (3, batch, tokens) if mrope else (batch, tokens)
    positions = rng.integers(0, cfg.max_seq_len, size=shape)
    q0, k0 = random_qk(rng, cfg, batch, tokens)
    q, k, cpu_q, cpu_k = q0.copy(), k0.copy(), q0.copy(), k0.copy()
    if tokens == 1:
        rope.decode(q, k, positions[..., 0])
        cpu.decode(cpu_q, cpu_k, positions[..., 0])
    else:
        rope.rotate(q, k, positions)
        cpu.rotate(cpu_q, cpu_k, positions)
    assert_parity(q, cpu_q, FP32)
    assert_parity(k, cpu_k, FP32)
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(q, ref_q, FP32)
    assert_close(k, ref_k, FP32)
    assert launches(rope)[-1] == name_of(FP32, rope.op.vector_width(q, k), layout)
    (upload,) = uploads
    assert upload.dtype == np.int32 and upload.shape == shape
    np.testing.assert_array_equal(upload, positions)


@settings(max_examples=40, deadline=None)
@given(program=DECODE_PROGRAMS, config=DECODE_CONFIGS, seed=st.integers(0, 2**16))
def test_any_program_of_decodes_matches_a_fresh_checked_component(  # type: ignore[no-untyped-def]
    library, program, config, seed
) -> None:
    """As on the CPU (``tests/test_rope.py``): decode calls in any order on two buffer pairs,
    with bad positions, read-only, reshaped or retyped buffers, each equal to a fresh
    component's call on copies. (A read-only NumPy buffer exists only in emulation, where the
    emulator refuses it at launch; CuPy arrays have no writeable flag.)"""
    with emulated_cuda_devices(library):
        run_decode_program(program, np.random.default_rng(seed), device=DEVICE, config=config)


@pytest.mark.parametrize(("dtype", "max_seq_len"), NARROW_POSITIONS)
def test_negative_positions_per_sequence_are_refused(
    cuda: None, dtype: Any, max_seq_len: int, rng
) -> None:
    check_negative_positions_refused(dtype, max_seq_len, rng, device=DEVICE)


# ---------------------------------------------------------------------------------- refusals


def test_bad_calls_raise_before_any_launch(cuda: None, rng) -> None:
    cfg = rope_config((4, 2), 16, max_seq_len=64)
    rope = cuda_rope_of(cfg, 2, 8, mode=TRAINING)
    q0, k0 = random_qk(rng, cfg, 2, 8)
    q, k = q0.copy(), k0.copy()
    done = len(launches(rope))
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
        assert same_bits(q, q0) and same_bits(k, k0)
    assert len(launches(rope)) == done


def test_arrays_off_whole_elements_are_refused(cuda: None, rng) -> None:
    """A float32 Q two bytes past an aligned address: no access width is aligned, so the op
    raises instead of launching (a misaligned load would trap on the GPU)."""
    cfg = rope_config((2, 1), 8)
    rope = cuda_rope_of(cfg, 1, 3)
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
    rope = cuda_rope_of(cfg, 2, 4)
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
