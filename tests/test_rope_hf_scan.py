"""``rope_config_from_hf`` on families a scan of every transformers rotary module found read
wrongly or refused: keys under the family's own names (JetMoE's ``kv_channels``, Zamba2's
``attention_head_dim``, Moonshine's ``decoder_*``, Bailing-Hybrid's ``model_max_length``),
switches that turn RoPE off (ESM's and GraniteMoeHybrid's ``position_embedding_type``, Zamba2's
``use_mem_rope``), configs without ``max_position_embeddings`` (Recurrent Gemma), and
interleaved M-RoPE whose section leaves frequencies to the temporal axis (Qwen4-Exp, Cohere
Compass). The reference is each family's own config class (its defaults, ``to_dict()`` as
config.json) and rotary module, with HF's ``rotate_half`` rotation written out here.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np
import pytest
from hf_versions import skip_before_verified_transformers
from rope_helpers import make_rope, random_qk

from mila_py.components import RopeConfig
from mila_py.interop.hf_rope import rope_config_from_hf, rope_configs_from_hf_layers

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("quiet_transformers")


def _family(package: str, config_class: str, rotary: str, **kwargs: Any) -> tuple[Any, Any]:
    """``(config, rotary module)`` of a family, its config built from the class defaults."""
    models = f"transformers.models.{package}"
    if importlib.util.find_spec(models) is None:
        pytest.skip(f"this transformers has no {models}")
    config = getattr(importlib.import_module(f"{models}.configuration_{package}"), config_class)
    hf_config = config(**kwargs)
    module = importlib.import_module(f"{models}.modeling_{package}")
    return hf_config, getattr(module, rotary)(hf_config)


def _hf_rotate(
    rotary: Any, x: np.ndarray, heads: int, position_ids: Any, **kwargs: Any
) -> np.ndarray:
    """HF's rotation of ``x [1, T, H*d]``: cos/sin of the rotary module, ``rotate_half`` on the
    first ``cos.shape[-1]`` channels of every head."""
    t = torch.from_numpy(x.reshape(1, x.shape[1], heads, -1)).transpose(1, 2)  # [1, H, T, d]
    cos, sin = rotary(t, position_ids, **kwargs)
    cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    part, rest = t[..., :rot], t[..., rot:]
    half = rot // 2
    turned = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
    out = torch.cat((part * cos + turned * sin, rest), dim=-1)
    return out.transpose(1, 2).reshape(x.shape).numpy()


def _compare(cfg: RopeConfig, rotary: Any, positions: np.ndarray, **kwargs: Any) -> None:
    """mila_py's Rope and HF's rotary module turn the same Q and K alike at ``positions``
    (``[T]``, or ``[3, T]`` per M-RoPE axis)."""
    n_t = positions.shape[-1]
    q, k = random_qk(np.random.default_rng(4), cfg, 1, n_t)
    ids = torch.from_numpy(positions[..., None, :].copy())  # [1, T] or [3, 1, T]
    want_q = _hf_rotate(rotary, q, cfg.n_heads, ids, **kwargs)
    want_k = _hf_rotate(rotary, k, cfg.n_kv_heads, ids, **kwargs)
    rope = make_rope(cfg, 1, n_t)
    rope.rotate(q, k, positions[..., None, :] if positions.ndim == 2 else positions)
    # HF forms angles in float32: its error grows with the position
    atol = 5e-6 + 2e-7 * int(positions.max())
    np.testing.assert_allclose(q, want_q, rtol=0, atol=atol)
    np.testing.assert_allclose(k, want_k, rtol=0, atol=atol)


POSITIONS = np.array([0, 1, 7, 100, 250, 500])

#: id -> (package, config class, rotary class, config kwargs, rope_config_from_hf kwargs, head_dim, rotated)
CASES: dict[str, tuple[str, str, str, dict[str, Any], dict[str, Any], int, int]] = {
    "jetmoe-kv-channels": ("jetmoe", "JetMoeConfig", "JetMoeRotaryEmbedding", {}, {}, 128, 128),
    "zamba2-attention-head-dim": (
        "zamba2", "Zamba2Config", "Zamba2RotaryEmbedding", {"use_mem_rope": True}, {}, 160, 160,
    ),
    "recurrent-gemma-no-max-positions": (
        "recurrent_gemma", "RecurrentGemmaConfig", "RecurrentGemmaRotaryEmbedding", {},
        {"max_seq_len": 4096}, 256, 128,
    ),
    "esm-rotary": (
        "esm", "EsmConfig", "EsmRotaryEmbedding", {"position_embedding_type": "rotary"},
        {"max_seq_len": 4096}, 64, 64,
    ),
    "granitemoehybrid-rope": (
        "granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridRotaryEmbedding",
        {"position_embedding_type": "rope"}, {"max_seq_len": 4096}, 128, 128,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_family_keys_read_as_the_family_reads_them(case: str) -> None:
    package, config_class, rotary_class, kwargs, extra, head_dim, rotated = CASES[case]
    hf_config, rotary = _family(package, config_class, rotary_class, **kwargs)
    cfg = rope_config_from_hf(hf_config.to_dict(), **extra)
    assert (cfg.head_dim, cfg.rotated_dim) == (head_dim, rotated)
    _compare(cfg, rotary, POSITIONS)


def test_moonshine_reads_its_decoder_heads() -> None:
    """Moonshine keeps its sizes as ``decoder_num_attention_heads`` and so on (its
    ``attribute_map``); its decoder pairs (2i, 2i + 1), 32 of 36 channels per head."""
    hf_config, rotary = _family("moonshine", "MoonshineConfig", "MoonshineRotaryEmbedding")
    as_json = hf_config.to_dict()
    assert as_json.get("num_attention_heads") is None
    cfg = rope_config_from_hf(as_json)
    assert cfg.n_heads == as_json["decoder_num_attention_heads"]
    assert cfg.n_kv_heads == as_json["decoder_num_key_value_heads"]
    assert (cfg.head_dim, cfg.rotated_dim, cfg.layout) == (36, 32, "interleaved")
    got, _ = make_rope(cfg, 1, 1).table.frequencies()
    np.testing.assert_allclose(got, rotary.inv_freq.double().numpy(), rtol=2e-6)


def test_bailing_hybrid_reads_model_max_length() -> None:
    hf_config, _ = _family("bailing_hybrid", "BailingHybridConfig", "BailingHybridRotaryEmbedding")
    as_json = hf_config.to_dict()
    assert as_json.get("max_position_embeddings") is None and as_json["model_max_length"]
    assert rope_config_from_hf(as_json).max_seq_len == as_json["model_max_length"]


@pytest.mark.parametrize(
    ("package", "config_class", "key", "off"),
    [
        ("esm", "EsmConfig", "position_embedding_type", "absolute"),
        ("granitemoehybrid", "GraniteMoeHybridConfig", "position_embedding_type", None),
        ("zamba2", "Zamba2Config", "use_mem_rope", False),
    ],
)
def test_families_whose_switch_turns_rope_off(package, config_class, key, off) -> None:  # type: ignore[no-untyped-def]
    """The class default turns RoPE off (the model builds no rotary module): rope_config_from_hf says so,
    and rope_configs_from_hf_layers gives every layer None."""
    models = f"transformers.models.{package}"
    hf_config = getattr(
        importlib.import_module(f"{models}.configuration_{package}"), config_class
    )()
    as_json = hf_config.to_dict()
    assert as_json.get(key, off) == off
    with pytest.raises(ValueError, match=f"has no RoPE: {key}="):
        rope_config_from_hf(as_json)
    layers = rope_configs_from_hf_layers(as_json)
    assert layers and all(layer is None for layer in layers)


@pytest.mark.parametrize(
    ("package", "config_class", "rotary_class", "kwargs"),
    [
        ("qwen4_exp", "Qwen4ExpTextConfig", "Qwen4ExpTextRotaryEmbedding", {}),
        (
            "cohere_compass",
            "CohereCompassTextConfig",
            "CohereCompassRotaryEmbedding",
            {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
             "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
             "rope_parameters": {"full_attention": {"rope_type": "default",
                                                    "rope_theta": 10000.0}}},
        ),
    ],
    ids=["qwen4_exp-defaults", "cohere_compass"],
)  # fmt: skip
def test_interleaved_mrope_leaves_the_rest_to_the_temporal_axis(
    package: str, config_class: str, rotary_class: str, kwargs: dict[str, Any]
) -> None:
    """Qwen4-Exp's defaults rotate 128 pairs with a section of 32 (Cohere Compass: 64 with 64):
    interleaving sets only height and width frequencies, and every other one follows the
    temporal position, as the family's code does; text, image and video positions."""
    if package == "cohere_compass":
        skip_before_verified_transformers("Cohere Compass's interleaved M-RoPE sections")
    hf_config, rotary = _family(package, config_class, rotary_class, **kwargs)
    layer = {"layer_type": "full_attention"} if "layer_types" in kwargs else {}
    cfg = rope_config_from_hf(hf_config.to_dict(), **layer)
    assert cfg.mrope_interleaved and sum(cfg.mrope_section) == cfg.rotated_dim // 2
    rng = np.random.default_rng(5)
    per_axis = np.stack([np.arange(6) * 3, rng.integers(0, 40, 6), rng.integers(0, 40, 6)])
    _compare(cfg, rotary, per_axis, **layer)
    _compare(cfg, rotary, np.stack([POSITIONS] * 3), **layer)  # text: one position per axis


