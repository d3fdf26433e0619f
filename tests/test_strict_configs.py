"""Configs are strict: a value of the wrong type, NaN or infinity, an unknown name, is an error
naming the key and the value when the config is made, never a silent conversion or fallback.

Covers RoPE scaling dicts (:class:`RopeConfig`), Hugging Face ``config.json`` fields
(:func:`rope_config_from_hf`, :func:`llama_config_from_hf`) and ``MILA_PY_CPU_BACKEND``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mila_py.components import Rope, RopeConfig
from mila_py.components.swiglu import SwiGLU, SwiGLUConfig
from mila_py.interop.hf import llama_config_from_hf
from mila_py.interop.hf_rope import rope_config_from_hf, rope_configs_from_hf_layers
from mila_py.ops.cpu import _fused_math
from mila_py.rope import scaling as _rope_scaling
from mila_py.rope.scaling import register_rope_type

NAN, INF = float("nan"), float("inf")
HQ, HK, HEAD_DIM, MAX_SEQ = 4, 2, 16, 64
N_FREQ = HEAD_DIM // 2


def _rope(scaling: Any, **fields: Any) -> RopeConfig:
    return RopeConfig(HQ * HEAD_DIM, HQ, HK, MAX_SEQ, scaling=scaling, **fields)


def _yarn(**extra: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, **extra}


def _llama3(**extra: Any) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        **extra,
    }


def _longrope(**extra: Any) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0] * N_FREQ,
        "long_factor": [2.0] * N_FREQ,
        "original_max_position_embeddings": 16,
        **extra,
    }


# ------------------------------------------------------------------------- RoPE scaling dicts


@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("make", "key"),
    [
        (_yarn, "factor"),
        (_yarn, "beta_fast"),
        (_yarn, "beta_slow"),
        (_yarn, "mscale"),
        (_yarn, "mscale_all_dim"),
        (_yarn, "attention_factor"),
        (_yarn, "original_max_position_embeddings"),
        (_llama3, "factor"),
        (_llama3, "low_freq_factor"),
        (_llama3, "high_freq_factor"),
        (_longrope, "attention_factor"),
        (_longrope, "factor"),
        (lambda **e: {"rope_type": "linear", "factor": 2.0, **e}, "factor"),
        (lambda **e: {"rope_type": "dynamic", "factor": 2.0, **_orig(), **e}, "factor"),
        (lambda **e: {"rope_type": "ntk_alpha", "alpha": 2.0, **e}, "alpha"),
        (lambda **e: {"rope_type": "default", **e}, "rope_theta"),
        (lambda **e: {"rope_type": "default", **e}, "partial_rotary_factor"),
    ],
)
def test_non_finite_scaling_values_are_refused_naming_the_key(
    make: Any, key: str, bad: float
) -> None:
    """Before, ``mscale_all_dim=nan`` made every attention output NaN, a NaN ``beta_fast`` or
    an infinite ``attention_factor`` passed the config, and NaN ``beta_fast`` failed only at
    build ("cannot convert float NaN to integer")."""
    with pytest.raises(ValueError, match=rf"{key}.*{bad!r}"):
        _rope(make(**{key: bad}))


def _orig() -> dict[str, Any]:
    return {"original_max_position_embeddings": 16}


@pytest.mark.parametrize("key", ["short_factor", "long_factor"])
@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_longrope_list_entry_names_the_entry(key: str, bad: float) -> None:
    values = [1.0] * N_FREQ
    values[3] = bad
    with pytest.raises(ValueError, match=rf"{key}\[3\].*{bad!r}"):
        _rope(_longrope(**{key: values}))


def test_non_finite_value_in_a_registered_type_is_refused(type_name: str) -> None:
    """Types that take any key are checked too: NaN is meaningless whatever the type."""
    register_rope_type(type_name, lambda hd, rd, base, n, params: (np.ones(rd // 2), 1.0))
    _rope({"rope_type": type_name, "gamma": 1.5, "table": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"gamma.*nan"):
        _rope({"rope_type": type_name, "gamma": NAN})
    with pytest.raises(ValueError, match=r"table\[1\].*inf"):
        _rope({"rope_type": type_name, "table": [1.0, INF]})


@pytest.mark.parametrize(
    ("scaling", "key"),
    [
        ({"rope_type": "default", "partial_rotary_factor": True}, "partial_rotary_factor"),
        (_longrope(long_factor=[True] * N_FREQ), "long_factor"),
        (_longrope(short_factor=[1.0] * (N_FREQ - 1) + [False]), "short_factor"),
        (_yarn(beta_fast=True), "beta_fast"),
        (_llama3(low_freq_factor=True), "low_freq_factor"),
        ({"rope_type": "linear", "factor": True}, "factor"),
        ({"rope_type": "default", "rope_theta": "10000"}, "rope_theta"),
    ],
)
def test_bools_and_strings_where_numbers_go_are_refused(scaling: dict[str, Any], key: str) -> None:
    """``partial_rotary_factor=True`` read as 1.0, ``rope_theta="10000"`` as 10000, longrope
    lists of bools as 1.0 and 0.0."""
    with pytest.raises(ValueError, match=key):
        _rope(scaling)


@pytest.mark.parametrize("bad", [4096.5, 16.0, "16"])
def test_original_max_position_embeddings_must_be_an_int(bad: Any) -> None:
    """``int()`` truncated 4096.5 to 4096 (transformers computes with 4096.5)."""
    with pytest.raises(ValueError, match=rf"original_max_position_embeddings.*{bad!r}"):
        _rope(_yarn(original_max_position_embeddings=bad))


def test_valid_scaling_values_still_pass() -> None:
    """Ints where reals go, NumPy numbers (frozen to Python ones), nulls the types read as
    absent."""
    _rope(_yarn(beta_fast=32, beta_slow=1, mscale=np.float32(1.0), mscale_all_dim=0))
    _rope(_yarn(factor=None, original_max_position_embeddings=np.int64(16)))
    _rope(_longrope(long_factor=np.arange(1, N_FREQ + 1)))
    _rope({"rope_type": "linear", "factor": 2, "rope_theta": 10000}, base=10000)


@pytest.mark.parametrize("bad", [NAN, INF, True, "1e4"])
def test_bad_base_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"base.*" + repr(bad).replace("'", ".")):
        RopeConfig(HQ * HEAD_DIM, HQ, HK, MAX_SEQ, base=bad)


# ------------------------------------------------------------------- config.json: RopeConfig


def _hf(**overrides: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        **overrides,
    }


@pytest.mark.parametrize(
    ("bad", "error"), [(NAN, ValueError), (INF, ValueError), (True, TypeError)]
)
def test_from_hf_names_a_bad_rope_theta(bad: Any, error: type[Exception]) -> None:
    """Before, the error (if any) named ``base``, a field the config does not have."""
    with pytest.raises(error, match=rf"rope_theta.*{bad!r}"):
        rope_config_from_hf(_hf(rope_theta=bad))
    with pytest.raises(error, match=rf"rope_theta.*{bad!r}"):
        rope_config_from_hf(_hf(rope_theta=None, rope_parameters={"rope_theta": bad}))


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("hidden_size", "32"),
        ("hidden_size", 32.5),
        ("hidden_size", 32.0),
        ("num_attention_heads", True),
        ("num_key_value_heads", 2.0),
        ("head_dim", "8"),
        ("max_position_embeddings", 128.9),
        ("rope_theta", "1e4"),
        ("partial_rotary_factor", "0.5"),
    ],
)
def test_from_hf_refuses_mistyped_fields(key: str, bad: Any) -> None:
    """``int()`` / ``float()`` read ``"32"``, truncated ``32.5`` and ``128.9``."""
    with pytest.raises(TypeError, match=rf"{key}.*{bad!r}"):
        rope_config_from_hf(_hf(**{key: bad}))


def test_from_hf_refuses_a_non_dict_text_config() -> None:
    """Before, a text_config that was not a dict was ignored in silence."""
    with pytest.raises(TypeError, match=r"text_config.*\['oops'\]"):
        rope_config_from_hf({"model_type": "llava", "text_config": ["oops"]})
    with pytest.raises(TypeError, match="text_config"):
        rope_config_from_hf(_hf(text_config="qwen2"))


@pytest.mark.parametrize(
    ("layer_types", "error", "pattern"),
    [
        (["full_attention", "banana"], ValueError, "'banana'"),
        ("full_attention", TypeError, "layer_types must be a list.*'full_attention'"),
        ({"0": "full_attention"}, TypeError, "layer_types must be a list"),
        (["full_attention", 3], ValueError, "unknown layer type.*3"),
    ],
)
def test_from_hf_refuses_unknown_or_malformed_layer_types(
    layer_types: Any, error: type[Exception], pattern: str
) -> None:
    """Before, a string was read one character per layer and an unknown type rotated (or, with
    per-layer-type parameters, silently did not)."""
    with pytest.raises(error, match=pattern):
        rope_config_from_hf(_hf(layer_types=layer_types))
    with pytest.raises(error, match=pattern):
        rope_configs_from_hf_layers(_hf(layer_types=layer_types))


def test_from_hf_still_reads_known_layer_types_and_numpy_ints() -> None:
    configs = rope_configs_from_hf_layers(_hf(layer_types=["full_attention", "linear_attention"]))
    assert configs[0] is not None and configs[1] is None
    cfg = rope_config_from_hf(_hf(hidden_size=np.int64(32), rope_theta=500000))
    assert cfg.channels == 32 and cfg.base == 500000.0


# ----------------------------------------------------------- config.json: llama_config_from_hf


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("hidden_size", "32"),
        ("hidden_size", 32.5),
        ("hidden_size", 32.0),
        ("num_hidden_layers", 2.7),
        ("vocab_size", True),
        ("intermediate_size", "48"),
        ("num_key_value_heads", 2.0),
        ("head_dim", 8.0),
        ("rms_norm_eps", "1e-5"),
        ("rms_norm_eps", NAN),
        ("rms_norm_eps", None),
        ("rope_theta", "1e4"),
        ("rope_theta", INF),
        ("rope_theta", False),
        ("tie_word_embeddings", "false"),
        ("attention_bias", 0),
    ],
)
def test_llama_config_refuses_mistyped_fields(key: str, bad: Any) -> None:
    """Before, ``int()``/``float()``/``bool()`` truncated or converted these (``"false"`` read
    as true), or let ``float(None)`` fail without naming the key."""
    with pytest.raises(ValueError, match=rf"{key}.*{bad!r}") as info:
        llama_config_from_hf(_hf(**{key: bad}))
    assert "llama_config_from_hf" in str(info.value)


def test_llama_config_whole_float_message_says_it_is_refused_on_purpose() -> None:
    with pytest.raises(ValueError, match=r"hidden_size.*32\.0.*even when whole"):
        llama_config_from_hf(_hf(hidden_size=32.0))


def test_llama_config_collects_every_type_problem() -> None:
    bad = {"hidden_size": "32", "num_hidden_layers": 2.7, "rms_norm_eps": "1e-5"}
    with pytest.raises(ValueError) as info:
        llama_config_from_hf(_hf(**bad, rope_theta="1e4", hidden_act="relu"))
    message = str(info.value)
    for key in (*bad, "rope_theta", "hidden_act"):
        assert key in message
    assert message.count("rope_theta") == 1  # rope_config_from_hf is not asked again


@pytest.mark.parametrize(
    ("model_type", "fields", "key"),
    [
        ("mistral", {"sliding_window": 4096.0}, "sliding_window"),
        ("qwen2", {"use_sliding_window": "false"}, "use_sliding_window"),
        ("qwen2", {"use_sliding_window": True, "max_window_layers": "1"}, "max_window_layers"),
    ],
)
def test_llama_config_refuses_mistyped_sliding_window_keys(
    model_type: str, fields: dict[str, Any], key: str
) -> None:
    """Before, ``bool("false")`` turned Qwen's window on and ``int()`` read the others."""
    with pytest.raises(ValueError, match=rf"{key} must be"):
        llama_config_from_hf(_hf(model_type=model_type, max_position_embeddings=16, **fields))


