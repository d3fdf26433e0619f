"""Rope: rotation against an independent float64 reference, positions, backward, validation.

The component bodies run on every device (:data:`rope_helpers.PLACES`: both CPU paths, ``numpy``
and the Numba ``fused`` kernel, and ``CUDA:0`` on a GPU or on the kernel emulator); bodies named
``test_cpu_*`` check what only the CPU op has (its backends, blocking, read-only and torch
arrays). Scaling types are covered in ``test_rope_scaling.py``; what only the CUDA op has
(access widths, launches, uploads, device memory, streams, foreign arrays) is in
``test_rope_cuda_op.py``, and what only the kernel emulator shows in
``test_rope_kernel_emulated.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import cuda_arrays
import numpy as np
import pytest
from cuda_arrays import EMULATED
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import as_strided
from rope_helpers import (
    BACKEND_PARAMS,
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
    expected_width,
    f64,
    make_rope,
    on_every_device,
    put,
    random_qk,
    reference,
    rope_config,
    run_decode_program,
    write_bits,
)

from mila_py import BuildContext, Network, Precision
from mila_py.components import Rope, RopeConfig, get_rope
from mila_py.ops.cpu import _rope_fused
from mila_py.ops.cuda import _kernels
from mila_py.ops.cuda import rope as cuda_rope

HEAD_DIM = 12  # not a power of two; n_freq = 6
#: (n_heads, n_kv_heads): single head, MQA, MHA, odd MHA, odd MQA, GQA
HEADS = [(1, 1), (4, 1), (4, 4), (3, 3), (5, 1), (6, 2)]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240531)


def host(x: Any) -> np.ndarray:
    """A host copy of ``x`` (any device's array) after the device finished."""
    return cuda_arrays.host(x)


def _bits(x: Any) -> bytes:
    return np.ascontiguousarray(host(x)).tobytes()


def _assert_bit_identical(actual: Any, expected: Any) -> None:
    actual, expected = host(actual), host(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert _bits(actual) == _bits(expected)


def _assert_rest_untouched(
    x: Any, x0: np.ndarray, n_heads: int, head_dim: int, rotary_dim: int
) -> None:
    """Channels past ``rotary_dim`` of every head of ``x`` are bit-identical to ``x0``'s."""
    b, t = x0.shape[:2]
    rest = host(x).reshape(b, t, n_heads, head_dim)[..., rotary_dim:]
    _assert_bit_identical(rest, x0.reshape(b, t, n_heads, head_dim)[..., rotary_dim:])


def _assert_on(device: str, x: Any) -> None:
    """``x`` is an array of ``device`` (on a GPU: of ``CUDA:0``)."""
    if device == "CPU":
        assert isinstance(x, np.ndarray)
    elif not EMULATED:
        assert isinstance(x, cuda_arrays.cupy.ndarray) and int(x.device.id) == 0


# ---------------------------------------------------------------------------------- forward


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial8of12"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hk{h[1]}")
def test_forward_and_prefill_match_reference(
    device: str,
    backend: str | None,
    heads: tuple[int, int],
    rotary_dim: int,
    layout: str,
    precision: Precision,
    rng: np.random.Generator,
) -> None:
    cfg = rope_config(heads, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 6
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend, device=device)
    for offset in (0, 5, 1000, cfg.max_seq_len - tokens):
        q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
        q, k = put(device, q0), put(device, k0)
        if offset == 0:
            rope.forward(q, k)
        else:
            rope.prefill(q, k, offset)
        ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, offset))
        assert_close(host(q), ref_q, precision)
        assert_close(host(k), ref_k, precision)
        if rotary_dim:  # channels past the rotated part pass through untouched
            _assert_rest_untouched(q, q0, heads[0], HEAD_DIM, rotary_dim)
            _assert_rest_untouched(k, k0, heads[1], HEAD_DIM, rotary_dim)