def test_granite_swa_rotates_each_layer_with_its_own_theta() -> None:
    """``layer_rope_theta`` gives each layer its theta, 0 for none (one rotary module per
    theta in the model's code); rope_config_from_hf without a layer cannot say which one."""
    import copy

    kinds = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    hf_config, _ = _family(
        "granite_swa", "GraniteSWAConfig", "GraniteSWARotaryEmbedding",
        num_hidden_layers=4, layer_types=kinds, layer_rope_theta=[1e4, 0, 1e6, 1e4],
    )  # fmt: skip
    layers = rope_configs_from_hf_layers(hf_config.to_dict())
    assert [None if c is None else c.base for c in layers] == [1e4, None, 1e6, 1e4]
    theta_config = copy.deepcopy(hf_config)  # as the model builds its theta-1e6 module
    theta_config.rope_parameters = {**hf_config.rope_parameters, "rope_theta": 1e6}
    module = importlib.import_module("transformers.models.granite_swa.modeling_granite_swa")
    _compare(layers[2], module.GraniteSWARotaryEmbedding(theta_config), POSITIONS)
    with pytest.raises(ValueError, match="different thetas"):
        rope_config_from_hf(hf_config.to_dict())
    same = copy.deepcopy(hf_config.to_dict())
    same["layer_rope_theta"] = [5e5] * 4
    assert rope_config_from_hf(same).base == 5e5


