"""Shared helpers of the Rope tests: building components, random inputs, tolerances, backends,
and the CUDA op's documented access widths."""

from __future__ import annotations

from typing import Any

import cuda_arrays
import ml_dtypes
import numpy as np
import pytest
from conftest import CUDA_PARAMS
from hypothesis import strategies as st
from rope_reference import Spec

from mila_py import BuildContext, Precision, RuntimeMode
from mila_py.components import Rope, RopeConfig
from mila_py.ops.cpu import _rope_fused

FP32, FP16, BF16 = Precision.FP32, Precision.FP16, Precision.BF16
PRECISIONS = (FP32, FP16, BF16)
TRAINING, INFERENCE = RuntimeMode.TRAINING, RuntimeMode.INFERENCE

#: the two CPU paths every correctness case runs on
BACKEND_PARAMS = [
    "numpy",
    pytest.param(
        "fused",
        marks=pytest.mark.skipif(not _rope_fused.AVAILABLE, reason="Numba is not installed"),
    ),
]

#: where a device-generic component body runs, as ``(device, backend)``: the CPU op's two paths,
#: and ``CUDA:0`` (a GPU's, or the kernel emulator's where none is present), which has no
#: backend; ``device`` goes through conftest's fixture (``indirect``)
PLACES = [
    pytest.param("CPU", "numpy", id="CPU-numpy"),
    pytest.param(
        "CPU",
        "fused",
        id="CPU-fused",
        marks=pytest.mark.skipif(not _rope_fused.AVAILABLE, reason="Numba is not installed"),
    ),
    *(pytest.param(p.values[0], None, id=p.id, marks=p.marks) for p in CUDA_PARAMS),
]
#: a body runs over :data:`PLACES`, taking ``device`` and ``backend``
on_every_device = pytest.mark.parametrize(("device", "backend"), PLACES, indirect=["device"])

#: (rtol, atol) against the float64 reference. FP32: table rounding plus a few fp32 operations.
#: FP16/BF16: one rounding of the fp32 result, at most half an ulp = 2^-11 / 2^-8 relative.
TOLERANCES: dict[Precision, tuple[float, float]] = {
    FP32: (2e-6, 2e-6),
    FP16: (2.0**-11 * 1.01, 2e-6),
    BF16: (2.0**-8 * 1.01, 2e-6),
}


def dtype_of(precision: Precision) -> np.dtype:
    return {
        FP32: np.dtype(np.float32),
        FP16: np.dtype(np.float16),
        BF16: np.dtype(ml_dtypes.bfloat16),
    }[precision]


def rope_config(
    heads: tuple[int, int] = (3, 1),
    head_dim: int = 12,
    *,
    max_seq_len: int = 2048,
    **kwargs: Any,
) -> RopeConfig:
    """A RopeConfig from ``(n_heads, n_kv_heads)`` and ``head_dim`` (12 by default: not a power
    of two, n_freq = 6); other fields as keywords."""
    hq, hk = heads
    return RopeConfig(
        channels=hq * head_dim, n_heads=hq, n_kv_heads=hk, max_seq_len=max_seq_len, **kwargs
    )


def make_rope(
    config: RopeConfig,
    batch: int,
    tokens: int,
    *,
    mode: RuntimeMode = INFERENCE,
    precision: Precision = FP32,
    backend: str | None = None,
    name: str = "rope",
    device: str = "CPU",
) -> Rope:
    """A standalone Rope built for ``[batch, tokens, channels]`` (on the CPU by default); the
    test skips where ``device`` is a GPU whose CuPy has no bfloat16 arrays and ``precision`` is
    BF16 (the CUDA op refuses it there)."""
    if device != "CPU" and precision is BF16 and not cuda_arrays.CUPY_BF16:
        pytest.skip(cuda_arrays.NO_BF16_REASON)
    rope = Rope(name, config, device=device, precision=precision)
    if backend is not None:
        rope.op.backend = backend
    rope.build(BuildContext((batch, tokens, config.channels), mode))
    return rope


def random_qk(
    rng: np.random.Generator,
    config: RopeConfig,
    batch: int,
    tokens: int,
    precision: Precision = FP32,
) -> tuple[np.ndarray, np.ndarray]:
    """Random Q and K of the component's dtype (standard normal, asymmetric)."""
    head_dim = config.channels // config.n_heads
    dt = dtype_of(precision)
    q = rng.standard_normal((batch, tokens, config.n_heads * head_dim)).astype(dt)
    k = rng.standard_normal((batch, tokens, config.n_kv_heads * head_dim)).astype(dt)
    return q, k