@on_every_device
def test_position_zero_is_identity_and_position_changes_values(
    device: str, backend: str | None, rng
) -> None:
    cfg = rope_config()
    rope = make_rope(cfg, 1, 1, backend=backend, device=device)
    q0, k0 = random_qk(rng, cfg, 1, 1)
    q, k = put(device, q0), put(device, k0)
    rope.forward(q, k)
    np.testing.assert_array_equal(host(q), q0)
    np.testing.assert_array_equal(host(k), k0)
    rope.decode(q, k, 1)
    assert not np.allclose(host(q), q0)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    "shape",
    [(2, 600), (300, 2)],
    ids=["long-sequences", "many-sequences"],
)
def test_cpu_large_calls_cross_block_boundaries(
    backend: str,
    layout: str,
    precision: Precision,
    shape: tuple[int, int],
    rng,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls large enough for the NumPy path to block and the fused kernel to run in parallel."""
    import mila_py.ops.cpu.rope as cpu_rope

    monkeypatch.setattr(cpu_rope, "_NUMPY_BLOCK_BYTES", 64 * 1024)  # 64 tokens: 10 blocks
    monkeypatch.setattr(cpu_rope, "_PARALLEL_ELEMENTS", 1)  # blocks spread over the cores
    cfg = rope_config((4, 1), head_dim=64, max_seq_len=2048, layout=layout)
    batch, tokens = shape
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    q, k = random_qk(rng, cfg, batch, tokens, precision)
    q0, k0 = q.copy(), k.copy()
    rope.prefill(q, k, 1400)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 1400))
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)
    positions = rng.integers(0, cfg.max_seq_len, size=(batch, tokens))
    q, k = q0.copy(), k0.copy()
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(q, ref_q, precision)
    assert_close(k, ref_k, precision)


@on_every_device
@pytest.mark.parametrize(
    "make_positions",
    [
        lambda rng, b, t, _: rng.integers(0, 2048, size=(b, t)),
        lambda rng, b, t, _: rng.integers(1000, 2048, size=(t,)),
        lambda rng, b, t, _: rng.integers(1000, 2048, size=(b, 1)),
        lambda rng, b, t, _: rng.integers(0, 2048, size=(b, t)).astype(np.int32),
        lambda rng, b, t, _: rng.integers(0, 2048, size=(b, t)).astype(np.uint16),
        lambda rng, b, t, _: rng.integers(0, 2048, size=(b, t)).tolist(),
        lambda rng, b, t, _: np.full((b, t), 2047),
        lambda rng, b, t, device: put(device, rng.integers(0, 2048, size=(b, t))),
    ],
    ids=["BT", "T", "B1", "int32", "uint16", "list", "last-row", "device-array"],
)
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotate_explicit_positions(
    device: str,
    backend: str | None,
    layout: str,
    precision: Precision,
    make_positions: Callable[..., Any],
    rng,
) -> None:
    cfg = rope_config((5, 1), layout=layout)
    batch, tokens = 3, 5
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend, device=device)
    positions = make_positions(rng, batch, tokens, device)
    host_positions = positions if isinstance(positions, list) else host(positions)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    q, k = put(device, q0), put(device, k0)
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, np.asarray(host_positions))
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_smaller_calls_than_the_build(
    device: str, backend: str | None, precision: Precision, rng
) -> None:
    """Calls on fewer sequences and tokens than the build, and on a batch and token slice of
    a larger buffer (strides of that buffer): only the slice is rotated."""
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 4, 16, precision=precision, backend=backend, device=device)
    for batch, tokens in ((1, 1), (4, 3), (2, 16)):
        q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
        q, k = put(device, q0), put(device, k0)
        rope.prefill(q, k, 700)
        ref_q, ref_k = reference(cfg, q0, k0, arange_positions(batch, tokens, 700))
        assert_close(host(q), ref_q, precision)
        assert_close(host(k), ref_k, precision)
    q0, k0 = random_qk(rng, cfg, 5, 18, precision)
    q_big, k_big = put(device, q0), put(device, k0)
    view = np.s_[1:4, 2:17]
    rope.prefill(q_big[view], k_big[view], 40)
    got_q, got_k = host(q_big), host(k_big)
    ref_q, ref_k = reference(cfg, q0[view], k0[view], arange_positions(3, 15, 40))
    assert_close(got_q[view], ref_q, precision)
    assert_close(got_k[view], ref_k, precision)
    outside = np.ones(q0.shape[:2], bool)
    outside[view] = False
    _assert_bit_identical(got_q[outside], q0[outside])
    _assert_bit_identical(got_k[outside], k0[outside])


# ---------------------------------------------------------------------------------- prefill / decode


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("start", [0, 1500])
def test_prefill_in_chunks_equals_one_call(
    device: str, backend: str | None, layout: str, precision: Precision, start: int, rng
) -> None:
    cfg = rope_config((4, 1), layout=layout, rotary_dim=8)
    batch, tokens = 2, 20
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend, device=device)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    whole_q, whole_k = put(device, q0), put(device, k0)
    if start == 0:
        rope.forward(whole_q, whole_k)
    else:
        rope.prefill(whole_q, whole_k, start)
    chunk_q, chunk_k = put(device, q0), put(device, k0)
    for lo, hi in ((0, 7), (7, 14), (14, 19), (19, 20)):
        # slices of the same buffers: non-contiguous in T, rotated through the view
        rope.prefill(chunk_q[:, lo:hi], chunk_k[:, lo:hi], start + lo)
    _assert_bit_identical(chunk_q, whole_q)
    _assert_bit_identical(chunk_k, whole_k)


@on_every_device
@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}],
    ids=["default", "dynamic"],
)
def test_prefill_chunks_given_the_prompt_end_rotate_as_one_call(
    device: str, backend: str | None, scaling: Any, rng
) -> None:
    """Chunks given the whole prompt's end (``seq_len``) rotate bit for bit as one call over
    it, from the start and from an offset; a length-dependent scaling (dynamic NTK) picks its
    frequencies for ``seq_len``. A bad ``seq_len`` is refused before anything is rotated."""
    cfg = rope_config((4, 2), 16, max_seq_len=64, scaling=scaling)
    rope = make_rope(cfg, 2, 24, backend=backend, device=device)
    q0, k0 = random_qk(rng, cfg, 2, 24)
    for start in (0, 3):
        whole_q, whole_k = put(device, q0), put(device, k0)
        if start == 0:
            rope.forward(whole_q, whole_k)
        else:
            rope.prefill(whole_q, whole_k, start)
        q, k = put(device, q0), put(device, k0)
        for lo, hi in ((0, 5), (5, 13), (13, 24)):
            rope.prefill(q[:, lo:hi], k[:, lo:hi], start + lo, seq_len=start + 24)
        _assert_bit_identical(q, whole_q)
        _assert_bit_identical(k, whole_k)
    before_q, before_k = host(q).copy(), host(k).copy()
    for bad in (4, 65, 2.0):
        with pytest.raises((ValueError, TypeError), match="seq_len"):
            rope.prefill(q[:, :5], k[:, :5], 0, seq_len=bad)  # type: ignore[arg-type]
    _assert_bit_identical(q, before_q)
    _assert_bit_identical(k, before_k)


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_decode_at_each_position_equals_forward(
    device: str, backend: str | None, layout: str, precision: Precision, rng
) -> None:
    cfg = rope_config((3, 3), layout=layout, max_seq_len=64)
    batch, tokens = 2, 64
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend, device=device)
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    whole_q, whole_k = put(device, q0), put(device, k0)
    rope.forward(whole_q, whole_k)
    whole_q, whole_k = host(whole_q), host(whole_k)
    # every position on the CPU; off it every 7th (both parities), a step costs a launch
    for t in range(0, tokens, 1 if device == "CPU" else 7):
        step_q, step_k = put(device, q0[:, t : t + 1]), put(device, k0[:, t : t + 1])
        rope.decode(step_q, step_k, t if t % 2 else np.int64(t))
        _assert_bit_identical(step_q, whole_q[:, t : t + 1])
        _assert_bit_identical(step_k, whole_k[:, t : t + 1])


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_decode_per_sequence_positions(
    device: str, backend: str | None, layout: str, precision: Precision, rng
) -> None:
    cfg = rope_config((4, 1), layout=layout)
    batch = 4
    rope = make_rope(cfg, batch, 8, precision=precision, backend=backend, device=device)
    positions = np.array([3, 1500, 2047, 0])
    q0, k0 = random_qk(rng, cfg, batch, 1, precision)
    q, k = put(device, q0), put(device, k0)
    rope.decode(q, k, positions)
    ref_q, ref_k = reference(cfg, q0, k0, positions[:, None])
    got_q, got_k = host(q), host(k)
    assert_close(got_q, ref_q, precision)
    assert_close(got_k, ref_k, precision)
    for b, p in enumerate(positions):  # the same as decoding each sequence on its own
        one_q, one_k = put(device, q0[b : b + 1]), put(device, k0[b : b + 1])
        rope.decode(one_q, one_k, int(p))
        _assert_bit_identical(one_q, got_q[b : b + 1])
        _assert_bit_identical(one_k, got_k[b : b + 1])
    # positions given as a list, and as an array of the device, work too
    for spelled in (positions.tolist(), put(device, positions)):
        again_q, again_k = put(device, q0), put(device, k0)
        rope.decode(again_q, again_k, spelled)
        _assert_bit_identical(again_q, got_q)
        _assert_bit_identical(again_k, got_k)
    # a one-element array is broadcast to every sequence
    same_q, same_k = put(device, q0), put(device, k0)
    rope.decode(same_q, same_k, np.array([1500]))
    ref_q, ref_k = reference(cfg, q0, k0, np.full((batch, 1), 1500))
    assert_close(host(same_q), ref_q, precision)
    assert_close(host(same_k), ref_k, precision)


#: fused QKV rows: (elements before Q, elements between Q and K, elements after V)
FUSED = {
    "plain": (0, 0, 0),
    "k-at-odd-element": (0, 1, 0),
    "q-and-k-shifted-2": (2, 0, 0),
    "odd-row-stride": (0, 0, 1),
    "shift4-row-pad4": (4, 0, 4),
}


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize(
    ("heads", "head_dim", "rotary_dim"),
    [((4, 1), 12, 8), ((3, 3), 12, 8), ((3, 3), 64, 0), ((6, 2), 16, 0), ((32, 8), 128, 8)],
    ids=["mqa-d12-partial", "mha-d12-partial", "mha-d64", "gqa-d16", "gqa-d128-partial"],
)
def test_fused_qkv_views_rotate_through_the_view(
    device: str,
    backend: str | None,
    heads: tuple[int, int],
    head_dim: int,
    rotary_dim: int,
    layout: str,
    precision: Precision,
    rng,
) -> None:
    """Q and K as strided views of one QKV buffer, at the offsets of :data:`FUSED` (padding
    before Q, between Q and K and after V, filled with NaN canaries): prefill, decode and
    rotate go through the views as the reference on contiguous copies; V and the padding are
    left bit for bit. On ``CUDA:0`` the op takes the widest access the addresses allow (and
    the emulator records that instantiation's launch)."""
    hq, hk = heads
    d = head_dim
    cfg = rope_config(heads, head_dim=d, layout=layout, rotary_dim=rotary_dim)
    batch, tokens = 2, 5
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend, device=device)
    item = precision.itemsize
    for fused, (before, gap, after) in FUSED.items():
        q_at, k_at = before, before + hq * d + gap
        width = k_at + 3 * hk * d + after  # K, V, padding
        for method in ("prefill", "decode", "rotate"):
            n_t = 1 if method == "decode" else tokens
            qkv0 = rng.standard_normal((batch, n_t, width)).astype(dtype_of(precision))
            qkv0[..., :before] = np.nan
            qkv0[..., q_at + hq * d : k_at] = np.nan
            qkv0[..., width - after :] = np.nan
            qkv = put(device, qkv0)
            q, k = qkv[..., q_at : q_at + hq * d], qkv[..., k_at : k_at + hk * d]
            arg: Any = {
                "prefill": 900,
                "decode": np.array([7, 1999]),
                "rotate": rng.integers(0, cfg.max_seq_len, size=(batch, tokens)),
            }[method]
            if device != "CPU":
                spans = [_kernels.address(q), _kernels.address(k), width * item]
                vec = expected_width(precision, layout, d, rope.table.n_freq, spans)
                assert rope.op.vector_width(q, k) == vec, (fused, method)
            getattr(rope, method)(q, k, arg)
            if device != "CPU" and EMULATED:  # the instantiation of that width was launched
                launched = rope.execution_context.launches[-1]
                assert launched == cuda_rope.kernel_name(precision, vec, layout == "interleaved")
            got = host(qkv)
            q0 = np.ascontiguousarray(qkv0[..., q_at : q_at + hq * d])
            k0 = np.ascontiguousarray(qkv0[..., k_at : k_at + hk * d])
            if method == "prefill":
                positions = arange_positions(batch, tokens, arg)
            elif method == "decode":
                positions = arg[:, None]
            else:
                positions = arg
            ref_q, ref_k = reference(cfg, q0, k0, positions)
            assert_close(got[..., q_at : q_at + hq * d], ref_q, precision)
            assert_close(got[..., k_at : k_at + hk * d], ref_k, precision)
            untouched = np.ones(width, bool)
            untouched[q_at : q_at + hq * d] = untouched[k_at : k_at + hk * d] = False
            assert _bits(got[..., untouched]) == _bits(qkv0[..., untouched]), (fused, method)


@on_every_device
@pytest.mark.parametrize(
    "call",
    [
        lambda r, q, k: r.forward(q, k),
        lambda r, q, k: r.prefill(q, k, 2048 - q.shape[1]),
        lambda r, q, k: r.rotate(q, k, np.zeros(1, np.int64)),  # broadcasts to [B, T]
        lambda r, q, k: r.decode(q[:, :1], k[:, :1], 5) if q.shape[1] else None,
        lambda r, q, k: r.backward(q, k),
        # positions of the batch's own shape: empty too
        lambda r, q, k: r.rotate(q, k, np.zeros(q.shape[:2], np.int64)),
        lambda r, q, k: r.backward(q, k, np.zeros(q.shape[:2], np.int64)),
    ],
    ids=[
        "forward",
        "prefill",
        "rotate",
        "decode",
        "backward",
        "rotate-positions",
        "backward-positions",
    ],
)
@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["B0", "T0"])
@pytest.mark.parametrize("precision", [FP32, FP16], ids=str)
def test_empty_calls_are_no_ops(
    device: str, backend: str | None, shape, precision: Precision, call
) -> None:
    """Like PyTorch on empty tensors: B == 0 or T == 0 rotates nothing and does not fail."""
    cfg = rope_config((3, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend, device=device)
    q = put(device, np.zeros((*shape, cfg.channels), dtype_of(precision)))
    k = put(device, np.zeros((*shape, cfg.kv_channels), dtype_of(precision)))
    call(rope, q, k)
    assert q.shape == (*shape, cfg.channels)


@on_every_device
@pytest.mark.parametrize("position", [5, np.zeros(0, np.int64)], ids=["int", "per-sequence"])
def test_an_empty_batch_decodes_nothing(device: str, backend: str | None, position: Any) -> None:
    """decode with B == 0 (T is 1 by contract), through the component and through its op."""
    cfg = rope_config((3, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend, device=device)
    q = put(device, np.zeros((0, 1, cfg.channels), np.float32))
    k = put(device, np.zeros((0, 1, cfg.kv_channels), np.float32))
    rope.decode(q, k, position)
    rope._op.decode(q, k, position)
    assert q.shape == (0, 1, cfg.channels)


SCALINGS_ACROSS_1024: dict[str, Any] = {
    "none": None,
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 1024},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.0 + 1.7 * i for i in range(8)],
        "original_max_position_embeddings": 1024,
    },
}


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("scaling", list(SCALINGS_ACROSS_1024))
def test_a_decode_loop_on_the_same_buffers(
    device: str, backend: str | None, scaling: str, precision: Precision, rng
) -> None:
    """A decode loop writes each token into the same Q/K buffers, at int positions and at one
    per sequence, across the original context (1024) where dynamic NTK computes rows per call
    and LongRoPE switches tables: each step gives the bits of a fresh component's call (fresh
    buffers) and the float64 reference."""
    cfg = rope_config((4, 2), 16, max_seq_len=4096, scaling=SCALINGS_ACROSS_1024[scaling])
    batch = 2
    rope = make_rope(cfg, batch, 1, precision=precision, backend=backend, device=device)
    checked = make_rope(cfg, batch, 1, precision=precision, backend=backend, device=device)
    q, k = (put(device, x) for x in random_qk(rng, cfg, batch, 1, precision))
    each = (np.array([8, 1000]), np.array([1023, 4]), np.array([3000, 7]), np.array([11, 12]))
    for position in (5, 6, 7, 1022, 1023, 1024, 1500, 3000, 4095, np.int64(9), 2, 1023, *each):
        q0, k0 = random_qk(rng, cfg, batch, 1, precision)
        write_bits(q, q0)  # the loop's new token, in place
        write_bits(k, k0)
        rope.decode(q, k, position)
        fresh_q, fresh_k = put(device, q0), put(device, k0)
        checked.decode(fresh_q, fresh_k, position if np.ndim(position) else int(position))
        assert _bits(q) == _bits(fresh_q) and _bits(k) == _bits(fresh_k)
        positions = np.broadcast_to(np.reshape(position, (-1, 1)), (batch, 1))
        ref_q, ref_k = reference(cfg, q0, k0, positions)
        assert_close(host(q), ref_q, precision, scale=rope.attention_scaling)
        assert_close(host(k), ref_k, precision, scale=rope.attention_scaling)


