"""RoPE per layer type and per layer: ``rope_config_from_hf(layer_type=...)`` and ``rope_configs_from_hf_layers``.

Models such as Gemma 3 rotate their sliding-window layers and their full-attention layers with
different parameters. Each case is a ``config.json`` dict as it lies on disk (transformers 4.x
flat keys, or the 5.x per-layer-type ``rope_parameters``); transformers' own config class and
rotary module of that model give the reference: its cos/sin rotate Q and K as HF's
``apply_rotary_pos_emb`` does, and mila_py's Rope must rotate them the same. Config-only
checks (layer patterns, errors) run without transformers.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from hf_versions import skip_unless_transformers_has
from rope_helpers import make_rope, random_qk

from mila_py.interop.hf_rope import rope_config_from_hf, rope_configs_from_hf_layers

SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 6,
    "max_position_embeddings": 256,
}
FULL, SLIDING = "full_attention", "sliding_attention"

#: name -> (transformers config class, modeling module, config.json dict)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3-legacy": (
        "Gemma3TextConfig",
        "gemma3",
        {
            **SMALL,
            "model_type": "gemma3_text",
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window_pattern": 3,
        },
    ),
    "gemma3-nested": (
        "Gemma3TextConfig",
        "gemma3",
        {
            **SMALL,
            "model_type": "gemma3_text",
            "rope_parameters": {
                FULL: {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 1e6,
                    "original_max_position_embeddings": 64,
                },
                SLIDING: {"rope_type": "default", "rope_theta": 2e4},
            },
            "layer_types": [SLIDING, FULL, SLIDING, SLIDING, FULL, FULL],
        },
    ),
    "gemma3n-legacy": (
        "Gemma3nTextConfig",
        "gemma3n",
        {**SMALL, "model_type": "gemma3n_text", "rope_theta": 5e5, "rope_local_base_freq": 2e4},
    ),
    "modernbert-legacy": (
        "ModernBertConfig",
        "modernbert",
        {
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 6,
            "max_position_embeddings": 256,
            "model_type": "modernbert",
            "global_rope_theta": 160000.0,
            "local_rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "global_attn_every_n_layers": 2,
        },
    ),
    "olmo3-legacy": (
        "Olmo3Config",
        "olmo3",
        {
            **SMALL,
            "model_type": "olmo3",
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "gemma4-legacy": (
        "Gemma4TextConfig",
        "gemma4",
        {**SMALL, "model_type": "gemma4_text", "global_head_dim": 32},
    ),
    "mimo-v2-flash": (
        "MiMoV2FlashConfig",
        "mimo_v2_flash",
        {**SMALL, "model_type": "mimo_v2_flash", "head_dim": 24, "hidden_size": 96},
    ),
    # convolution layers between them; its full layers rotate half the head, proportionally
    "lfm3": ("Lfm3Config", "lfm3", {**SMALL, "model_type": "lfm3", "num_hidden_layers": 8}),
}
POSITIONS = np.arange(90, 122)  # past the YaRN cases' original 64


@pytest.fixture
def hf() -> Any:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield transformers
    logger.setLevel(level)


def _hf_config(transformers: Any, case: str) -> Any:
    cls_name, _, config_json = CASES[case]
    kwargs = {k: v for k, v in config_json.items() if k != "model_type"}
    skip_unless_transformers_has(config_json["model_type"])
    return getattr(transformers, cls_name)(**kwargs)


def _hf_rotary(transformers: Any, case: str, hf_config: Any) -> Any:
    import importlib

    module = importlib.import_module(
        f"transformers.models.{CASES[case][1]}.modeling_{CASES[case][1]}"
    )
    (cls,) = [
        getattr(module, n)
        for n in dir(module)
        if n.endswith("RotaryEmbedding") and "Vision" not in n and "Audio" not in n
    ]
    return cls(hf_config)


def _hf_rotate(emb: Any, layer_type: str, x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """HF's rotation of ``x [1, T, heads*head_dim]`` at POSITIONS: cos/sin from the model's
    rotary module for ``layer_type``, rotate_half over the first ``cos.shape[-1]`` channels."""
    import torch

    tokens = x.shape[1]
    t = torch.from_numpy(x.reshape(1, tokens, heads, head_dim)).transpose(1, 2)
    cos, sin = emb(t, torch.from_numpy(POSITIONS[None]), layer_type)
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    head, rest = t[..., :rot], t[..., rot:]
    half = torch.cat((-head[..., rot // 2 :], head[..., : rot // 2]), dim=-1)
    out = torch.cat((head * cos + half * sin, rest), dim=-1)
    return out.transpose(1, 2).reshape(1, tokens, -1).numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_type_rotates_as_the_models_own_rotary_module(hf: Any, case: str) -> None:
    hf_config = _hf_config(hf, case)
    emb = _hf_rotary(hf, case, hf_config)
    config_json = CASES[case][2]
    layers = rope_configs_from_hf_layers(config_json, max_seq_len=256)
    assert len(layers) == hf_config.num_hidden_layers
    rng = np.random.default_rng(11)
    for layer_type in sorted(set(hf_config.layer_types)):
        index = list(hf_config.layer_types).index(layer_type)
        if layer_type == "conv":  # LFM3's convolution layers
            assert layers[index] is None
            continue
        cfg = rope_config_from_hf(config_json, layer_type=layer_type, max_seq_len=256)
        assert layers[index] == cfg
        q, k = random_qk(rng, cfg, 1, len(POSITIONS))
        want_q = _hf_rotate(emb, layer_type, q, cfg.n_heads, cfg.head_dim)
        want_k = _hf_rotate(emb, layer_type, k, cfg.n_kv_heads, cfg.head_dim)
        rope = make_rope(cfg, 1, len(POSITIONS))
        rope.rotate(q, k, POSITIONS)
        atol = 5e-6 + 2e-7 * int(POSITIONS.max()) * rope.attention_scaling
        np.testing.assert_allclose(q, want_q, rtol=0, atol=atol, err_msg=layer_type)
        np.testing.assert_allclose(k, want_k, rtol=0, atol=atol, err_msg=layer_type)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_pattern_matches_the_config_class(hf: Any, case: str) -> None:
    """Without ``layer_types`` the family's default pattern gives each layer its type."""
    hf_config = _hf_config(hf, case)
    config_json = CASES[case][2]
    layers = rope_configs_from_hf_layers(config_json, max_seq_len=256)
    by_type = {
        t: None if t == "conv" else rope_config_from_hf(config_json, layer_type=t, max_seq_len=256)
        for t in set(hf_config.layer_types)
    }
    assert layers == [by_type[t] for t in hf_config.layer_types]
    # layers that resolve alike share one config object (one table through get_rope)
    assert len({id(c) for c in layers}) == len(by_type)


