"""Rope scaling types against the independent float64 reference, far from position 0.

Every type runs at positions 1000..max_seq_len-1 (errors hide at position 0), with both layouts,
full and partial rotary dims, both CPU backends; ``dynamic`` and ``longrope`` run below and above
their original context. Also: scaling-dict validation, ``register_rope_type`` and
``rope_config_from_hf``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import rope_reference as ref
from rope_helpers import (
    BACKEND_PARAMS,
    BF16,
    FP32,
    PRECISIONS,
    TRAINING,
    arange_positions,
    assert_close,
    f64,
    make_rope,
    random_qk,
    reference,
)
from rope_reference import Spec

from mila_py import BuildContext, Precision
from mila_py.components import (
    Rope,
    RopeConfig,
    get_rope,
    register_rope_type,
    registered_rope_types,
)
from mila_py.interop.hf_rope import rope_config_from_hf
from mila_py.rope import scaling as _rope_scaling

HEAD_DIM = 16
MAX_SEQ = 4096
ORIG = 1024
HQ, HK = 3, 1


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def _longrope(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 1.7 * i for i in range(n)],
        "original_max_position_embeddings": ORIG,
        **extra,
    }


def _scalings(n: int) -> dict[str, dict[str, Any] | None]:
    """Scaling dicts by id; ``n`` is the number of rotated pairs (for LongRoPE's lists)."""
    return {
        "default": None,
        "default-explicit": {"rope_type": "default"},
        "linear": {"rope_type": "linear", "factor": 4.0},
        "linear-legacy-type-key": {"type": "linear", "factor": 2.5},
        "dynamic": {
            "rope_type": "dynamic",
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
        "yarn-betas-untruncated": {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
        "yarn-deepseek": {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": ORIG,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        "yarn-deepseek-equal-mscale": {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": ORIG,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "yarn-attention-factor": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIG,
            "attention_factor": 0.8,
        },
        "yarn-factor-none": {
            "rope_type": "yarn",
            "factor": None,
            "original_max_position_embeddings": ORIG,
        },
        "longrope": _longrope(n),
        "longrope-factor-attention": _longrope(n, factor=16.0, attention_factor=1.25),
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIG,
        },
        "ntk-alpha": {"rope_type": "ntk_alpha", "alpha": 1000.0},
        "proportional": {"rope_type": "proportional"},
        "proportional-factor": {"rope_type": "proportional", "factor": 2.0},
    }


SCALING_IDS = list(_scalings(1))
LENGTH_DEPENDENT = {"dynamic", "longrope", "longrope-factor-attention"}


def _config(
    name: str, rotary_dim: int = 0, layout: str = "half", max_seq_len: int = MAX_SEQ
) -> RopeConfig:
    n = (rotary_dim or HEAD_DIM) // 2
    return RopeConfig(
        channels=HQ * HEAD_DIM,
        n_heads=HQ,
        n_kv_heads=HK,
        max_seq_len=max_seq_len,
        base=10000.0,
        rotary_dim=rotary_dim,
        layout=layout,
        scaling=_scalings(n)[name],
    )


# ---------------------------------------------------------------------------------- tables


@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("name", SCALING_IDS)
def test_frequencies_and_tables_match_reference(name: str, rotary_dim: int) -> None:
    cfg = _config(name, rotary_dim)
    spec = Spec.of(cfg)
    table = get_rope(cfg)
    for seq_len in (1, 1000, ORIG, ORIG + 1, 3000, MAX_SEQ):
        inv_freq, attention = table.frequencies(seq_len)
        want, want_attention = spec.frequencies(seq_len)
        np.testing.assert_allclose(inv_freq, want, rtol=1e-13, atol=0)
        assert attention == pytest.approx(want_attention, rel=1e-14)
    # the table at rest: rows of the short context, attention folded in, rounded once to fp32
    inv_freq, attention = spec.frequencies(1)
    rows = np.arange(1000, MAX_SEQ)
    angles = rows[:, None] * inv_freq[None, :]
    for got, want in ((table.cos, np.cos(angles)), (table.sin, np.sin(angles))):
        assert got.dtype == np.float32 and got.shape == (MAX_SEQ, len(inv_freq))
        np.testing.assert_array_equal(got[1000:], (attention * want).astype(np.float32))
    assert table.attention_scaling == pytest.approx(attention, rel=1e-14)


@pytest.mark.parametrize("name", SCALING_IDS)
def test_attention_and_softmax_scale(name: str) -> None:
    cfg = _config(name)
    rope = make_rope(cfg, 1, 1)
    _, attention = Spec.of(cfg).frequencies(1)
    assert rope.attention_scaling == pytest.approx(attention, rel=1e-14)
    expected = ref.softmax_scale_multiplier(cfg.scaling)
    assert rope.softmax_scale_multiplier == pytest.approx(expected, rel=1e-14)
    cos, sin = f64(rope.table.cos), f64(rope.table.sin)
    np.testing.assert_allclose(cos**2 + sin**2, attention**2, rtol=1e-6)


def test_softmax_scale_values() -> None:
    deepseek = make_rope(_config("yarn-deepseek"), 1, 1)
    assert deepseek.softmax_scale_multiplier == pytest.approx(
        (0.1 * 0.8 * math.log(40.0) + 1.0) ** 2, rel=1e-14
    )
    assert deepseek.attention_scaling == pytest.approx(
        (0.1 * math.log(40.0) + 1.0) / (0.1 * 0.8 * math.log(40.0) + 1.0), rel=1e-14
    )
    equal = make_rope(_config("yarn-deepseek-equal-mscale"), 1, 1)
    assert equal.attention_scaling == pytest.approx(1.0)
    assert equal.softmax_scale_multiplier > 1.0
    for name in ("default", "yarn", "linear", "longrope", "llama3", "dynamic"):
        assert make_rope(_config(name), 1, 1).softmax_scale_multiplier == 1.0
    plain_yarn = make_rope(_config("yarn"), 1, 1)
    assert plain_yarn.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-14)
    longrope = make_rope(_config("longrope"), 1, 1)
    assert longrope.attention_scaling == pytest.approx(
        math.sqrt(1 + math.log(MAX_SEQ / ORIG) / math.log(ORIG)), rel=1e-14
    )


# ---------------------------------------------------------------------------------- rotation


def _calls(rng: np.random.Generator, batch: int, tokens: int) -> list[tuple[str, Any]]:
    """(method, argument) of calls far from 0, below and above the original context."""
    return [
        ("prefill", 1000),  # max 1007 < ORIG: short / unscaled
        ("prefill", ORIG - tokens),  # ends exactly at the original length
        ("prefill", ORIG - 3),  # crosses it: the whole call uses the long parameters
        ("prefill", 2500),
        ("prefill", MAX_SEQ - tokens),
        ("rotate", rng.integers(1000, MAX_SEQ, size=(batch, tokens))),
        ("rotate", rng.integers(0, ORIG, size=(batch, tokens))),
        ("decode", np.array([1000, 3999])),  # one sequence above: both use seq_len 4000
        ("decode", np.array([1017, 5])),
        ("decode", MAX_SEQ - 1),
    ]


@pytest.mark.parametrize("precision", [FP32, BF16], ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [0, 8], ids=["full", "partial"])
@pytest.mark.parametrize("name", SCALING_IDS)
def test_rotation_matches_reference_far_from_zero(
    backend: str, name: str, rotary_dim: int, layout: str, precision: Precision, rng
) -> None:
    cfg = _config(name, rotary_dim, layout)
    batch, tokens = 2, 8
    rope = make_rope(cfg, batch, tokens, precision=precision, backend=backend)
    for method, arg in _calls(rng, batch, tokens):
        n_t = 1 if method == "decode" else tokens
        q, k = random_qk(rng, cfg, batch, n_t, precision)
        q0, k0 = q.copy(), k.copy()
        getattr(rope, method)(q, k, arg)
        if method == "prefill":
            positions = arange_positions(batch, tokens, arg)
        elif method == "decode":
            positions = np.broadcast_to(np.reshape(arg, (-1, 1)), (batch, 1))
        else:
            positions = arg
        ref_q, ref_k = reference(cfg, q0, k0, positions)
        assert_close(q, ref_q, precision, scale=rope.attention_scaling)
        assert_close(k, ref_k, precision, scale=rope.attention_scaling)


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_types_switch_per_call_and_are_stateless(
    backend: str, name: str, rng
) -> None:
    cfg = _config(name, layout="interleaved")
    rope = make_rope(cfg, 2, 1, backend=backend)
    q, k = random_qk(rng, cfg, 2, 1)

    def decode(positions: Any) -> np.ndarray:
        x, y = q.copy(), k.copy()
        rope.decode(x, y, positions)
        return x

    short = decode(np.array([5, 900]))
    long = decode(np.array([5, 3000]))  # sequence 0 at position 5 now uses the long parameters
    assert not np.allclose(short[0], long[0], rtol=1e-4, atol=1e-4)
    ref_short, _ = reference(cfg, q, k, np.array([[5], [900]]))
    ref_long, _ = reference(cfg, q, k, np.array([[5], [3000]]))
    assert_close(short, ref_short, FP32)
    assert_close(long, ref_long, FP32)
    np.testing.assert_array_equal(decode(np.array([5, 900])), short)  # no state kept
    # at exactly the original length the call is still short; one past it is long
    at = decode(np.array([5, ORIG - 1]))
    past = decode(np.array([5, ORIG]))
    np.testing.assert_array_equal(at[0], short[0])
    assert not np.array_equal(past[0], short[0])


def test_dynamic_prefill_in_chunks_below_original_equals_one_call(backend: str, rng) -> None:
    cfg = _config("dynamic")
    rope = make_rope(cfg, 1, 24, backend=backend)
    q, k = random_qk(rng, cfg, 1, 24)
    whole_q, whole_k = q.copy(), k.copy()
    rope.prefill(whole_q, whole_k, ORIG - 24)
    for lo in range(0, 24, 8):
        rope.prefill(q[:, lo : lo + 8], k[:, lo : lo + 8], ORIG - 24 + lo)
    np.testing.assert_array_equal(q, whole_q)
    np.testing.assert_array_equal(k, whole_k)


@pytest.mark.parametrize("precision", PRECISIONS, ids=str)
@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn-deepseek", "llama3"])
def test_backward_with_scaling(backend: str, name: str, precision: Precision, rng) -> None:
    """backward = attention * R^T for the call's parameters; with positions=None, seq_len = T."""
    n = HEAD_DIM // 2
    scaling = dict(_scalings(n)[name])  # type: ignore[arg-type]
    scaling["original_max_position_embeddings"] = 16
    cfg = RopeConfig(HQ * HEAD_DIM, HQ, HK, 64, scaling=scaling)
    batch, tokens = 2, 40  # T > original: positions 0..39 use the long parameters
    rope = make_rope(cfg, batch, tokens, mode=TRAINING, precision=precision, backend=backend)
    dq, dk = random_qk(rng, cfg, batch, tokens, precision)
    for positions in (None, rng.integers(0, 64, size=(batch, tokens)), np.arange(10)):
        if positions is not None and positions.shape == (10,):
            call_dq, call_dk = dq[:, :10], dk[:, :10]  # below the original: short parameters
        else:
            call_dq, call_dk = dq, dk
        dq_in, dk_in = rope.backward(call_dq, call_dk, positions=positions)
        pos = arange_positions(batch, tokens) if positions is None else positions
        ref_q, ref_k = reference(cfg, call_dq, call_dk, pos, inverse=True)
        assert_close(dq_in, ref_q, precision)
        assert_close(dk_in, ref_k, precision)
    if precision is FP32:  # forward(backward(g)) = attention^2 * g
        dq_in, dk_in = rope.backward(dq, dk)
        x, y = dq_in.copy(), dk_in.copy()
        rope.forward(x, y)
        attention = rope.attention_scaling
        np.testing.assert_allclose(x, attention**2 * f64(dq), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y, attention**2 * f64(dk), rtol=1e-5, atol=1e-5)


def test_longrope_keeps_a_long_table_in_memory() -> None:
    cfg = _config("longrope")
    rope = make_rope(cfg, 1, 1)
    n = HEAD_DIM // 2
    assert rope.get_memory_stats().state_bytes == 4 * MAX_SEQ * n * 4
    assert make_rope(_config("dynamic"), 1, 1).get_memory_stats().state_bytes == 2 * MAX_SEQ * n * 4


# ---------------------------------------------------------------------------------- validation


def _cfg_with(scaling: Any, rotary_dim: int = 0) -> RopeConfig:
    return RopeConfig(HQ * HEAD_DIM, HQ, HK, MAX_SEQ, rotary_dim=rotary_dim, scaling=scaling)


@pytest.mark.parametrize(
    ("scaling", "pattern"),
    [
        ({"rope_type": "no-such-type"}, "unknown rope_type"),
        ({"type": "no-such-type", "factor": 2}, "unknown rope_type"),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "linear", "factor": 0}, "factor"),
        ({"rope_type": "linear", "factor": -2.0}, "factor"),
        ({"rope_type": "linear", "factor": "2"}, "factor"),
        ({"rope_type": "linear", "factor": float("nan")}, "factor"),
        ({"rope_type": "linear", "factor": 2, "factr": 3}, "factr"),
        ({"rope_type": "default", "factor": 2}, "factor"),
        ({"rope_type": "dynamic"}, "factor"),
        ({"rope_type": "dynamic", "factor": 0.5}, "factor"),
        ({"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 0}, "original"),
        # without the pretrained context the switch would sit at the table's end: refused
        ({"rope_type": "dynamic", "factor": 2}, "needs original_max_position_embeddings"),
        ({**_longrope(8), "original_max_position_embeddings": None}, "needs original_max"),
        ({"rope_type": "yarn"}, "factor"),
        ({"rope_type": "yarn", "factor": 0.5}, "factor"),
        ({"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32}, "beta_fast"),
        ({"rope_type": "yarn", "factor": 4, "mscale": -1.0}, "mscale"),
        ({"rope_type": "yarn", "factor": 4, "truncate": "yes"}, "truncate"),
        ({"rope_type": "yarn", "factor": 4, "low_freq_factor": 1}, "low_freq_factor"),
        ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1}, "high_freq_factor"),
        ({"rope_type": "llama3", "factor": 8, "high_freq_factor": 4}, "low_freq_factor"),
        ({"rope_type": "llama3", "low_freq_factor": 1, "high_freq_factor": 4}, "factor"),
        (
            {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 2},
            "high_freq_factor",
        ),
        (
            {"rope_type": "llama3", "factor": 8, "low_freq_factor": 0, "high_freq_factor": 4},
            "low_freq_factor",
        ),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "long_factor"),
        ({"rope_type": "longrope", "long_factor": [1.0] * 8}, "short_factor"),
        ({**_longrope(8), "short_factor": [1.0] * 7}, "short_factor.*8"),
        ({**_longrope(8), "long_factor": [1.0] * 9}, "long_factor.*8"),
        ({**_longrope(8), "long_factor": [[1.0] * 8]}, "long_factor"),
        ({**_longrope(8), "long_factor": ["a"] * 8}, "long_factor"),
        ({**_longrope(8), "short_factor": [1.0] * 7 + [0.0]}, "short_factor"),
        ({**_longrope(8), "attention_factor": -1.0}, "attention_factor"),
        ({**_longrope(8), "beta_fast": 32}, "beta_fast"),
        ({"rope_type": "proportional", "factor": 0}, "factor"),
        ({"rope_type": "ntk_alpha"}, "alpha"),
        ({"rope_type": "ntk_alpha", "alpha": 0}, "alpha"),
        ({"rope_type": "ntk_alpha", "alpha": float("inf")}, "alpha"),
        ({"rope_type": "ntk_alpha", "alpha": 10, "factor": 1}, "factor"),
        ({"rope_type": "dynamic", "factor": 1, "alpha": 10}, "alpha"),  # HunYuan's spelling
    ],
)
def test_bad_scaling_dicts_raise(scaling: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _cfg_with(scaling)


def test_longrope_lists_follow_the_rotary_dim() -> None:
    _cfg_with(_longrope(4), rotary_dim=8)  # 4 pairs rotate
    with pytest.raises(ValueError, match="4"):
        _cfg_with(_longrope(8), rotary_dim=8)


def test_scaling_must_be_a_mapping() -> None:
    with pytest.raises(TypeError, match="scaling"):
        _cfg_with("yarn")
    with pytest.raises(TypeError, match="scaling"):
        _cfg_with(4.0)


def test_hf_bookkeeping_keys_are_accepted() -> None:
    cfg = _cfg_with(
        {"type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 1}
    )
    assert cfg.rope_type == "linear"
    assert _cfg_with({"rope_type": "default", "rope_theta": 10000.0}).rope_type == "default"


# ---------------------------------------------------------------------------------- registry


@pytest.fixture
def type_name() -> Iterator[str]:
    """A unique rope_type name, unregistered again after the test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    _rope_scaling._TYPES.pop(name, None)


def test_register_rope_type(type_name: str, backend: str, rng) -> None:
    calls: list[tuple[Any, ...]] = []

    @register_rope_type(type_name)
    def power_law(head_dim, rotary_dim, base, max_seq_len, params):  # type: ignore[no-untyped-def]
        calls.append((head_dim, rotary_dim, base, max_seq_len, dict(params)))
        n = rotary_dim // 2
        return np.array([base ** (-i / n) / params["alpha"] for i in range(n)]), 1.25

    assert type_name in registered_rope_types()
    scaling = {"rope_type": type_name, "alpha": 3.0}
    cfg = RopeConfig(HQ * HEAD_DIM, HQ, HK, MAX_SEQ, base=500.0, rotary_dim=8, scaling=scaling)
    rope = make_rope(cfg, 2, 4, backend=backend)
    head_dim, rotary_dim, base, max_seq_len, params = calls[0]
    assert (head_dim, rotary_dim, base, max_seq_len) == (HEAD_DIM, 8, 500.0, MAX_SEQ)
    assert params["alpha"] == 3.0
    assert rope.attention_scaling == 1.25 and rope.softmax_scale_multiplier == 1.0
    # an independent rotation with the same frequencies
    inv_freq = np.array([500.0 ** (-i / 4) / 3.0 for i in range(4)])
    q, k = random_qk(rng, cfg, 2, 4)
    q0, k0 = q.copy(), k.copy()
    rope.prefill(q, k, 3000)
    positions = arange_positions(2, 4, 3000)
    assert_close(q, ref.rotate(q0, positions, HQ, HEAD_DIM, inv_freq, 1.25, "half"), FP32)
    assert_close(k, ref.rotate(k0, positions, HK, HEAD_DIM, inv_freq, 1.25, "half"), FP32)
    with pytest.raises(ValueError, match="already registered"):
        register_rope_type(type_name, power_law)
    register_rope_type(type_name, power_law, replace=True)


def test_register_rope_type_with_required_keys_and_softmax_scale(type_name: str) -> None:
    register_rope_type(
        type_name,
        lambda head_dim, rotary_dim, base, max_seq_len, params: (
            np.full(rotary_dim // 2, 0.01),
            1.0,
        ),
        required=("alpha",),
        optional=(),
        softmax_scale=lambda params: 2.0 * params["alpha"],
    )
    with pytest.raises(ValueError, match="alpha"):
        _cfg_with({"rope_type": type_name})
    with pytest.raises(ValueError, match="beta"):
        _cfg_with({"rope_type": type_name, "alpha": 1.0, "beta": 2.0})
    rope = make_rope(_cfg_with({"rope_type": type_name, "alpha": 1.5}), 1, 1)
    assert rope.softmax_scale_multiplier == 3.0


@pytest.mark.parametrize(
    "result",
    [
        (np.ones(HEAD_DIM), 1.0),  # more pairs than the head has
        (np.ones(HEAD_DIM // 2 - 1), 1.0),  # would pair the half layout's channels wrongly
        (np.ones((2, 4)), 1.0),
        (np.array([1.0, np.nan, 1.0, 1.0]), 1.0),
        (np.ones(4), float("inf")),
    ],
    ids=["too-long", "too-short", "2d", "nan", "inf-attention"],
)
def test_registered_type_returning_garbage_is_refused(type_name: str, result) -> None:
    register_rope_type(type_name, lambda *args: result)
    cfg = _cfg_with({"rope_type": type_name})
    with pytest.raises(ValueError, match=type_name):
        get_rope(cfg)
    rope = Rope("r", cfg, device="CPU")
    with pytest.raises(ValueError, match=type_name):
        rope.build(BuildContext((1, 1, cfg.channels), TRAINING))
    assert not rope.is_built


def test_register_rope_type_argument_checks() -> None:
    with pytest.raises(ValueError):
        register_rope_type("", lambda *a: None)
    with pytest.raises(ValueError, match="length_dependent"):
        register_rope_type(f"x-{uuid.uuid4().hex}", lambda *a: None, length_dependent="sometimes")
    with pytest.raises(ValueError, match="already registered"):
        register_rope_type("yarn", lambda *a: None)


# ---------------------------------------------------------------------- rope_config_from_hf


def _hf(**extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_theta": 50000.0,
        **extra,
    }


def test_from_hf_reads_the_plain_fields() -> None:
    cfg = rope_config_from_hf(_hf())
    assert (cfg.channels, cfg.n_heads, cfg.n_kv_heads, cfg.max_seq_len) == (64, 4, 2, 2048)
    assert cfg.base == 50000.0 and cfg.rotary_dim == 0 and cfg.scaling is None
    cfg = rope_config_from_hf(_hf(head_dim=32, partial_rotary_factor=0.5), max_seq_len=100)
    assert cfg.head_dim == 32 and cfg.channels == 128 and cfg.rotary_dim == 16
    assert cfg.max_seq_len == 100
    with pytest.raises(ValueError, match="hidden_size"):
        rope_config_from_hf({"num_attention_heads": 4, "max_position_embeddings": 8})


def test_from_hf_fills_what_hf_takes_from_the_model_config() -> None:
    yarn = rope_config_from_hf(_hf(rope_scaling={"type": "yarn", "factor": 4.0}), max_seq_len=8192)
    assert yarn.rope_type == "yarn"
    assert yarn.scaling["original_max_position_embeddings"] == 2048
    phi = rope_config_from_hf(
        _hf(
            original_max_position_embeddings=512,
            rope_parameters={"rope_type": "longrope", **_longrope(8), "rope_theta": 10000.0},
        )
    )
    assert phi.base == 10000.0
    assert phi.scaling["original_max_position_embeddings"] == 512
    assert phi.scaling["factor"] == pytest.approx(2048 / 512)
    dynamic = rope_config_from_hf(
        _hf(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), max_seq_len=8192
    )
    assert dynamic.scaling["original_max_position_embeddings"] == 2048
    table = get_rope(dynamic)
    for seq_len in (2048, 2049, 8192):
        np.testing.assert_allclose(
            table.frequencies(seq_len)[0], Spec.of(dynamic).frequencies(seq_len)[0], rtol=1e-13
        )


def test_scaling_dict_that_contradicts_the_config_is_refused() -> None:
    from mila_py.components import RopeConfig

    with pytest.raises(ValueError, match="rope_theta"):
        RopeConfig(
            64,
            4,
            2,
            128,
            base=10000.0,
            scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
        )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeConfig(64, 4, 2, 128, scaling={"rope_type": "default", "partial_rotary_factor": 0.5})
    ok = RopeConfig(
        64,
        4,
        2,
        128,
        base=5e5,
        rotary_dim=8,
        scaling={
            "rope_type": "linear",
            "factor": 2.0,
            "rope_theta": 5e5,
            "partial_rotary_factor": 0.5,
        },
    )
    assert ok.rotated_dim == 8