def _scalings(n: int) -> dict[str, dict[str, Any] | None]:
    """Scaling dicts by id (``n`` pairs, for LongRoPE's lists); original context 1024 of 4096."""
    orig = 1024
    longrope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 1.7 * i for i in range(n)],
        "original_max_position_embeddings": orig,
    }
    return {
        "default": None,
        "linear": {"rope_type": "linear", "factor": 4.0},
        "dynamic": {
            "rope_type": "dynamic",
            "factor": 4.0,
            "original_max_position_embeddings": orig,
        },
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": orig},
        "yarn-deepseek": {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": orig,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig,
        },
        "longrope": longrope,
        "longrope-factor-attention": {**longrope, "factor": 16.0, "attention_factor": 1.25},
        "proportional-factor": {"rope_type": "proportional", "factor": 2.0},
    }


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("name", list(_scalings(1)))
def test_scaling_types_far_from_zero(
    device: str, name: str, rotary_dim: int, layout: str, precision: Precision, rng
) -> None:
    """Every scaling type through prefill, rotate and decode at positions 1000..4095, and
    dynamic and LongRoPE below and across their original context (1024), as the reference."""
    head_dim, max_seq = 16, 4096
    n = (rotary_dim or head_dim) // 2
    cfg = RopeConfig(
        channels=3 * head_dim,
        n_heads=3,
        n_kv_heads=1,
        max_seq_len=max_seq,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=_scalings(n)[name],
    )
    batch, tokens = 2, 8
    rope = make_rope(cfg, batch, tokens, precision=precision, device=device)
    calls: list[tuple[str, Any]] = [
        ("prefill", 1000),  # below the original context
        ("prefill", 1024 - 3),  # crosses it: the whole call uses the long parameters
        ("prefill", 2500),
        ("prefill", max_seq - tokens),
        ("rotate", rng.integers(1000, max_seq, size=(batch, tokens))),
        ("rotate", rng.integers(0, 1024, size=(batch, tokens))),
        ("decode", np.array([1000, 3999])),
        ("decode", np.array([1017, 5])),
        ("decode", max_seq - 1),
    ]
    for method, arg in calls:
        n_t = 1 if method == "decode" else tokens
        q0, k0 = random_qk(rng, cfg, batch, n_t, precision)
        q, k = put(device, q0), put(device, k0)
        getattr(rope, method)(q, k, arg)
        if method == "prefill":
            positions = arange_positions(batch, tokens, arg)
        elif method == "decode":
            positions = np.broadcast_to(np.reshape(arg, (-1, 1)), (batch, 1))
        else:
            positions = arg
        ref_q, ref_k = reference(cfg, q0, k0, positions)
        assert_close(host(q), ref_q, precision, scale=rope.attention_scaling)
        assert_close(host(k), ref_k, precision, scale=rope.attention_scaling)


#: a dynamic type short enough that M-RoPE positions pass its original length: the rows of a
#: call are made on the host
MROPE_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize(
    ("section", "interleaved", "layout", "rotary_dim", "scaling"),
    [((16, 24, 24), False, "half", 0, None), ((24, 20, 20), True, "half", 0, None),
     ((8, 12, 12), False, "interleaved", 64, None),
     ((16, 24, 24), False, "half", 0, MROPE_DYNAMIC)],
    ids=["qwen2vl", "qwen3vl", "glm4v", "dynamic-rows"],
)  # fmt: skip
def test_mrope_positions_per_axis(
    device: str, section, interleaved: bool, layout: str, rotary_dim: int, scaling: Any,
    precision: Precision, rng,
) -> None:  # fmt: skip
    """M-RoPE positions ``[3, B, T]`` (an array of the device): each frequency's row is picked
    by its axis (past a dynamic type's original length, from rows made for the call), through
    rotate, backward (positions broadcast over sequences too) and decode, as the reference."""
    cfg = rope_config(
        (8, 2), 128, rotary_dim=rotary_dim, layout=layout, mrope_section=section,
        mrope_interleaved=interleaved, scaling=scaling,
    )  # fmt: skip
    batch, tokens = 2, 33
    rope = make_rope(cfg, batch, tokens, precision=precision, mode=TRAINING, device=device)
    positions = rng.integers(0, 2048, size=(3, batch, tokens))
    q0, k0 = random_qk(rng, cfg, batch, tokens, precision)
    q, k = put(device, q0), put(device, k0)
    rope.rotate(q, k, put(device, positions))
    ref_q, ref_k = reference(cfg, q0, k0, positions)
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)
    for back in (positions, positions[:, :1]):  # [3, 1, T]: broadcast over sequences
        dq, dk = rope.backward(put(device, q0), put(device, k0), back)
        each = np.broadcast_to(back, positions.shape)
        ref_q, ref_k = reference(cfg, q0, k0, each, inverse=True)
        assert_close(host(dq), ref_q, precision)
        assert_close(host(dk), ref_k, precision)
    q1, k1 = put(device, q0[:, :1]), put(device, k0[:, :1])
    rope.decode(q1, k1, positions[:, :, 0])
    ref_q, ref_k = reference(cfg, q0[:, :1], k0[:, :1], positions[:, :, :1])
    assert_close(host(q1), ref_q, precision)
    assert_close(host(k1), ref_k, precision)