def test_gemma3_legacy_keys_per_layer_type() -> None:
    config_json = CASES["gemma3-legacy"][2]
    full = rope_config_from_hf(config_json, layer_type=FULL)
    sliding = rope_config_from_hf(config_json, layer_type=SLIDING)
    assert (full.base, full.rope_type, full.scaling["factor"]) == (1e6, "linear", 8.0)
    assert (sliding.base, sliding.scaling) == (1e4, None)
    types = [FULL if c == full else SLIDING for c in rope_configs_from_hf_layers(config_json)]
    assert types == [SLIDING, SLIDING, FULL] * 2  # sliding_window_pattern 3
    # the multimodal wrapper reads its text_config the same way
    wrapped = {"model_type": "gemma3", "text_config": config_json}
    assert rope_config_from_hf(wrapped, layer_type=FULL) == full


def test_missing_legacy_keys_take_the_family_defaults() -> None:
    bare = {k: v for k, v in SMALL.items()}
    gemma3 = {**bare, "model_type": "gemma3_text"}
    assert rope_config_from_hf(gemma3, layer_type=FULL).base == 1e6
    assert rope_config_from_hf(gemma3, layer_type=SLIDING).base == 1e4
    modernbert = {**bare, "model_type": "modernbert"}
    assert rope_config_from_hf(modernbert, layer_type=FULL).base == 160000.0
    # ModernBERT's flat rope_scaling reaches both layer types; Gemma 3's only the full ones
    scaled = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    assert rope_config_from_hf({**modernbert, **scaled}, layer_type=SLIDING).rope_type == "linear"
    assert rope_config_from_hf({**gemma3, **scaled}, layer_type=SLIDING).rope_type == "default"