@pytest.mark.parametrize(
    ("layer_types", "pattern"),
    [
        (["full_attention", "banana"], "unknown layer type.*'banana'"),
        ("full_attention", "layer_types must be a list.*'full_attention'"),
        (7, "layer_types must be a list.*7"),
        (["full_attention"] * 3, "3 entries for num_hidden_layers=2"),
    ],
)
def test_llama_config_refuses_unknown_or_malformed_layer_types(
    layer_types: Any, pattern: str
) -> None:
    """Before, ``"banana"`` got the sliding-attention message, a string was read one character
    per layer, an int raised a bare TypeError and a list of the wrong length passed."""
    with pytest.raises(ValueError, match=pattern):
        llama_config_from_hf(_hf(layer_types=layer_types))


def test_llama_config_keeps_the_known_layer_type_messages() -> None:
    with pytest.raises(ValueError, match="only full_attention is supported"):
        llama_config_from_hf(_hf(layer_types=["full_attention", "sliding_attention"]))
    cfg = llama_config_from_hf(_hf(layer_types=["full_attention"] * 2))
    assert cfg.n_layers == 2
    with pytest.raises(ValueError, match="unknown layer type"):  # Mistral ignores the list
        llama_config_from_hf(_hf(model_type="mistral", layer_types=["banana"], sliding_window=None))