@pytest.mark.parametrize(("dtype", "max_seq_len"), NARROW_POSITIONS)
def test_negative_positions_per_sequence_are_refused(
    device: str, dtype: Any, max_seq_len: int, rng
) -> None:
    check_negative_positions_refused(dtype, max_seq_len, rng, device=device)


@settings(max_examples=60, deadline=None)
@given(program=DECODE_PROGRAMS, config=DECODE_CONFIGS, seed=st.integers(0, 2**16))
def test_cpu_any_program_of_decodes_matches_a_fresh_checked_component(
    program, config, seed
) -> None:  # type: ignore[no-untyped-def]
    """Decode calls in any order on two buffer pairs, with positions in and out of range (and
    not ints), a pair made read-only or reshaped in place before a call, the backend switched,
    a position given as np.int64: each call does what the same call on fresh copies through a
    new component does, the same values or the same error (and then leaves Q and K as they
    were)."""
    pytest.importorskip("numba")
    run_decode_program(program, np.random.default_rng(seed), device="CPU", config=config)


def test_cpu_backends_agree(rng) -> None:
    pytest.importorskip("numba")
    cfg = rope_config((5, 1), layout="interleaved", rotary_dim=10)
    for precision in PRECISIONS:
        results = []
        q, k = random_qk(rng, cfg, 2, 9, precision)
        for backend in ("numpy", "fused"):
            rope = make_rope(cfg, 2, 9, precision=precision, backend=backend)
            x, y = q.copy(), k.copy()
            rope.prefill(x, y, 1234)
            results.append((x, y))
        np.testing.assert_allclose(f64(results[0][0]), f64(results[1][0]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(f64(results[0][1]), f64(results[1][1]), rtol=1e-6, atol=1e-6)


def test_cpu_backend_setting() -> None:
    rope = make_rope(rope_config(), 1, 1)
    assert rope.op.backend in ("numpy", "fused", "auto")
    with pytest.raises(ValueError, match="backend"):
        rope.op.backend = "cuda"
    rope.op.backend = "numpy"
    assert rope.op.backend == "numpy" and not rope.op.uses_fused


# ---------------------------------------------------------------------------------- backward


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("heads", [(4, 1), (3, 3), (1, 1)], ids=["mqa", "mha-odd", "single"])
def test_backward_matches_reference(
    device: str,
    backend: str | None,
    heads: tuple[int, int],
    rotary_dim: int,
    layout: str,
    precision: Precision,
    rng,
) -> None:
    cfg = rope_config(heads, rotary_dim=rotary_dim, layout=layout)
    batch, tokens = 2, 6
    rope = make_rope(
        cfg, batch, tokens, mode=TRAINING, precision=precision, backend=backend, device=device
    )
    dq0, dk0 = random_qk(rng, cfg, batch, tokens, precision)
    dq, dk = put(device, dq0), put(device, dk0)
    dq_in, dk_in = rope.backward(dq, dk)
    _assert_bit_identical(dq, dq0)  # upstream gradients are not modified
    _assert_bit_identical(dk, dk0)
    ref_q, ref_k = reference(cfg, dq0, dk0, arange_positions(batch, tokens), inverse=True)
    assert_close(host(dq_in), ref_q, precision)
    assert_close(host(dk_in), ref_k, precision)
    if rotary_dim:  # out of place: the pass-through channels are copied
        _assert_rest_untouched(dq_in, dq0, heads[0], HEAD_DIM, rotary_dim)
        _assert_rest_untouched(dk_in, dk0, heads[1], HEAD_DIM, rotary_dim)
    positions = rng.integers(1000, cfg.max_seq_len, size=(batch, tokens))
    dq_in, dk_in = rope.backward(dq, dk, positions=positions)
    ref_q, ref_k = reference(cfg, dq0, dk0, positions, inverse=True)
    assert_close(host(dq_in), ref_q, precision)
    assert_close(host(dk_in), ref_k, precision)
    # a smaller call fills the leading part of the component's buffers
    dq_in, dk_in = rope.backward(dq[:1, :3], dk[:1, :3], positions=np.array([1500, 7, 2047]))
    assert dq_in.shape == (1, 3, cfg.channels) and dk_in.shape == (1, 3, cfg.kv_channels)
    ref_q, ref_k = reference(cfg, dq0[:1, :3], dk0[:1, :3], np.array([1500, 7, 2047]), inverse=True)
    assert_close(host(dq_in), ref_q, precision)
    assert_close(host(dk_in), ref_k, precision)
    _assert_on(device, dq_in)
    _assert_on(device, dk_in)


def test_cpu_backward_returns_component_owned_buffers(backend: str, rng) -> None:
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend)
    assert rope.get_gradients() == []  # no parameters: nothing aligned with get_parameters
    grads = rope.input_gradients
    assert [g.shape for g in grads] == [(2, 4, cfg.channels), (2, 4, cfg.kv_channels)]
    dq, dk = random_qk(rng, cfg, 2, 4)
    dq.flags.writeable = False  # backward only reads its inputs
    dk.flags.writeable = False
    dq_in, dk_in = rope.backward(dq, dk)
    assert np.shares_memory(dq_in, grads[0]) and np.shares_memory(dk_in, grads[1])
    assert not np.shares_memory(dq_in, dq)
    first = dq_in.copy()
    rope.backward(dq * 2, dk * 2)  # overwritten by the next backward
    np.testing.assert_allclose(grads[0], 2 * first, rtol=1e-6, atol=1e-6)


TORCH_DTYPES = {FP32: "float32", FP16: "float16", BF16: "bfloat16"}


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_cpu_torch_tensors_are_rotated_in_place_without_a_copy(
    backend: str, precision: Precision, rng
) -> None:
    """Every call takes torch CPU tensors as they are (views of their memory, bf16 included):
    prefill, rotate, decode at per-sequence torch positions, backward; Q and K as views of one
    fused torch QKV tensor too. Overlapping views are refused with the tensor unchanged."""
    torch = pytest.importorskip("torch")
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 5, mode=TRAINING, precision=precision, backend=backend)
    dtype = getattr(torch, TORCH_DTYPES[precision])
    q0, k0 = random_qk(rng, cfg, 2, 5, precision)
    width = cfg.channels + cfg.kv_channels
    qkv = torch.from_numpy(np.concatenate([q0, k0], axis=2).astype(np.float32)).to(dtype)
    qkv = torch.cat([qkv, torch.ones(2, 5, 3, dtype=dtype)], dim=2)  # a V-like tail
    q, k = qkv[:, :, : cfg.channels], qkv[:, :, cfg.channels : width]

    def host(t: Any) -> np.ndarray:  # a float32 copy (for FP32, .float() is the tensor itself)
        return t.float().numpy().copy()

    rope.prefill(q, k, 1000)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 5, 1000))
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)
    assert (host(qkv[:, :, width:]) == 1).all()

    rotated = host(qkv)
    positions = torch.tensor([[3, 9, 0, 2047, 5], [1, 1, 1, 1, 1]])
    rope.rotate(q, k, positions)
    ref_q, ref_k = reference(
        cfg, rotated[:, :, : cfg.channels], rotated[:, :, cfg.channels : width], positions.numpy()
    )
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)

    one_q, one_k = q[:, :1].clone(), k[:, :1].clone()
    start_q, start_k = host(one_q), host(one_k)
    rope.decode(one_q, one_k, torch.tensor([7, 2047]))
    ref_q, ref_k = reference(cfg, start_q, start_k, np.array([[7], [2047]]))
    assert_close(host(one_q), ref_q, precision)
    assert_close(host(one_k), ref_k, precision)

    dq_in, dk_in = rope.backward(q, k)
    ref_q, ref_k = reference(cfg, host(q), host(k), arange_positions(2, 5), inverse=True)
    assert isinstance(dq_in, np.ndarray)
    assert_close(dq_in, ref_q, precision)
    assert_close(dk_in, ref_k, precision)

    before = host(qkv)
    with pytest.raises(ValueError, match="share memory"):
        rope.forward(q, qkv[:, :, 4 : 4 + cfg.kv_channels])
    assert np.array_equal(host(qkv), before) and not np.array_equal(before, rotated)
    with pytest.raises(TypeError, match="dtype"):
        rope.forward(q.double(), k.double())
    with pytest.raises(TypeError, match=r"requires grad.*detach\(\)"):
        rope.forward(q.clone().requires_grad_(), k)
    assert np.array_equal(host(qkv), before)