def f64(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def assert_close(actual: Any, expected: Any, precision: Precision, *, scale: float = 1.0) -> None:
    """``actual`` (component dtype) against a float64 reference with precision-keyed tolerances."""
    rtol, atol = TOLERANCES[precision]
    np.testing.assert_allclose(f64(actual), expected, rtol=rtol, atol=atol * scale)


def reference(
    config: RopeConfig, q: Any, k: Any, positions: Any, *, inverse: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The float64 reference of one call at ``positions`` (broadcast to ``[B, T]``)."""
    return Spec.of(config).rotate_qk(f64(q), f64(k), positions, inverse=inverse)


def put(device: str, x: Any) -> Any:
    """A C-contiguous copy of host array ``x`` on ``device`` (a NumPy copy on the CPU)."""
    return cuda_arrays.on(device, np.array(x, order="C", copy=True))


def write_bits(buffer: Any, values: np.ndarray) -> None:
    """``values``' bytes into the C-contiguous array ``buffer`` (of any device) in place, as
    a decode loop writes its new token: a copy from the host, no kernel of CuPy's (BF16 too)."""
    values = np.ascontiguousarray(values)
    assert values.nbytes == buffer.nbytes and buffer.flags.c_contiguous
    if cuda_arrays.EMULATED or isinstance(buffer, np.ndarray):
        buffer[...] = values
    else:
        buffer.data.copy_from_host(values.ctypes.data, values.nbytes)


def arange_positions(batch: int, tokens: int, offset: int = 0) -> np.ndarray:
    return np.broadcast_to(np.arange(offset, offset + tokens), (batch, tokens))


# ---------------------------------------------------------------------------------- decode programs
#: what a step does to its pair before the call: nothing, Q or K made read-only, reshaped or
#: given another dtype in place, the CPU backend switched to NumPy, the position as np.int64
_ACTIONS = ["none"] * 4 + [
    "readonly-q",
    "readonly-k",
    "reshape-q",
    "reshape-k",
    "dtype-q",
    "dtype-k",
    "numpy",
    "int64",
]
#: a position per sequence (B = 2): in range (int64 or int32), else out of range, of another
#: shape or of another type
_EACH = st.one_of(
    st.tuples(st.integers(0, 63), st.integers(0, 63)).map(np.array),
    st.tuples(st.integers(0, 63), st.integers(0, 63)).map(lambda t: np.array(t, np.int32)),
    st.sampled_from([
        np.array([3, 64]), np.array([-1, 5]), np.array([1, 2, 3]), np.array([[1], [2]]),
        np.array([1.0, 2.0]), np.array([True, False]), np.array([5, 63], np.uint8), [4, 9],
        np.array([3, 5], ">i8"), np.array([2**40, 5], ">i8"), np.array([2**40 + 3, 5]),
    ]),
)  # fmt: skip
#: one step of a decode program: (which buffer pair, what to do to it first, the position)
_STEPS = st.tuples(
    st.sampled_from([0, 0, 0, 1]),  # mostly the same pair, now and then the other
    st.sampled_from(_ACTIONS),
    st.one_of(  # mostly in range; else out of range or not an int; or one per sequence
        *[st.integers(0, 63)] * 4,
        st.sampled_from([-2, -1, 64, 65, 1000, True, False, 1.5, np.int64(-1), np.int64(64)]),
        *[_EACH] * 2,
    ),
)
#: decode programs that start by decoding pair 0 twice (a loop on the same buffers)
DECODE_PROGRAMS = st.lists(_STEPS, min_size=1, max_size=12).map(
    lambda steps: [(0, "none", 1), (0, "none", 2), *steps]
)
#: the configs a program runs on: (layout, rotary_dim: 0 for the whole head)
DECODE_CONFIGS = st.tuples(st.sampled_from(["half", "interleaved"]), st.sampled_from([0, 4]))


def _change(x: np.ndarray, how: str, batch: int, undo: bool = False) -> None:
    """Change ``x`` in place (``how``: readonly, reshape, dtype), or undo that."""
    if how == "readonly":
        x.flags.writeable = undo
    elif how == "reshape":
        x.shape = (batch, 1, x.shape[2]) if undo else (1, batch, x.shape[2])
    elif how == "dtype":
        x.dtype = np.float32 if undo else np.int32  # the same bytes, another type


def run_decode_program(program: list[tuple[int, str, Any]], rng: np.random.Generator,
                       device: str, config: tuple[str, int] = ("half", 0)) -> None:  # fmt: skip
    """Run ``program`` (:data:`DECODE_PROGRAMS`) on one Rope (max_seq_len 64, B=2; ``config``
    from :data:`DECODE_CONFIGS`) and check every call against the same call on fresh copies
    through a new component: the same bits, or the same error type with Q and K left as they
    were. The "numpy" action switches a CPU op to its NumPy backend for the call, which then
    must not call the fused kernel (a CUDA op has no backend: a plain call there)."""
    layout, rotary_dim = config
    cfg = rope_config((2, 1), 8, max_seq_len=64, layout=layout, rotary_dim=rotary_dim)
    batch = 2
    cpu = device == "CPU"
    calls = [0]
    fused = _rope_fused.rope_rows_inplace

    def counted(*args: Any) -> None:
        calls[0] += 1
        fused(*args)

    if cpu:
        _rope_fused.rope_rows_inplace = counted
    try:
        rope = make_rope(cfg, batch, 1, backend="fused" if cpu else None, device=device)
        pairs = [random_qk(rng, cfg, batch, 1) for _ in range(2)]
        for which, action, position in program:
            q, k = pairs[which]
            q[...], k[...] = random_qk(rng, cfg, batch, 1)
            backend = ("numpy" if action == "numpy" else "fused") if cpu else None
            if cpu:
                rope.op.backend = backend
            how, _, target = action.partition("-")
            changed = {"q": q, "k": k}.get(target)
            if changed is not None:
                _change(changed, how, batch)
            if action == "int64" and type(position) is int:
                position = np.int64(position)
            fresh = make_rope(cfg, batch, 1, backend=backend, device=device)
            want_q, want_k = q.copy(), k.copy()
            want_q.flags.writeable, want_k.flags.writeable = q.flags.writeable, k.flags.writeable
            before_q, before_k = q.copy(), k.copy()
            try:
                fresh.decode(want_q, want_k, position)
                expected: Any = None
            except (TypeError, ValueError) as exc:
                expected = type(exc)
            made = calls[0]
            if expected is None:
                rope.decode(q, k, position)
                assert _same_bits(q, want_q) and _same_bits(k, want_k)
            else:
                with pytest.raises(expected):
                    rope.decode(q, k, position)
                assert _same_bits(q, before_q) and _same_bits(k, before_k)
            if action == "numpy":
                assert calls[0] == made, "the NumPy backend called the fused kernel"
            if changed is not None:
                _change(changed, how, batch, undo=True)
    finally:
        _rope_fused.rope_rows_inplace = fused


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


#: narrow signed position types and a table past what their unsigned view covers (int32: one
#: within it), for :func:`check_negative_positions_refused`
NARROW_POSITIONS = [(np.int8, 200), (np.int16, 40000), (np.int32, 64)]


def check_negative_positions_refused(
    dtype: Any, max_seq_len: int, rng: np.random.Generator, device: str = "CPU"
) -> None:
    """A negative position per sequence of ``dtype`` is refused by a decode loop on the same
    buffers (ValueError, Q and K untouched, nothing launched on an emulated ``CUDA:0``): seen
    as unsigned, -1 of int8 is 255, under a table of 200. Q and K live on ``device``."""
    cfg = rope_config((2, 1), 8, max_seq_len=max_seq_len)
    rope = make_rope(cfg, 2, 1, backend="fused" if device == "CPU" else None, device=device)
    q, k = (cuda_arrays.on(device, x) for x in random_qk(rng, cfg, 2, 1))
    rope.decode(q, k, np.array([1, 2]))
    rope.decode(q, k, np.array([3, 4]))
    before_q, before_k = cuda_arrays.host(q).copy(), cuda_arrays.host(k).copy()
    launched = list(getattr(rope.execution_context, "launches", ()))
    for bad in (np.array([-1, 5], dtype), np.array([3, np.iinfo(dtype).min], dtype)):
        with pytest.raises(ValueError, match=">= 0"):
            rope.decode(q, k, bad)
        assert _same_bits(cuda_arrays.host(q), before_q)
        assert _same_bits(cuda_arrays.host(k), before_k)
    assert list(getattr(rope.execution_context, "launches", ())) == launched


def expected_width(
    precision: Precision, layout: str, head_dim: int, n_freq: int, spans: list[int]
) -> int:
    """The widest access (elements) the CUDA op documents: every byte offset and row stride in
    ``spans``, the rotated span (``n_freq`` for "half", ``2 n_freq`` for "interleaved") and the
    head a multiple of it; 1 where no 16-bit-or-wider access fits."""
    item = precision.itemsize
    span = 2 * n_freq if layout == "interleaved" else n_freq
    for nbytes in (16, 8, 4, 2):
        vec = nbytes // item
        if vec < 2:
            break
        if span % vec == 0 and head_dim % vec == 0 and all(s % nbytes == 0 for s in spans):
            return vec
    return 1