def test_gemma4_full_layers_are_wider_and_proportional() -> None:
    legacy = CASES["gemma4-legacy"][2]
    full = rope_config_from_hf(legacy, layer_type=FULL)
    sliding = rope_config_from_hf(legacy, layer_type=SLIDING)
    assert (full.head_dim, full.rope_type, full.rotated_dim, full.base) == (
        32,
        "proportional",
        8,
        1e6,
    )
    assert (sliding.head_dim, sliding.rope_type, sliding.base) == (16, "default", 1e4)
    layers = rope_configs_from_hf_layers(legacy)
    assert [c.head_dim for c in layers] == [16] * 5 + [32]
    seven = rope_configs_from_hf_layers({**legacy, "num_hidden_layers": 7})
    assert [c.head_dim for c in seven] == [16] * 5 + [32, 32]  # the last layer is always full
    # transformers 5.x writes the same model with per_layer_config and nested rope_parameters
    written = {
        **SMALL,
        "model_type": "gemma4_text",
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
        "layer_types": [SLIDING] * 5 + [FULL],
        "per_layer_config": {"5": {"head_dim": 32}},
    }
    assert rope_configs_from_hf_layers(written) == layers
    assert rope_config_from_hf(written, layer_type=FULL) == full


def test_gemma4_global_kv_heads_only_with_k_eq_v() -> None:
    legacy = {**CASES["gemma4-legacy"][2], "num_global_key_value_heads": 1}
    assert rope_config_from_hf(legacy, layer_type=FULL).n_kv_heads == 2
    k_eq_v = {**legacy, "attention_k_eq_v": True}
    assert rope_config_from_hf(k_eq_v, layer_type=FULL).n_kv_heads == 1
    assert rope_config_from_hf(k_eq_v, layer_type=SLIDING).n_kv_heads == 2


@pytest.mark.parametrize("model_type", ["smollm3", "llama4_text"])
def test_no_rope_layers_rotate_nothing(model_type: str) -> None:
    config_json = {**SMALL, "num_hidden_layers": 8, "model_type": model_type, "rope_theta": 2e6}
    layers = rope_configs_from_hf_layers(config_json)
    assert [c is not None for c in layers] == [True, True, True, False] * 2  # HF's default
    explicit = {**config_json, "no_rope_layers": [0, 1, 1, 1, 1, 1, 1, 0]}
    layers = rope_configs_from_hf_layers(explicit)
    assert [c is not None for c in layers] == [False] + [True] * 6 + [False]
    assert layers[1] == rope_config_from_hf(explicit)
    # a model that does not read no_rope_layers rotates every layer
    assert None not in rope_configs_from_hf_layers({**explicit, "model_type": "llama"})


def test_no_rope_layers_match_hf_defaults(hf: Any) -> None:
    for cls_name, model_type in (("SmolLM3Config", "smollm3"), ("Llama4TextConfig", "llama4_text")):
        hf_config = getattr(hf, cls_name)(**{**SMALL, "num_hidden_layers": 12})
        config_json = {**SMALL, "num_hidden_layers": 12, "model_type": model_type}
        layers = rope_configs_from_hf_layers(config_json)
        assert [int(c is not None) for c in layers] == list(hf_config.no_rope_layers)


def test_null_or_missing_layer_type_entry_rotates_nothing() -> None:
    config_json = {
        **SMALL,
        "model_type": "some_hybrid",
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 1e4}, FULL: None},
        "layer_types": [SLIDING, FULL, "conv", SLIDING, FULL, SLIDING],
    }
    layers = rope_configs_from_hf_layers(config_json)
    assert [c is not None for c in layers] == [True, False, False, True, False, True]
    assert layers[0] == rope_config_from_hf(config_json, layer_type=SLIDING)
    with pytest.raises(ValueError, match="rotates nothing"):
        rope_config_from_hf(config_json, layer_type=FULL)
    with pytest.raises(ValueError, match=r"no RoPE parameters for layer_type 'conv'"):
        rope_config_from_hf(config_json, layer_type="conv")