@pytest.mark.parametrize(
    "call",
    [
        lambda rope, q, k: rope.forward(q, k),
        lambda rope, q, k: rope.decode(q[:, :1], k[:, :1], 3),
        lambda rope, q, k: rope.rotate(q, k, np.arange(4)),
        lambda rope, q, k: rope.backward(q, k),
    ],
    ids=["forward", "decode", "rotate", "backward"],
)
def test_foreign_producers_are_released_even_when_adopting_k_fails(
    device: str, call: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, rng
) -> None:
    """Q adopted, then K's export raises: the call still ends by ordering Q's producer (on a
    GPU, a stream left recorded would be waited on by an unrelated later call)."""
    cfg = rope_config((4, 2))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, device=device)
    ctx = rope.execution_context
    events: list[str] = []

    def adopt(array: Any) -> Any:
        events.append("adopt")
        if len(events) == 2:
            raise BufferError("cannot export")
        return array

    monkeypatch.setattr(ctx, "as_device_array", adopt)
    monkeypatch.setattr(ctx, "release_foreign", lambda: events.append("release"))
    q, k = (put(device, x) for x in random_qk(rng, cfg, 2, 4))
    with pytest.raises(BufferError):
        call(rope, q, k)
    assert events == ["adopt", "adopt", "release"]


@on_every_device
def test_backward_refuses_gradients_that_lie_in_the_other_output_buffer(
    device: str, backend: str | None, rng
) -> None:
    """The results of one backward passed back swapped (dq in the dk_in buffer) would be
    overwritten before they are read: refused, nothing changed. Passed back in their own
    buffers, they are rotated in place correctly."""
    cfg = rope_config((3, 3))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, backend=backend, device=device)
    dq, dk = (put(device, x) for x in random_qk(rng, cfg, 2, 4))
    first_q, first_k = rope.backward(dq, dk)
    saved_q, saved_k = host(first_q).copy(), host(first_k).copy()
    for args, name in (((first_k, first_q), "dq"), ((dq, first_q[:, :, :]), "dk")):
        with pytest.raises(ValueError, match=f"{name} lies in this component's"):
            rope.backward(*args)
        _assert_bit_identical(first_q, saved_q)
        _assert_bit_identical(first_k, saved_k)
    dq_in, dk_in = rope.backward(first_q, first_k)  # each in its own buffer: in place
    ref_q, ref_k = reference(cfg, saved_q, saved_k, arange_positions(2, 4), inverse=True)
    assert _kernels.address(dq_in) == _kernels.address(first_q)
    assert_close(host(dq_in), ref_q, FP32)
    assert_close(host(dk_in), ref_k, FP32)


def _loss(rope: Rope, q: np.ndarray, k: np.ndarray, wq, wk, positions) -> float:
    x, y = q.copy(), k.copy()
    rope.rotate(x, y, positions)
    return float(np.sum(f64(x) * wq) + np.sum(f64(y) * wk))


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}],
    ids=["default", "yarn"],
)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 4], ids=["full", "partial"])
def test_cpu_backward_against_finite_differences(
    backend: str, rotary_dim: int, layout: str, scaling, rng
) -> None:
    """dL/dq by central differences of L = <Wq, rope(q)> + <Wk, rope(k)>, element by element."""
    cfg = RopeConfig(
        channels=18,
        n_heads=3,
        n_kv_heads=1,
        max_seq_len=4096,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=scaling,
    )
    batch, tokens = 2, 2
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, backend=backend)
    positions = np.array([[1000, 3001], [4095, 17]])
    q, k = random_qk(rng, cfg, batch, tokens)
    wq = rng.standard_normal(q.shape)  # random, asymmetric upstream gradients
    wk = rng.standard_normal(k.shape)
    dq_in, dk_in = rope.backward(wq.astype(np.float32), wk.astype(np.float32), positions=positions)
    h = 0.5  # the loss is linear: central differences are exact up to fp32 rounding
    for x, grad in ((q, dq_in), (k, dk_in)):
        numeric = np.zeros(x.shape)
        for index in np.ndindex(x.shape):
            saved = x[index]
            x[index] = saved + h
            plus = _loss(rope, q, k, wq, wk, positions)
            x[index] = saved - h
            minus = _loss(rope, q, k, wq, wk, positions)
            x[index] = saved
            numeric[index] = (plus - minus) / (2 * h)
        np.testing.assert_allclose(f64(grad), numeric, rtol=1e-5, atol=2e-5)


@on_every_device
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_forward_after_backward_is_identity(
    device: str, backend: str | None, layout: str, rng
) -> None:
    cfg = rope_config((3, 1), layout=layout, rotary_dim=8)
    batch, tokens = 2, 5
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, backend=backend, device=device)
    dq0, dk0 = random_qk(rng, cfg, batch, tokens)
    dq, dk = put(device, dq0), put(device, dk0)
    # positions None = 0..T-1
    dq_in, dk_in = rope.backward(dq, dk)
    x, y = put(device, host(dq_in)), put(device, host(dk_in))
    rope.forward(x, y)
    np.testing.assert_allclose(host(x), dq0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(y), dk0, rtol=1e-6, atol=1e-6)
    # explicit positions
    positions = rng.integers(0, cfg.max_seq_len, size=(batch, tokens))
    dq_in, dk_in = rope.backward(dq, dk, positions=positions)
    x, y = put(device, host(dq_in)), put(device, host(dk_in))
    rope.rotate(x, y, positions)
    np.testing.assert_allclose(host(x), dq0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(y), dk0, rtol=1e-6, atol=1e-6)
    # and the other way round: backward(forward(x)) = x
    x, y = put(device, dq0), put(device, dk0)
    rope.prefill(x, y, 1800)
    dq_in, dk_in = rope.backward(x, y, positions=np.arange(1800, 1800 + tokens))
    np.testing.assert_allclose(host(dq_in), dq0, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(dk_in), dk0, rtol=1e-6, atol=1e-6)


@on_every_device
@pytest.mark.parametrize("precision", [FP16, BF16], ids=str)
def test_backward_rounds_once_in_reduced_precision(
    device: str, backend: str | None, precision: Precision, rng
) -> None:
    cfg = rope_config((4, 1))
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend, device=device)
    dq, dk = random_qk(rng, cfg, 2, 4, precision)
    dq_in, dk_in = rope.backward(
        put(device, dq), put(device, dk), positions=np.array([2000, 1, 1024, 77])
    )
    assert dq_in.dtype == dtype_of(precision)
    ref_q, ref_k = reference(cfg, dq, dk, np.array([2000, 1, 1024, 77]), inverse=True)
    assert_close(host(dq_in), ref_q, precision)
    assert_close(host(dk_in), ref_k, precision)