def test_muse_layers_without_theta_have_no_rope() -> None:
    """Muse reads ``layer_rope_theta`` as on/off only (its one rotary module has the model's
    theta): by default every 4th layer from the end, its full-attention layers, rotates
    nothing."""
    hf_config, rotary = _family(
        "muse_glimmer", "MuseGlimmerTextConfig", "MuseGlimmerTextRotaryEmbedding",
        num_hidden_layers=8,
    )  # fmt: skip
    as_json = hf_config.to_dict()
    layers = rope_configs_from_hf_layers(as_json)
    assert [c is None for c in layers] == [t == 0 for t in as_json["layer_rope_theta"]]
    sliding = rope_config_from_hf(as_json, layer_type="sliding_attention")
    _compare(sliding, rotary, POSITIONS)
    with pytest.raises(ValueError, match="rotate nothing"):
        rope_config_from_hf(as_json, layer_type="full_attention")


def test_laguna_reads_its_heads_per_layer() -> None:
    hf_config, _ = _family(
        "laguna", "LagunaConfig", "LagunaRotaryEmbedding",
        num_hidden_layers=4, num_attention_heads_per_layer=[48, 64, 48, 32],
        layer_types=["full_attention"] * 4,
    )  # fmt: skip
    layers = rope_configs_from_hf_layers(hf_config.to_dict())
    assert [c.n_heads for c in layers] == [48, 64, 48, 32]  # type: ignore[union-attr]
    assert len({id(c) for c in layers}) == 3  # equal layers share one config