def test_llama_config_refuses_a_non_dict_text_config() -> None:
    with pytest.raises(ValueError, match=r"text_config must be a dict.*'x'"):
        llama_config_from_hf(_hf(text_config="x"))


def test_llama_config_still_reads_valid_types() -> None:
    cfg = llama_config_from_hf(
        _hf(rope_theta=500000, rms_norm_eps=1e-6, tie_word_embeddings=True, head_dim=None)
    )
    assert cfg.rope_base == 500000.0 and cfg.norm_eps == 1e-6 and cfg.tie_embeddings
    assert llama_config_from_hf(_hf(num_key_value_heads=None)).n_kv_heads == 4


def test_llama_config_refuses_nan_in_the_scaling_dict() -> None:
    params = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "mscale_all_dim": NAN}
    with pytest.raises(ValueError, match=r"mscale_all_dim.*nan"):
        llama_config_from_hf(_hf(rope_theta=None, rope_parameters=params))


# ------------------------------------------------------------------------- MILA_PY_CPU_BACKEND


def test_bogus_cpu_backend_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, an unknown value fell back to ``auto`` in silence."""
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", "bogus")
    pattern = "MILA_PY_CPU_BACKEND='bogus'.*auto, numpy, fused"
    with pytest.raises(ValueError, match=pattern):
        _fused_math.cpu_backend()
    with pytest.raises(ValueError, match=pattern):
        _fused_math.backend_allows()
    cfg = _rope(None)
    with pytest.raises(ValueError, match=pattern):
        Rope("rope", cfg, device="CPU")  # CpuRopeOp reads it when made
    with pytest.raises(ValueError, match=pattern):
        _fused_math.enabled(np.float32)  # the fused layer ops' switch


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", "auto"), ("auto", "auto"), (" NumPy ", "numpy"), ("FUSED", "fused")],
)
def test_cpu_backend_values(monkeypatch: pytest.MonkeyPatch, value: str, expected: str) -> None:
    monkeypatch.setenv("MILA_PY_CPU_BACKEND", value)
    assert _fused_math.cpu_backend() == expected
    assert _fused_math.backend_allows() == (expected != "numpy" and _fused_math.AVAILABLE)
    if expected != "fused" or _fused_math.AVAILABLE:
        rope = Rope("rope", _rope(None), device="CPU")
        assert rope.op.backend == expected
    SwiGLU("mlp", SwiGLUConfig(8, 16), device="CPU")


def test_cpu_backend_unset_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MILA_PY_CPU_BACKEND", raising=False)
    assert _fused_math.cpu_backend() == "auto"


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def type_name() -> Iterator[str]:
    """A unique rope_type name, unregistered again after the test."""
    name = f"strict-{uuid.uuid4().hex[:12]}"
    yield name
    _rope_scaling._TYPES.pop(name, None)