def test_inference_build_has_no_gradients_and_no_backward(device: str, rng) -> None:
    cfg = rope_config((4, 1))
    rope = make_rope(cfg, 2, 4, mode=INFERENCE, device=device)
    assert rope.get_gradients() == []
    stats = rope.get_memory_stats()
    assert stats.gradient_bytes == 0
    assert stats.state_bytes == rope.table.nbytes == 2 * cfg.max_seq_len * (HEAD_DIM // 2) * 4
    dq, dk = (put(device, x) for x in random_qk(rng, cfg, 2, 4))
    with pytest.raises(RuntimeError, match="INFERENCE"):
        rope.backward(dq, dk)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
def test_training_build_memory(device: str, precision: Precision) -> None:
    cfg = rope_config((4, 2), rotary_dim=8)
    rope = make_rope(cfg, 3, 5, mode=TRAINING, precision=precision, device=device)
    stats = rope.get_memory_stats()
    item = dtype_of(precision).itemsize
    assert stats.gradient_bytes == 3 * 5 * (cfg.channels + cfg.kv_channels) * item
    assert stats.parameter_bytes == 0
    assert stats.state_bytes == 2 * cfg.max_seq_len * 4 * 4  # cos + sin, 4 pairs, float32
    if device == "CPU" or not EMULATED:  # the emulator's table is host memory, counted so
        assert stats.host_total_bytes == 0
    grads = rope.input_gradients
    assert [g.dtype for g in grads] == [dtype_of(precision)] * 2
    assert rope.get_parameters() == [] and rope.parameter_count() == 0


# ---------------------------------------------------------------------------------- bad input

Q_W, K_W = 3 * 8, 1 * 8
_BAD_CFG = dict(channels=Q_W, n_heads=3, n_kv_heads=1, max_seq_len=64)


def _readonly(x: np.ndarray) -> np.ndarray:
    view = x.view()
    view.flags.writeable = False
    return view


class _DuckArray:
    """Quacks like an array (shape, dtype, __array__) but is not one of the device's arrays."""

    def __init__(self, x: np.ndarray) -> None:
        self._x = x
        self.shape, self.dtype, self.ndim = x.shape, x.dtype, x.ndim
        self.flags = x.flags

    def __array__(self, dtype=None, copy=None):
        return self._x


def _overlapping_views(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Q and K views of one buffer whose channels overlap by 4 (an off-by-4 fused QKV split)."""
    return buf[:, :, :Q_W], buf[:, :, Q_W - 4 : Q_W - 4 + K_W], 3


def _as_strided(x: Any, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    """``as_strided`` of NumPy or of the ``CUDA:0`` array module, whichever holds ``x``."""
    if isinstance(x, np.ndarray) and not EMULATED:
        return as_strided(x, shape, strides)
    return cuda_arrays.cupy.lib.stride_tricks.as_strided(x, shape, strides)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | cuda_arrays.cupy.ndarray)


F32 = np.float32
#: (id, method, args(q, k, dq, dk, on), exception, message pattern); q [2, 4, 24], k [2, 4, 8]
#: of the device under test, ``on(x)``: host array ``x`` there (of the component's dtype)
BAD_CALLS: list[tuple[str, str, Callable[..., tuple], type[Exception], str]] = [
    ("q-rank-2", "forward", lambda q, k, *_: (q[0], k), ValueError, r"\[B, T, 24\]"),
    ("q-rank-4", "forward", lambda q, k, *_: (q.reshape(2, 4, 3, 8), k), ValueError, r"\[B, T"),
    ("q-width", "forward", lambda q, k, *_: (q[:, :, :16], k), ValueError, r"\[B, T, 24\]"),
    ("k-width", "forward", lambda q, k, *_: (q, q), ValueError, r"\[B, T, 8\]"),
    ("k-rank", "forward", lambda q, k, *_: (q, k[:, :, None]), ValueError, r"\[B, T, 8\]"),
    (
        "B-beyond-build",
        "forward",
        lambda *a: (a[-1](np.ones((3, 4, Q_W), F32)), a[-1](np.ones((3, 4, K_W), F32))),
        ValueError,
        "build shape",
    ),
    (
        "T-beyond-build",
        "prefill",
        lambda *a: (a[-1](np.ones((2, 5, Q_W), F32)), a[-1](np.ones((2, 5, K_W), F32)), 0),
        ValueError,
        "build shape",
    ),
    ("B-mismatch", "forward", lambda q, k, *_: (q, k[:1]), ValueError, "share B and T"),
    ("T-mismatch", "forward", lambda q, k, *_: (q, k[:, :2]), ValueError, "share B and T"),
    ("q-float64", "forward", lambda q, k, *_: (q.astype(np.float64), k), TypeError, "dtype"),
    (
        "k-other-dtype",
        "forward",
        lambda q, k, *_: (q, k.astype(np.float32 if k.dtype == np.float16 else np.float16)),
        TypeError,
        "dtype",
    ),
    ("q-list", "forward", lambda q, k, *_: (q.tolist(), k), TypeError, "must be an array"),
    ("k-duck", "forward", lambda q, k, *_: (q, _DuckArray(k)), TypeError, "must be an array"),
    ("q-read-only", "forward", lambda q, k, *_: (_readonly(q), k), ValueError, "read-only"),
    ("k-read-only", "prefill", lambda q, k, *_: (q, _readonly(k), 3), ValueError, "read-only"),
    ("k-inside-q", "forward", lambda q, k, *_: (q, q[:, :, 8:16]), ValueError, "share memory"),
    (
        "q-k-views-overlap",
        "prefill",
        lambda q, k, dq, dk, on: _overlapping_views(on(np.concatenate([host(q), host(k)], 2))),
        ValueError,
        "share memory",
    ),
    (
        "q-rows-alias",
        "forward",
        lambda q, k, *_: (_as_strided(q, q.shape, (0, *q.strides[1:])), k),
        ValueError,
        "elements that share memory",
    ),
    ("offset-negative", "prefill", lambda q, k, *_: (q, k, -1), ValueError, ">= 0"),
    ("offset-float", "prefill", lambda q, k, *_: (q, k, 1.0), TypeError, "int"),
    ("offset-bool", "prefill", lambda q, k, *_: (q, k, True), TypeError, "int"),
    (
        "prefill-past-table",
        "prefill",
        lambda q, k, *_: (q, k, 61),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "prefill-far-past-table",
        "prefill",
        lambda q, k, *_: (q, k, 10**6),
        ValueError,
        r"position 1000003\b.*64",
    ),
    (
        "decode-at-limit",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], 64),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "decode-np-int-past",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.int32(99)),
        ValueError,
        r"position 99\b.*64",
    ),
    ("decode-negative", "decode", lambda q, k, *_: (q[:, :1], k[:, :1], -1), ValueError, ">= 0"),
    (
        "decode-per-seq-past",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([3, 64])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "decode-per-seq-negative",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([3, -2])),
        ValueError,
        ">= 0",
    ),
    (
        "decode-per-seq-shape",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([1, 2, 3])),
        ValueError,
        "broadcast",
    ),
    (
        "decode-float-positions",
        "decode",
        lambda q, k, *_: (q[:, :1], k[:, :1], np.array([1.0, 2.0])),
        TypeError,
        "integers",
    ),
    ("decode-str", "decode", lambda q, k, *_: (q[:, :1], k[:, :1], "3"), TypeError, "integers"),
    ("decode-T2", "decode", lambda q, k, *_: (q[:, :2], k[:, :2], 0), ValueError, "T == 1"),
    (
        "rotate-shape",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 5), np.int64)),
        ValueError,
        "broadcast",
    ),
    (
        "rotate-3d",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 2, 4), np.int64)),
        ValueError,
        "broadcast",
    ),
    (
        "rotate-float",
        "rotate",
        lambda q, k, *_: (q, k, np.zeros((2, 4), np.float32)),
        TypeError,
        "integers",
    ),
    ("rotate-bool", "rotate", lambda q, k, *_: (q, k, np.zeros((2, 4), bool)), TypeError, "int"),
    (
        "rotate-past-table",
        "rotate",
        lambda q, k, *_: (q, k, np.array([[0, 1, 2, 3], [5, 6, 64, 7]])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "rotate-negative",
        "rotate",
        lambda q, k, *_: (q, k, np.array([0, -1, 2, 3])),
        ValueError,
        ">= 0",
    ),
    ("rotate-empty", "rotate", lambda q, k, *_: (q, k, np.zeros((0,), np.int64)), ValueError, "."),
    (
        "backward-dtype",
        "backward",
        lambda q, k, dq, dk, _: (dq.astype(np.float64), dk),
        TypeError,
        "dtype",
    ),
    ("backward-width", "backward", lambda q, k, dq, dk, _: (dk, dk), ValueError, r"\[B, T, 24\]"),
    ("backward-list", "backward", lambda q, k, dq, dk, _: (dq, dk.tolist()), TypeError, "array"),
    (
        "backward-B-beyond",
        "backward",
        lambda *a: (a[-1](np.ones((3, 4, Q_W), F32)), a[-1](np.ones((3, 4, K_W), F32))),
        ValueError,
        "build shape",
    ),
    (
        "backward-past-table",
        "backward",
        lambda q, k, dq, dk, _: (dq, dk, np.array([1, 2, 3, 64])),
        ValueError,
        r"position 64\b.*max_seq_len = 64",
    ),
    (
        "backward-positions-shape",
        "backward",
        lambda q, k, dq, dk, _: (dq, dk, np.arange(3)),
        ValueError,
        "broadcast",
    ),
    (
        "backward-float-positions",
        "backward",
        lambda q, k, dq, dk, _: (dq, dk, np.arange(4.0)),
        TypeError,
        "integers",
    ),
]


#: read-only arrays exist on the CPU alone (CuPy arrays have no writeable flag)
CPU_ONLY_BAD_CALLS = {"q-read-only", "k-read-only"}


@on_every_device
@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize(
    ("case", "method", "make_args", "error", "pattern"),
    BAD_CALLS,
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_calls_raise_and_change_nothing(
    device: str,
    backend: str | None,
    case: str,
    method: str,
    make_args: Callable[..., tuple],
    error: type[Exception],
    pattern: str,
    precision: Precision,
    rng,
) -> None:
    if device != "CPU" and case in CPU_ONLY_BAD_CALLS:
        pytest.skip("CuPy arrays have no read-only flag")
    cfg = RopeConfig(**_BAD_CFG)
    rope = make_rope(cfg, 2, 4, mode=TRAINING, precision=precision, backend=backend, device=device)
    q, k, dq, dk = (
        put(device, x) for x in (*random_qk(rng, cfg, 2, 4, precision),
                                 *random_qk(rng, cfg, 2, 4, precision))
    )  # fmt: skip
    rope.backward(dq, dk)  # the gradient buffers hold something to compare

    def on(x: np.ndarray) -> Any:
        return put(device, x.astype(dtype_of(precision)) if x.dtype == np.float32 else x)

    args = make_args(q, k, dq, dk, on)
    watched = [q, k, dq, dk, *rope.input_gradients, *rope.table.arrays()]
    watched += [a for a in args if _is_array(a)]
    before = [(a, host(a).copy()) for a in watched]
    state = dict(rope.__dict__), dict(rope.op.__dict__)
    with pytest.raises(error, match=pattern):
        getattr(rope, method)(*args)
    for array, saved in before:
        _assert_bit_identical(array, saved)
    assert dict(rope.__dict__) == state[0] and dict(rope.op.__dict__) == state[1]
    # and the component still works
    q0, k0 = host(q).copy(), host(k).copy()
    rope.prefill(q, k, 60)
    ref_q, ref_k = reference(cfg, q0, k0, arange_positions(2, 4, 60))
    assert_close(host(q), ref_q, precision)
    assert_close(host(k), ref_k, precision)


def test_wrong_precision_arrays_raise_type_error(device: str, rng) -> None:
    cfg = RopeConfig(**_BAD_CFG)
    precisions = PRECISIONS if device == "CPU" or cuda_arrays.CUPY_BF16 else (FP32, FP16)
    for precision in precisions:
        rope = make_rope(cfg, 2, 4, precision=precision, device=device)
        for other in precisions:
            if other is precision:
                continue
            q0, k0 = random_qk(rng, cfg, 2, 4, other)
            q, k = put(device, q0), put(device, k0)
            with pytest.raises(TypeError, match=str(precision)):
                rope.forward(q, k)
            _assert_bit_identical(q, q0)
            _assert_bit_identical(k, k0)


@pytest.mark.parametrize(
    "call",
    [
        lambda r, q, k: r.forward(q, k),
        lambda r, q, k: r.prefill(q, k, 0),
        lambda r, q, k: r.decode(q[:, :1], k[:, :1], 0),
        lambda r, q, k: r.rotate(q, k, np.arange(4)),
        lambda r, q, k: r.backward(q, k),
        lambda r, q, k: r.table,
        lambda r, q, k: r.attention_scaling,
    ],
    ids=["forward", "prefill", "decode", "rotate", "backward", "table", "attention_scaling"],
)
@pytest.mark.parametrize("standalone", [True, False], ids=["standalone", "no-context"])
def test_calls_before_build_raise_runtime_error(standalone: bool, call, rng) -> None:
    cfg = RopeConfig(**_BAD_CFG)
    rope = Rope("r", cfg, device="CPU") if standalone else Rope("r", cfg)
    q, k = random_qk(rng, cfg, 2, 4)
    q0 = q.copy()
    with pytest.raises(RuntimeError, match="build"):
        call(rope, q, k)
    _assert_bit_identical(q, q0)


def test_build_shape_must_be_q_shape() -> None:
    cfg = RopeConfig(**_BAD_CFG)
    rope = Rope("r", cfg, device="CPU")
    with pytest.raises(ValueError, match="build shape"):
        rope.build(BuildContext((2, 4, K_W), TRAINING))
    with pytest.raises(ValueError, match="build shape"):
        rope.build(BuildContext((2, 4, 2, Q_W), TRAINING))
    assert not rope.is_built and rope.get_gradients() == []
    rope.build(BuildContext((2, 4, Q_W), TRAINING))  # a failed build can be retried
    assert rope.is_built
    with pytest.raises(RuntimeError):
        rope.build(BuildContext((2, 4, Q_W), TRAINING))


def test_constructor_checks() -> None:
    with pytest.raises(TypeError, match="RopeConfig"):
        Rope("r", {"channels": 8}, device="CPU")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Rope("0bad", RopeConfig(**_BAD_CFG), device="CPU")


# ---------------------------------------------------------------------------------- RopeConfig


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(channels=30, n_heads=4), ValueError, "divisible"),
        (dict(channels=12, n_heads=4, n_kv_heads=1), ValueError, "even"),
        (dict(n_kv_heads=5), ValueError, "n_kv_heads"),
        (dict(channels=0), ValueError, "channels"),
        (dict(n_heads=0), ValueError, "n_heads"),
        (dict(n_kv_heads=0), ValueError, "n_kv_heads"),
        (dict(n_heads=-4), ValueError, "n_heads"),
        (dict(max_seq_len=0), ValueError, "max_seq_len"),
        (dict(max_seq_len=-1), ValueError, "max_seq_len"),
        (dict(base=0.0), ValueError, "base"),
        (dict(base=-10000.0), ValueError, "base"),
        (dict(base=1.0), ValueError, "base"),
        (dict(base=float("nan")), ValueError, "base"),
        (dict(base=float("inf")), ValueError, "base"),
        (dict(base="10000"), ValueError, "base"),
        (dict(rotary_dim=-2), ValueError, "rotary_dim"),
        (dict(rotary_dim=3), ValueError, "rotary_dim"),
        (dict(rotary_dim=18), ValueError, "rotary_dim"),
        (dict(layout="neox"), ValueError, "layout"),
        (dict(channels=64.0), TypeError, "channels"),
        (dict(n_heads=True), TypeError, "n_heads"),
        (dict(max_seq_len=None), TypeError, "max_seq_len"),
        (dict(scaling="linear"), TypeError, "scaling"),
        (dict(scaling=[("rope_type", "linear")]), TypeError, "scaling"),
    ],
)
def test_rope_config_validation(kwargs: dict[str, Any], error, pattern: str) -> None:
    base = dict(channels=64, n_heads=4, n_kv_heads=2, max_seq_len=128)
    with pytest.raises(error, match=pattern):
        RopeConfig(**{**base, **kwargs})


def test_rope_config_accepts_edges_and_is_frozen() -> None:
    cfg = RopeConfig(channels=64, n_heads=4, n_kv_heads=4, max_seq_len=1, rotary_dim=16)
    assert cfg.head_dim == 16 and cfg.rotated_dim == 16 and cfg.kv_channels == 64
    cfg = RopeConfig(channels=64, n_heads=4, n_kv_heads=1, max_seq_len=8, rotary_dim=2)
    assert cfg.rotated_dim == 2
    assert RopeConfig(channels=8, n_heads=1, n_kv_heads=1, max_seq_len=8).head_dim == 8
    assert RopeConfig(64, 4, 1, 8, layout="interleaved").layout.value == "interleaved"
    with pytest.raises(AttributeError):
        cfg.base = 2.0  # type: ignore[misc]
    scaled = RopeConfig(64, 4, 1, 8, scaling={"rope_type": "linear", "factor": 2})
    assert scaled == RopeConfig(64, 4, 1, 8, scaling={"factor": 2, "rope_type": "linear"})
    assert hash(scaled) == hash(
        RopeConfig(64, 4, 1, 8, scaling={"rope_type": "linear", "factor": 2})
    )


# ---------------------------------------------------------------------------------- sharing


def test_get_rope_shares_one_table_per_table_configuration() -> None:
    cfg = rope_config((4, 1), max_seq_len=512)
    table = get_rope(cfg, "CPU")
    assert get_rope(rope_config((4, 1), max_seq_len=512), "cpu") is table
    # head counts and layout do not change the table
    assert get_rope(rope_config((8, 8), max_seq_len=512, layout="interleaved")) is table
    assert get_rope(rope_config((1, 1), max_seq_len=512)) is table
    for other in (
        rope_config((4, 1), max_seq_len=256),
        rope_config((4, 1), max_seq_len=512, base=500000.0),
        rope_config((4, 1), max_seq_len=512, rotary_dim=8),
        rope_config((4, 1), max_seq_len=512, head_dim=16),
        rope_config((4, 1), max_seq_len=512, scaling={"rope_type": "linear", "factor": 2.0}),
    ):
        assert get_rope(other) is not table
    # spellings of one table share it: the default type named, the type or the theta repeated
    for scaling in (
        {"rope_type": "default"},
        {"type": "default", "rope_theta": cfg.base},
        {"rope_type": "default", "partial_rotary_factor": 1.0},
    ):
        assert get_rope(rope_config((4, 1), max_seq_len=512, scaling=scaling)) is table
    linear = get_rope(rope_config((4, 1), max_seq_len=512, scaling={"type": "linear", "factor": 2}))
    assert linear is not table and linear is get_rope(
        rope_config((4, 1), max_seq_len=512, scaling={"factor": 2, "rope_type": "linear"})
    )
    assert linear is not get_rope(
        rope_config((4, 1), max_seq_len=512, scaling={"rope_type": "linear", "factor": 3})
    )
    assert table.cos.dtype == np.float32 and table.sin.dtype == np.float32
    assert table.cos.shape == (512, HEAD_DIM // 2)
    with pytest.raises(TypeError):
        get_rope({"channels": 12})  # type: ignore[arg-type]


def test_ropes_share_the_table_and_a_network_counts_it_once() -> None:
    cfg = rope_config((4, 1), max_seq_len=256)
    other_heads = rope_config((4, 4), max_seq_len=256, layout="interleaved")
    net = Network("n", device="CPU")
    net.add_component(Rope("a", cfg)).add_component(Rope("b", cfg))
    net.add_component(Rope("c", other_heads))
    net.build(BuildContext((2, 3, cfg.channels), TRAINING))
    a, b, c = (net.get_component(name) for name in "abc")
    assert a.table is b.table is c.table
    table_bytes = a.table.nbytes
    assert table_bytes == 2 * 256 * (HEAD_DIM // 2) * 4
    stats = net.get_memory_stats()
    assert stats.state_bytes == table_bytes
    grads = 2 * (2 * 3 * (cfg.channels + cfg.kv_channels) * 4)
    grads += 2 * 3 * (other_heads.channels + other_heads.kv_channels) * 4
    assert stats.gradient_bytes == grads
    assert a.get_memory_stats().state_bytes == table_bytes  # each alone still reports it
    assert net.get_gradients() == []  # Rope has no parameters
    assert sum(len(r.input_gradients) for r in (a, b, c)) == 6


def test_network_of_ropes_inference_has_no_gradients() -> None:
    cfg = rope_config((4, 1), max_seq_len=128)
    net = Network("n", device="CPU", precision=Precision.BF16)
    net.add_component(Rope("a", cfg, precision=Precision.BF16))
    net.add_component(Rope("b", cfg, precision=Precision.BF16))
    net.build(BuildContext((1, 2, cfg.channels), INFERENCE))
    stats = net.get_memory_stats()
    assert stats.gradient_bytes == 0
    assert stats.state_bytes == 2 * 128 * (HEAD_DIM // 2) * 4
    assert net.get_gradients() == []


# ---------------------------------------------------------------------------------- properties

_PROPERTY_CFG = st.tuples(
    st.sampled_from(["half", "interleaved"]),
    st.sampled_from([0, 2, 4]),  # rotary_dim of head_dim 8
    st.sampled_from(
        [
            None,
            {"rope_type": "linear", "factor": 4.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ]
    ),
)


def _property_rope(layout: str, rotary_dim: int, scaling: Any, backend: str) -> Rope:
    cfg = RopeConfig(
        channels=16,
        n_heads=2,
        n_kv_heads=1,
        max_seq_len=4096,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=scaling,
    )
    return make_rope(cfg, 2, 3, backend=backend)


_ROPES: dict[tuple[str, int, str, str], Rope] = {}


def _cached_rope(layout: str, rotary_dim: int, scaling: Any, backend: str) -> Rope:
    key = (layout, rotary_dim, repr(scaling), backend)
    if key not in _ROPES:
        _ROPES[key] = _property_rope(layout, rotary_dim, scaling, backend)
    return _ROPES[key]


def _pairs(x: np.ndarray, n_heads: int, n_freq: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    heads = f64(x).reshape(x.shape[0], x.shape[1], n_heads, -1)
    if layout == "half":
        return heads[..., :n_freq], heads[..., n_freq : 2 * n_freq]
    return heads[..., 0 : 2 * n_freq : 2], heads[..., 1 : 2 * n_freq : 2]


_vectors = st.integers(min_value=0, max_value=2**32 - 1)
_backends = st.sampled_from(["numpy", "fused"] if _rope_fused.AVAILABLE else ["numpy"])


@settings(max_examples=30, deadline=None)
@given(
    cfg=_PROPERTY_CFG,
    seed=_vectors,
    positions=st.lists(st.integers(0, 4095), min_size=6, max_size=6),
    backend=_backends,
)
def test_property_norm_of_every_pair_is_preserved(cfg, seed, positions, backend) -> None:
    layout, rotary_dim, scaling = cfg
    rope = _cached_rope(layout, rotary_dim, scaling, backend)
    rng = np.random.default_rng(seed)
    q, k = random_qk(rng, rope.config, 2, 3)
    q0, k0 = q.copy(), k.copy()
    rope.rotate(q, k, np.array(positions).reshape(2, 3))
    n_freq = (rotary_dim or 8) // 2
    attention = rope.attention_scaling
    for x, x0, heads in ((q, q0, 2), (k, k0, 1)):
        a, b = _pairs(x, heads, n_freq, layout)
        a0, b0 = _pairs(x0, heads, n_freq, layout)
        np.testing.assert_allclose(
            np.hypot(a, b), attention * np.hypot(a0, b0), rtol=2e-6, atol=2e-6
        )
        rest = f64(x).reshape(2, 3, heads, 8)[..., 2 * n_freq :]
        np.testing.assert_array_equal(rest, f64(x0).reshape(2, 3, heads, 8)[..., 2 * n_freq :])


@settings(max_examples=30, deadline=None)
@given(
    cfg=_PROPERTY_CFG,
    seed=_vectors,
    m=st.integers(0, 2047),
    n=st.integers(0, 2047),
    shift=st.integers(0, 2048),
    backend=_backends,
)
def test_property_scores_depend_only_on_relative_position(cfg, seed, m, n, shift, backend) -> None:
    """<R_m q, R_n k> per head equals <R_{m+s} q, R_{n+s} k>."""
    layout, rotary_dim, scaling = cfg
    rope = _cached_rope(layout, rotary_dim, scaling, backend)
    rng = np.random.default_rng(seed)
    q, k = random_qk(rng, rope.config, 1, 1)

    def scores(pos_q: int, pos_k: int) -> np.ndarray:
        x = np.concatenate([q, q], axis=1)  # token 0 rotated at pos_q ...
        y = np.concatenate([k, k], axis=1)  # ... token 1 at pos_k
        rope.rotate(x, y, np.array([[pos_q, pos_k]]))
        qh = f64(x[0, 0]).reshape(2, 8)
        kh = f64(y[0, 1]).reshape(1, 8)
        return qh @ kh[0]

    base = scores(m, n)
    shifted = scores(m + shift, n + shift)
    np.testing.assert_allclose(shifted, base, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_forked_child_rotates_large_calls(backend: str) -> None:
    """The op's thread pool does not survive fork; the child must start its own, not hang."""
    code = f"""
import os, signal, numpy as np
from mila_py import BuildContext, RuntimeMode
from mila_py.components import Rope, RopeConfig
rope = Rope("r", RopeConfig(4096, 32, 8, 2048), device="CPU")
rope.build(BuildContext((1, 1024, 4096), RuntimeMode.INFERENCE))
rope.op.backend = {backend!r}
q, k = np.ones((1, 1024, 4096), np.float32), np.ones((1, 1024, 1024), np.float32)
rope.forward(q, k)  # large enough for the pool: the parent starts it
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a hang ends the child with SIGALRM
    rope.forward(q, k)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "0", result.stderr


def test_a_rope_op_that_is_not_a_positional_paired_op_is_refused(monkeypatch) -> None:
    """The registry's RopeOp must have prefill and decode (checked once, at op creation)."""
    import mila_py.components.rope as rope_module
    from mila_py.ops.operation import Operation, PositionalPairedOp

    assert isinstance(Rope("real", rope_config(), device="CPU").op, PositionalPairedOp)

    class Unpaired(Operation):
        def apply(self, *args: object, **kwargs: object) -> None: ...

    monkeypatch.setattr(rope_module, "create_op", lambda _name, *args: Unpaired(*args))
    with pytest.raises(TypeError, match="PositionalPairedOp"):
        Rope("rope", rope_config(), device="CPU")
    inner = Rope("inner", rope_config())
    with pytest.raises(TypeError, match="PositionalPairedOp"):
        Network("net").add_component(inner)
    assert not inner.has_execution_context  # the failed hook left no context