def test_per_layer_type_config_needs_a_layer_type() -> None:
    config_json = CASES["gemma3-nested"][2]
    with pytest.raises(ValueError, match=r"own RoPE \(full_attention, sliding_attention\)"):
        rope_config_from_hf(config_json)
    unknown = {**config_json, "model_type": None}  # no family: the nested dict alone decides
    with pytest.raises(ValueError, match="pass layer_type"):
        rope_config_from_hf(unknown)
    assert rope_config_from_hf(unknown, layer_type=FULL) == rope_config_from_hf(
        config_json, layer_type=FULL
    )


def test_flat_config_gives_every_layer_type_the_same_rope() -> None:
    config_json = {
        **SMALL,
        "model_type": "qwen2",
        "rope_theta": 1e6,
        "layer_types": [FULL, SLIDING] * 3,
    }
    plain = rope_config_from_hf(config_json)
    assert rope_config_from_hf(config_json, layer_type=SLIDING) == plain
    assert rope_configs_from_hf_layers(config_json) == [plain] * 6
    with pytest.raises(ValueError, match=r"'chunked_attention' is not in the config's layer_types"):
        rope_config_from_hf(config_json, layer_type="chunked_attention")


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_types has 2 entries for 6 num_hidden_layers"):
        rope_configs_from_hf_layers({**SMALL, "layer_types": [FULL, FULL]})
    with pytest.raises(ValueError, match="no 'num_hidden_layers'"):
        rope_configs_from_hf_layers({k: v for k, v in SMALL.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="must be a dict per layer type"):
        rope_config_from_hf(
            {**SMALL, "model_type": "gemma3_text", "rope_parameters": {"rope_type": "default"}},
            layer_type=FULL,
        )
    with pytest.raises(TypeError, match="config must be a dict"):
        rope_configs_from_hf_layers([("hidden_size", 64)])  # type: ignore[arg-type]
    # Gemma 4 layers of one type whose per_layer_config differs cannot share one config
    uneven = {
        **CASES["gemma4-legacy"][2],
        "layer_types": [SLIDING, FULL, SLIDING, FULL, SLIDING, FULL],
        "per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 64}},
    }
    with pytest.raises(ValueError, match="differ in head sizes"):
        rope_config_from_hf(uneven, layer_type=FULL)
    assert [c.head_dim for c in rope_configs_from_hf_layers(uneven)] == [16, 32, 16, 64, 16, 16]


def test_gemma4_per_layer_config_as_transformers_writes_it(hf: Any) -> None:
    """transformers 5.x writes per_layer_config keys zero-padded ("05")."""
    hf_config = hf.Gemma4TextConfig(
        **{**SMALL, "num_hidden_layers": 12, "global_head_dim": 32, "attention_k_eq_v": True,
           "num_global_key_value_heads": 1}
    )  # fmt: skip
    written = hf_config.to_dict()
    assert any(len(k) == 2 and k.startswith("0") for k in written["per_layer_config"])
    layers = rope_configs_from_hf_layers(written)
    want = [
        (hf_config.per_layer_config[i].head_dim, hf_config.per_layer_config[i].num_key_value_heads)
        for i in range(12)
    ]
    assert [(c.head_dim, c.n_kv_heads) for c in layers] == want
    assert rope_config_from_hf(written, layer_type=FULL) == layers[5]


def test_gemma4_defaults_and_refusals() -> None:
    bare = {**SMALL, "model_type": "gemma4_text"}
    assert rope_config_from_hf(bare, layer_type=FULL).head_dim == 512  # global_head_dim default
    padded = {**bare, "layer_types": [SLIDING] * 6, "per_layer_config": {"05": {"head_dim": 64,
              "num_attention_heads": 2}}}  # fmt: skip
    last = rope_configs_from_hf_layers(padded)[5]
    assert (last.head_dim, last.n_heads, last.base) == (64, 2, 1e6)  # forced to full attention
    with pytest.raises(ValueError, match="reads no flat rope_scaling"):
        rope_config_from_hf({**bare, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                           layer_type=FULL)  # fmt: skip


def test_mimo_sliding_layers_have_twice_the_key_heads() -> None:
    config_json = CASES["mimo-v2-flash"][2]
    full = rope_config_from_hf(config_json, layer_type=FULL)
    sliding = rope_config_from_hf(config_json, layer_type=SLIDING)
    assert (full.n_kv_heads, sliding.n_kv_heads) == (2, 4)
    # an entry without partial_rotary_factor takes the model code's 0.334
    nested = {**config_json, "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 5e6},
              SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
    assert rope_config_from_hf(nested, layer_type=FULL).rotated_dim == 8


def test_gemma3_flat_scaling_over_nested_parameters_and_null_entries() -> None:
    nested = {FULL: {"rope_type": "default", "rope_theta": 1e6}, SLIDING: None}
    config_json = {**SMALL, "model_type": "gemma3_text", "rope_parameters": nested,
                   "rope_scaling": {"type": "linear", "factor": 8.0}}  # fmt: skip
    full = rope_config_from_hf(config_json, layer_type=FULL)
    assert (full.rope_type, full.scaling["factor"], full.base) == ("linear", 8.0, 1e6)
    sliding = rope_config_from_hf(config_json, layer_type=SLIDING)  # null: the default RoPE
    assert (sliding.rope_type, sliding.base) == ("default", 1e4)
    modernbert = {**SMALL, "model_type": "modernbert", "rope_scaling": {"type": "linear",
                  "factor": 2.0}}  # fmt: skip
    assert rope_config_from_hf(modernbert, layer_type=SLIDING).rope_type == "linear"
    assert [c.base for c in rope_configs_from_hf_layers(modernbert)] == [160000.0, 1e4, 1e4] * 2


def test_olmo3_layers_share_the_checkpoint_theta() -> None:
    config_json = {**SMALL, "model_type": "olmo3", "rope_theta": 1e5, "num_hidden_layers": 8}
    layers = rope_configs_from_hf_layers(config_json)
    assert {c.base for c in layers} == {1e5}
    assert [c.scaling is None for c in layers] == [True] * 8


def test_nested_parameters_need_layer_types() -> None:
    config_json = {**CASES["gemma3-nested"][2], "model_type": "some_model"}
    del config_json["layer_types"]
    with pytest.raises(ValueError, match="no layer_types to say which layer is which"):
        rope_configs_from_hf_layers(config_json)


def test_no_rope_families_without_layer_types() -> None:
    llama4 = {**SMALL, "model_type": "llama4_text", "num_hidden_layers": 8}
    with pytest.raises(ValueError, match="full_attention layers of this llama4_text model rotate"):
        rope_config_from_hf(llama4, layer_type=FULL)
    assert rope_config_from_hf(llama4, layer_type="chunked_attention") == rope_config_from_hf(
        llama4
    )
    with pytest.raises(ValueError, match="'sliding_attention' is not in the config's layer_types"):
        rope_config_from_hf(llama4, layer_type=SLIDING)
    smollm3 = {**SMALL, "model_type": "smollm3", "num_hidden_layers": 8,
               "use_sliding_window": True, "sliding_window": 64}  # fmt: skip
    assert rope_config_from_hf(smollm3, layer_type=FULL) == rope_config_from_hf(smollm3)
    with pytest.raises(ValueError, match="rotate nothing"):
        rope_config_from_hf(smollm3, layer_type=SLIDING)  # its NoPE layers slide
    large = {**SMALL, "model_type": "mistral_large4_text", "qk_rope_head_dim": 8}
    assert [c is not None for c in rope_configs_from_hf_layers(large)] == [True] * 3 + [False] + [
        True
    ] * 2


def test_gemma3_hub_text_config_leaves_out_class_defaults(hf: Any) -> None:
    """google/gemma-3-4b-it's config.json: the text_config gives only what differs from
    Gemma3TextConfig's defaults."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}  # fmt: skip
    config_json = {"model_type": "gemma3", "text_config": text}
    hf_text = hf.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    for layer_type in (FULL, SLIDING):
        cfg = rope_config_from_hf(config_json, layer_type=layer_type, max_seq_len=64)
        params = hf_text.rope_parameters[layer_type]
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.base) == (
            hf_text.num_attention_heads,
            hf_text.num_key_value_heads,
            hf_text.head_dim,
            params["rope_theta"],
        )
        assert cfg.rope_type == params["rope_type"]
    layers = rope_configs_from_hf_layers(config_json, max_seq_len=64)
    assert [c.base for c in layers] == [
        hf_text.rope_parameters[t]["rope_theta"] for t in hf_text.layer_types
    ]
    assert rope_config_from_hf(text, layer_type=FULL).max_seq_len == 131072
