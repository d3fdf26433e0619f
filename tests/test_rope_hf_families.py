"""``rope_config_from_hf`` across model families: pair layout, partial rotary keys, latent attention.

Each case is a ``config.json`` dict as it lies on disk, often with the transformers 4.x keys
(GPT-NeoX's ``rotary_pct``, GPT-J's ``rotary_dim``); the reference is that model's own
transformers code: its config class, its rotary module and its apply function, on the q/k layout
of its own projections. mila_py's Rope, configured by ``rope_config_from_hf`` alone (layout included), must
rotate the same Q and K to the same values. Config-only checks run without transformers.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import numpy as np
import pytest
from hf_versions import skip_before_verified_transformers, skip_unless_transformers_has
from rope_helpers import make_rope, random_qk

from mila_py.components import RopeConfig, RopeLayout
from mila_py.interop.hf_rope import rope_config_from_hf, rope_configs_from_hf_layers

BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
}
HALF, PAIRS = RopeLayout.HALF, RopeLayout.INTERLEAVED
NTK_ALPHA = {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}  # as HunYuan-7B's config.json

#: name -> (config class, modeling module, config.json, expected layout, rotated channels)
CASES: dict[str, tuple[str, str, dict[str, Any], RopeLayout, int]] = {
    "cohere": ("CohereConfig", "cohere", {"model_type": "cohere"}, PAIRS, 16),
    "helium": ("HeliumConfig", "helium", {"model_type": "helium", "head_dim": 16}, PAIRS, 16),
    "glm": ("GlmConfig", "glm", {"model_type": "glm", "head_dim": 16}, PAIRS, 8),
    "glm4": ("Glm4Config", "glm4", {"model_type": "glm4", "head_dim": 16}, PAIRS, 8),
    "ernie4_5": (
        "Ernie4_5Config",
        "ernie4_5",
        {"model_type": "ernie4_5", "head_dim": 16},
        PAIRS,
        16,
    ),
    "stablelm": ("StableLmConfig", "stablelm", {"model_type": "stablelm"}, HALF, 4),
    "phi": ("PhiConfig", "phi", {"model_type": "phi"}, HALF, 8),
    "persimmon": ("PersimmonConfig", "persimmon", {"model_type": "persimmon"}, HALF, 8),
    "gpt_neox": (
        "GPTNeoXConfig",
        "gpt_neox",
        {
            "model_type": "gpt_neox",
            "rotary_pct": 0.5,
            "rotary_emb_base": 20000.0,
            "rope_theta": None,
        },
        HALF,
        8,
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "minimax_m2",
        {"model_type": "minimax_m2", "head_dim": 16, "rotary_dim": 8},
        HALF,
        8,
    ),
    "glm4_moe": ("Glm4MoeConfig", "glm4_moe", {"model_type": "glm4_moe", "head_dim": 16}, HALF, 8),
    # HunYuan's "dynamic" with an alpha is fixed NTK scaling: the base times alpha^(d / (d - 2))
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        "hunyuan_v1_dense",
        {"model_type": "hunyuan_v1_dense", "head_dim": 16, "rope_scaling": NTK_ALPHA},
        HALF,
        16,
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "hunyuan_v1_moe",
        {"model_type": "hunyuan_v1_moe", "head_dim": 16, "rope_scaling": NTK_ALPHA},
        HALF,
        16,
    ),
}

#: cases an older transformers rotates otherwise: case -> what changed
BEHAVIOUR_SINCE_VERIFIED = {
    "minimax_m2": "MiniMax-M2's rotary_dim (transformers 5.17 rotated the whole head)",
}
MLA = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16}
#: multi-head latent attention: the RoPE part of each head, one shared key head
MLA_CASES: dict[str, tuple[str, str, dict[str, Any], RopeLayout]] = {
    "deepseek_v3": (
        "DeepseekV3Config",
        "deepseek_v3",
        {
            "model_type": "deepseek_v3",
            **MLA,
            "qk_rope_head_dim": 8,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
        PAIRS,
    ),
    "deepseek_v3-half": (
        "DeepseekV3Config",
        "deepseek_v3",
        {"model_type": "deepseek_v3", **MLA, "qk_rope_head_dim": 8, "rope_interleave": False},
        HALF,
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "deepseek_v2",
        {"model_type": "deepseek_v2", **MLA, "qk_rope_head_dim": 8},
        PAIRS,
    ),
    "minicpm3": (
        "MiniCPM3Config",
        "minicpm3",
        {"model_type": "minicpm3", **MLA, "qk_rope_head_dim": 8, "q_lora_rank": 32},
        HALF,
    ),
}
POSITIONS = np.arange(40, 72)  # past YaRN's original 64 for half of them


@pytest.fixture
def torch() -> Any:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield torch
    logger.setLevel(level)


def _config(cls_name: str, config_json: dict[str, Any]) -> Any:
    import transformers

    kwargs = {k: v for k, v in config_json.items() if k != "model_type" and v is not None}
    return getattr(transformers, cls_name)(**{**BASE, **kwargs})


def _module(name: str) -> Any:
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _rotary(module: Any, hf_config: Any) -> Any:
    (cls,) = [
        getattr(module, n)
        for n in dir(module)
        if n.endswith("RotaryEmbedding") and not n.startswith(("Vision", "Audio"))
        and "Vision" not in n and "Audio" not in n
    ]  # fmt: skip
    return cls(hf_config)


def _heads(torch: Any, x: np.ndarray, heads: int) -> Any:
    """``[1, T, H*d]`` -> torch ``[1, H, T, d]``."""
    return torch.from_numpy(x.reshape(1, x.shape[1], heads, -1)).transpose(1, 2)


def _flat(t: Any) -> np.ndarray:
    return t.transpose(1, 2).reshape(1, t.shape[2], -1).numpy()


def _ours(cfg: RopeConfig, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q, k = q.copy(), k.copy()
    make_rope(cfg, 1, len(POSITIONS)).rotate(q, k, POSITIONS)
    return q, k


@pytest.mark.parametrize("case", list(CASES))
def test_family_rotates_as_its_own_code(torch: Any, case: str) -> None:
    cls_name, module_name, config_json, layout, rotated = CASES[case]
    if case in BEHAVIOUR_SINCE_VERIFIED:
        skip_before_verified_transformers(BEHAVIOUR_SINCE_VERIFIED[case])
    cfg = rope_config_from_hf({**BASE, **config_json})
    assert (cfg.layout, cfg.rotated_dim) == (layout, rotated)
    hf_config = _config(cls_name, config_json)
    module = _module(module_name)
    q, k = random_qk(np.random.default_rng(2), cfg, 1, len(POSITIONS))
    tq, tk = _heads(torch, q, cfg.n_heads), _heads(torch, k, cfg.n_kv_heads)
    cos, sin = _rotary(module, hf_config)(tq, torch.from_numpy(POSITIONS[None]))
    rot = cos.shape[-1]
    assert rot == rotated
    rq, rk = module.apply_rotary_pos_emb(tq[..., :rot], tk[..., :rot], cos, sin)
    want_q = _flat(torch.cat((rq, tq[..., rot:]), dim=-1))
    want_k = _flat(torch.cat((rk, tk[..., rot:]), dim=-1))
    got_q, got_k = _ours(cfg, q, k)
    np.testing.assert_allclose(got_q, want_q, rtol=0, atol=3e-5)
    np.testing.assert_allclose(got_k, want_k, rtol=0, atol=3e-5)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_latent_attention_rope_head(torch: Any, case: str) -> None:
    """MLA rotates a separate ``qk_rope_head_dim`` part of each query head and one key head;
    HF's ``apply_rotary_pos_emb_interleave`` reads pairs (2i, 2i + 1) and writes them in half
    order, the same dot products as mila_py's in-place pairs."""
    cls_name, module_name, config_json, layout = MLA_CASES[case]
    cfg = rope_config_from_hf({**BASE, **config_json})
    assert (cfg.layout, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads) == (layout, 8, 4, 1)
    hf_config = _config(cls_name, config_json)
    module = _module(module_name)
    q, k = random_qk(np.random.default_rng(4), cfg, 1, len(POSITIONS))
    tq, tk = _heads(torch, q, 4), _heads(torch, k, 1)
    emb = _rotary(module, hf_config)
    position_ids = torch.from_numpy(POSITIONS[None])
    got_q, got_k = _ours(cfg, q, k)
    if module_name == "deepseek_v2":  # complex multiplication on (2i, 2i + 1)
        freqs_cis = emb(tq, position_ids)
        rq, rk = module.apply_rotary_emb(tq, tk, freqs_cis)
    else:
        cos, sin = emb(tq, position_ids)
        apply = (
            module.apply_rotary_pos_emb_interleave
            if getattr(hf_config, "rope_interleave", False)
            else module.apply_rotary_pos_emb
        )
        rq, rk = apply(tq, tk, cos, sin)
        if apply is not module.apply_rotary_pos_emb:  # back to the pairs' own places
            order = np.argsort(np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)]))
            rq, rk = rq[..., order], rk[..., order]
    atol = 3e-5 * max(1.0, make_rope(cfg, 1, 1).attention_scaling)
    np.testing.assert_allclose(got_q, _flat(rq), rtol=0, atol=atol)
    np.testing.assert_allclose(got_k, _flat(rk), rtol=0, atol=atol)


def test_llama4_pairs_as_complex_numbers(torch: Any) -> None:
    config_json = {"model_type": "llama4_text", "head_dim": 16, "rope_theta": 500000.0}
    cfg = rope_config_from_hf({**BASE, **config_json})
    assert cfg.layout == PAIRS
    hf_config = _config("Llama4TextConfig", config_json)
    module = _module("llama4")
    q, k = random_qk(np.random.default_rng(6), cfg, 1, len(POSITIONS))
    tq = torch.from_numpy(q.reshape(1, len(POSITIONS), 4, 16))
    tk = torch.from_numpy(k.reshape(1, len(POSITIONS), 2, 16))
    freqs_cis = _rotary(module, hf_config)(tq, torch.from_numpy(POSITIONS[None]))
    rq, rk = module.apply_rotary_emb(tq, tk, freqs_cis)
    got_q, got_k = _ours(cfg, q, k)
    np.testing.assert_allclose(got_q, rq.reshape(1, len(POSITIONS), -1).numpy(), atol=3e-5)
    np.testing.assert_allclose(got_k, rk.reshape(1, len(POSITIONS), -1).numpy(), atol=3e-5)


@pytest.mark.parametrize("module_name", ["gptj", "codegen"])
def test_gptj_rotary_dim_every_two(torch: Any, module_name: str) -> None:
    """GPT-J and CodeGen rotate the first ``rotary_dim`` channels, pairs (2i, 2i + 1)."""
    config_json = {"model_type": module_name, "n_embd": 64, "n_head": 4, "rotary_dim": 8}
    flat = {**BASE, **config_json, "num_key_value_heads": 4}
    cfg = rope_config_from_hf(flat)
    assert (cfg.layout, cfg.rotated_dim, cfg.head_dim) == (PAIRS, 8, 16)
    module = _module(module_name)
    q, k = random_qk(np.random.default_rng(8), cfg, 1, len(POSITIONS))
    table = module.create_sinusoidal_positions(256, 8)[torch.from_numpy(POSITIONS)][None]
    sin, cos = torch.split(table, 4, dim=-1)

    def hf(x: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(x.reshape(1, len(POSITIONS), 4, 16))
        out = torch.cat((module.apply_rotary_pos_emb(t[..., :8], sin, cos), t[..., 8:]), dim=-1)
        return out.reshape(1, len(POSITIONS), -1).numpy()

    got_q, got_k = _ours(cfg, q, k)
    np.testing.assert_allclose(got_q, hf(q), atol=3e-5)
    np.testing.assert_allclose(got_k, hf(k), atol=3e-5)


# -------------------------------------------------------------------------- config-only checks
def test_rotary_keys_without_transformers() -> None:
    neox = {k: v for k, v in BASE.items() if k != "rope_theta"} | {"model_type": "gpt_neox"}
    assert rope_config_from_hf(neox).rotated_dim == 4  # GPTNeoXConfig's default rotary_pct 0.25
    assert rope_config_from_hf({**neox, "rotary_pct": 1.0}).rotated_dim == 16
    assert rope_config_from_hf({**neox, "rotary_emb_base": 20000.0}).base == 20000.0
    # GPT-NeoX's config class reads rotary_pct/rotary_emb_base, not the top-level 5.x names;
    # its rope_parameters win over both
    ignored = {**neox, "rotary_pct": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 3e4}
    assert (rope_config_from_hf(ignored).rotated_dim, rope_config_from_hf(ignored).base) == (
        16,
        10000.0,
    )
    nested = {**ignored, "rope_parameters": {"rope_type": "default", "rope_theta": 3e4,
                                             "partial_rotary_factor": 0.5}}  # fmt: skip
    assert (rope_config_from_hf(nested).rotated_dim, rope_config_from_hf(nested).base) == (8, 3e4)
    gptj = {**BASE, "model_type": "gptj"}
    assert rope_config_from_hf({**gptj, "head_dim": 128, "hidden_size": 512}).rotated_dim == 64
    assert rope_config_from_hf({**gptj, "rotary_dim": None}).rotated_dim == 16  # whole head
    codegen = {**BASE, "model_type": "codegen", "head_dim": 128, "hidden_size": 512}
    assert rope_config_from_hf(codegen).rotated_dim == 64  # CodeGenConfig's default rotary_dim
    # a Llama-family config rotates all and pairs by halves
    plain = rope_config_from_hf({**BASE, "model_type": "llama", "rotary_dim": None})
    assert (plain.rotated_dim, plain.layout) == (16, HALF)


def test_gpt2_style_names_of_gptj() -> None:
    """GPT-J's config.json says n_head/n_embd/n_positions (HF's attribute_map)."""
    config_json = {"model_type": "gptj", "n_head": 16, "n_embd": 4096, "n_positions": 2048,
                   "n_layer": 28, "rotary_dim": 64}  # fmt: skip
    cfg = rope_config_from_hf(config_json)
    assert (cfg.n_heads, cfg.head_dim, cfg.rotated_dim, cfg.max_seq_len) == (16, 256, 64, 2048)
    assert cfg.layout == PAIRS and len(rope_configs_from_hf_layers(config_json)) == 28


#: model_type -> the pair layout of its code on q/k as HF stores the weights (written from the
#: transformers sources, not from mila_py's tables)
LAYOUTS = {
    **dict.fromkeys(
        ("gptj", "codegen", "cohere", "cohere2", "cohere2_moe", "helium", "glm", "glm4",
         "ernie4_5", "ernie4_5_moe", "moonshine", "moonshine_streaming", "llama4_text",
         "llama4", "roformer", "openai_privacy_filter", "blt", "blt_local_encoder",
         "blt_local_decoder", "blt_global_transformer", "blt_patcher"),
        PAIRS,
    ),
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi", "phi3", "stablelm", "gemma",
         "gemma2", "olmo2", "glm4_moe", "gpt_oss", "chameleon", "minimax", "persimmon"),
        HALF,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_pair_layout_of_each_family(model_type: str) -> None:
    config_json = {**BASE, "model_type": model_type, "head_dim": 16, "rotary_dim": None}
    assert rope_config_from_hf(config_json).layout == LAYOUTS[model_type]


@pytest.mark.parametrize(
    ("model_type", "layout"),
    [("deepseek_v2", PAIRS), ("deepseek_v3", PAIRS), ("glm4_moe_lite", PAIRS), ("youtu", PAIRS),
     ("mistral4", PAIRS), ("minicpm3", HALF), ("hy_v4", HALF)],
)  # fmt: skip
def test_pair_layout_of_latent_attention_families(model_type: str, layout: RopeLayout) -> None:
    # (Mistral 4's class default is a YaRN that scales queries: a plain RoPE here)
    config_json = {**BASE, "model_type": model_type, "qk_rope_head_dim": 8,
                   "rope_parameters": {"rope_type": "default"}}  # fmt: skip
    assert rope_config_from_hf(config_json).layout == layout
    with pytest.raises(ValueError, match="qk_rope_head_dim is 0"):
        rope_config_from_hf({**config_json, "qk_rope_head_dim": 0})


#: families whose config class has a theta or rotated fraction other than 10 000 and 1
CLASS_DEFAULTS = [
    "cohere", "helium", "ernie4_5", "ernie4_5_moe", "llama4_text", "blt", "openai_privacy_filter",
    "smollm3", "minimax_m2", "gpt_neox", "stablelm", "persimmon", "phi", "glm", "glm4",
    "glm4_moe", "moonshine", "moonshine_streaming", "qwen3_next", "nemotron",
    "recurrent_gemma", "qwen3_5_text", "qwen3_5_moe_text", "glm4v_moe_text",
]  # fmt: skip


@pytest.mark.parametrize("model_type", CLASS_DEFAULTS)
def test_missing_keys_take_the_config_class_defaults(torch: Any, model_type: str) -> None:
    """A config.json without ``rope_theta``/``partial_rotary_factor`` means what the model's
    config class defaults to."""
    from transformers import CONFIG_MAPPING

    # the multimodal ones need heads their default M-RoPE sections fit
    head_dim = {"qwen3_5_text": 256, "qwen3_5_moe_text": 256, "glm4v_moe_text": 128}.get(
        model_type, 16
    )
    bare = {"hidden_size": 4 * head_dim, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": head_dim, "num_hidden_layers": 2, "max_position_embeddings": 256}  # fmt: skip
    hf = CONFIG_MAPPING[model_type](**bare)
    want = hf.rope_parameters
    cfg = rope_config_from_hf({**bare, "model_type": model_type})
    assert cfg.base == want["rope_theta"]
    assert cfg.rotated_dim == int(head_dim * want.get("partial_rotary_factor", 1.0))


def test_moonshine_streaming_default_only_without_rope_parameters() -> None:
    bare = {**BASE, "model_type": "moonshine_streaming", "head_dim": 20, "hidden_size": 80}
    assert rope_config_from_hf(bare).rotated_dim == 16  # its class default 0.8
    given = {**bare, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert rope_config_from_hf(given).rotated_dim == 20  # HF then rotates the whole head


def test_llama4_scout_rope_scaling(torch: Any) -> None:
    """Llama 4 Scout's llama3 scaling has low_freq_factor == high_freq_factor == 1."""
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
               "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config_json = {**BASE, "model_type": "llama4_text", "head_dim": 128, "hidden_size": 512,
                   "rope_theta": 500000.0, "rope_scaling": scaling,
                   "max_position_embeddings": 10485760}  # fmt: skip
    cfg = rope_config_from_hf(config_json, max_seq_len=64)
    hf_config = Llama4TextConfig(**{k: v for k, v in config_json.items() if k != "model_type"})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, None)
    got, _ = make_rope(cfg, 1, 1).table.frequencies()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6)


def test_layout_argument_overrides_the_family() -> None:
    cohere = {**BASE, "model_type": "cohere"}
    assert rope_config_from_hf(cohere, layout="half").layout == HALF
    assert (
        rope_config_from_hf({**BASE, "model_type": "llama"}, layout="interleaved").layout == PAIRS
    )


@pytest.mark.parametrize(
    ("model_type", "message"),
    [
        ("deepseek_v4", "last channels of each head"),
        ("kimi_linear", "no RoPE"),
        ("nanochat", "rotation by -theta"),
    ],
)
def test_families_it_cannot_express_are_refused(model_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_config_from_hf({**BASE, "model_type": model_type})


def test_cohere2_rotates_its_sliding_layers_only() -> None:
    config_json = {**BASE, "model_type": "cohere2", "num_hidden_layers": 8, "head_dim": 16}
    layers = rope_configs_from_hf_layers(config_json)
    assert [c is not None for c in layers] == [True, True, True, False] * 2
    assert layers[0] == rope_config_from_hf(config_json, layer_type="sliding_attention")
    assert layers[0].layout == PAIRS
    with pytest.raises(
        ValueError, match="full_attention layers of this cohere2 model rotate nothing"
    ):
        rope_config_from_hf(config_json, layer_type="full_attention")
    moe = {
        **config_json,
        "model_type": "cohere2_moe",
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
        "num_hidden_layers": 4,
    }
    assert [c is not None for c in rope_configs_from_hf_layers(moe)] == [True, True, False, True]
    with pytest.raises(ValueError, match=r"some full_attention layers .* rotate and some do not"):
        rope_config_from_hf(moe, layer_type="full_attention")
    no_rope = {**moe, "prefix_dense_sliding_window_pattern": 4}
    assert [c is not None for c in rope_configs_from_hf_layers(no_rope)] == [
        False,
        True,
        False,
        False,
    ]
    with pytest.raises(ValueError, match="needs mlp_layer_types"):
        rope_configs_from_hf_layers({**moe, "mlp_layer_types": None})


def test_no_rope_layer_type_of_llama4() -> None:
    """Llama 4 names its RoPE layers chunked_attention and its NoPE layers full_attention."""
    config_json = {**BASE, "model_type": "llama4_text", "num_hidden_layers": 4,
                   "layer_types": ["chunked_attention"] * 3 + ["full_attention"]}  # fmt: skip
    with pytest.raises(ValueError, match="rotate nothing"):
        rope_config_from_hf(config_json, layer_type="full_attention")
    assert rope_config_from_hf(config_json, layer_type="chunked_attention").layout == PAIRS


def test_mistral_query_scaling_is_refused_with_the_way_out() -> None:
    """Ministral 3 / Mistral 4 scale Q by position after RoPE (``llama_4_scaling_beta``)."""
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "max_position_embeddings": 262144}  # fmt: skip
    config_json = {**BASE, "model_type": "ministral3", "max_position_embeddings": 262144}
    with pytest.raises(ValueError, match=r"queries by 1 \+ beta \* log"):
        rope_config_from_hf(
            {**config_json, "rope_parameters": {**yarn, "llama_4_scaling_beta": 0.1}},
            max_seq_len=1024,
        )
    cfg = rope_config_from_hf({**config_json, "rope_parameters": yarn}, max_seq_len=1024)
    assert cfg.rope_type == "yarn" and "max_position_embeddings" not in cfg.scaling


HEAD_DIM_DEFAULTS = ["gemma3_text", "gemma3n_text", "gemma2", "mimo_v2_flash", "cohere2_moe",
                     "qwen3", "helium", "glm", "glm4", "ernie4_5", "llama4_text", "minimax_m2",
                     "qwen3_next", "cohere2", "llama"]  # fmt: skip


@pytest.mark.parametrize("model_type", HEAD_DIM_DEFAULTS)
def test_missing_head_dim_is_the_config_class_default(torch: Any, model_type: str) -> None:
    from transformers import CONFIG_MAPPING

    bare = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
            "num_hidden_layers": 2, "max_position_embeddings": 256}  # fmt: skip
    hf = CONFIG_MAPPING[model_type](**bare)
    config_json = {**bare, "model_type": model_type}
    layered = ("mimo_v2_flash", "gemma3_text", "gemma3n_text")
    layer_type = "sliding_attention" if model_type in layered else None
    assert rope_config_from_hf(config_json, layer_type=layer_type).head_dim == hf.head_dim


@pytest.mark.parametrize("model_type", ["exaone4", "exaone_moe"])
def test_exaone4_rotates_its_sliding_layers_only(model_type: str) -> None:
    config_json = {**BASE, "model_type": model_type, "num_hidden_layers": 8, "head_dim": 16}
    layers = rope_configs_from_hf_layers(config_json)
    assert [c is not None for c in layers] == [True, True, True, False] * 2
    string = {**config_json, "sliding_window_pattern": "LLG"}
    assert [c is not None for c in rope_configs_from_hf_layers(string)] == [
        True,
        True,
        False,
    ] * 2 + [
        True,
        True,
    ]
    no_window = {**config_json, "sliding_window": None, "layer_types": ["full_attention"] * 8}
    assert None not in rope_configs_from_hf_layers(no_window)


def test_exaone4_layer_types_match_the_config_class(torch: Any) -> None:
    from transformers import Exaone4Config

    hf = Exaone4Config(**{**BASE, "num_hidden_layers": 8, "head_dim": 16})
    layers = rope_configs_from_hf_layers({**BASE, "model_type": "exaone4", "num_hidden_layers": 8,
                                        "head_dim": 16})  # fmt: skip
    assert [c is not None for c in layers] == [t == "sliding_attention" for t in hf.layer_types]


#: tiny sizes every family below accepts (MoE families get four small experts)
TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 8, "intermediate_size": 32, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
        "num_experts_per_tok": 2, "vocab_size": 128, "max_position_embeddings": 256,
        "pad_token_id": None}  # fmt: skip


def _exaone_rule(attention: Any) -> bool:
    return attention.sliding_window is None or attention.is_sliding


#: whether a family's attention module rotates, read off the module as its forward reads it
#: (the families whose forward rotates on a condition); the others rotate when their forward
#: calls apply_rotary_pos_emb at all
CONDITIONAL_ROTATION = {
    "afmoe": lambda attention: attention.is_local_attention,
    "flint": lambda attention: attention.sliding_window is not None,
    "kolibri1": _exaone_rule,
    "exaone4": _exaone_rule,
    "cohere2": lambda attention: attention.sliding_window is not None,
}


def _hf_rotating_layers(torch: Any, model_type: str, **kwargs: Any) -> tuple[dict, list[bool]]:
    """``(config.json, whether each layer rotates)`` of a tiny model built by transformers: a
    layer rotates when it has an attention module whose forward applies RoPE."""
    import inspect
    import re

    from transformers import CONFIG_MAPPING, AutoModel

    skip_unless_transformers_has(model_type)
    hf_config = CONFIG_MAPPING[model_type](**{**TINY, **kwargs})
    model = AutoModel.from_config(hf_config)
    rule = CONDITIONAL_ROTATION.get(model_type)
    rotates = []
    for layer in model.layers:
        found = (getattr(layer, name, None) for name in ("self_attn", "temporal_block"))
        attention = next((m for m in found if m is not None and "Attention" in type(m).__name__),
                         None)  # fmt: skip
        if attention is None:
            rotates.append(False)
        elif rule is not None:
            rotates.append(bool(rule(attention)))
        else:
            source = inspect.getsource(type(attention).forward)
            rotates.append(re.search(r"apply_rotary_pos_emb\w*\(", source) is not None)
    return hf_config.to_dict(), rotates


@pytest.mark.parametrize(
    ("model_type", "kwargs"),
    [
        ("afmoe", {}),
        ("afmoe", {"global_attn_every_n_layers": 3}),
        ("flint", {}),
        ("kolibri1", {}),
        ("kolibri1", {"sliding_window": None, "layer_types": ["full_attention"] * 8}),
        ("exaone4", {}),
        ("cohere2", {}),
        ("qwen3_next", {}),
        ("qwen3_5_text", {"head_dim": 256}),  # its M-RoPE section needs 64 rotated channels
        ("minimax", {}),
        ("olmo_hybrid", {}),
        ("cohere2", {"sliding_window": None}),  # its sliding layers rotate only with one
        ("olmo_hybrid", {"num_hidden_layers": 2}),  # its last layer is full when none is
        ("bailing_hybrid", {"num_hidden_layers": 12}),
        ("bailing_hybrid", {"layer_group_size": 4}),
        ("bamba", {"attn_layer_indices": [1, 5]}),
        ("recurrent_gemma", {"head_dim": 32, "num_key_value_heads": 4}),
        (
            "recurrent_gemma",
            {"head_dim": 32, "num_key_value_heads": 4, "block_types": ["attention", "recurrent"]},
        ),
        ("lfm2", {"full_attn_idxs": [1, 4, 6]}),
        ("lfm2", {"layer_types": ["conv", "full_attention"] * 4}),
    ],
)
def test_layers_rotate_where_the_models_attention_does(
    torch: Any, model_type: str, kwargs: dict[str, Any]
) -> None:
    """Sliding-only families leave their full-attention layers unrotated; linear-attention and
    convolution layers rotate nothing. Both the config as transformers writes it and the bare
    config.json (layer pattern from the class default) are read alike."""
    as_json, want = _hf_rotating_layers(torch, model_type, **kwargs)
    assert [c is not None for c in rope_configs_from_hf_layers(as_json)] == want
    bare = {**TINY, **kwargs, "model_type": model_type}
    assert [c is not None for c in rope_configs_from_hf_layers(bare)] == want
    for layer_type in set(as_json.get("layer_types") or []):
        rotating = {w for w, t in zip(want, as_json["layer_types"], strict=True) if t == layer_type}
        if rotating == {False}:
            with pytest.raises(ValueError, match="rotate nothing"):
                rope_config_from_hf(as_json, layer_type=layer_type)
        elif rotating == {True}:
            assert rope_config_from_hf(as_json, layer_type=layer_type) is not None


def test_exaone4_5_text_model_is_exaone4() -> None:
    """EXAONE 4.5's config class renames its text config's ``exaone4_5_text`` to exaone4."""
    text = {**BASE, "num_hidden_layers": 8, "head_dim": 16}
    want = rope_configs_from_hf_layers({**text, "model_type": "exaone4"})
    assert [c is not None for c in want] == [True, True, True, False] * 2
    for inner in ("exaone4_5_text", "exaone4"):
        nested = {"model_type": "exaone4_5", "text_config": {**text, "model_type": inner}}
        assert rope_configs_from_hf_layers(nested) == want


@pytest.mark.parametrize(
    ("config_json", "message"),
    [
        ({"model_type": "gpt2", "n_head": 4, "n_embd": 64, "n_positions": 256, "n_layer": 2},
         "learned absolute position"),
        ({"model_type": "falcon", "alibi": True}, r"alibi=True \(RoPE needs alibi=false\)"),
        ({"model_type": "jamba"}, "Mamba layers carry the order"),
        ({"model_type": "bloom"}, "ALiBi"),
        ({"model_type": "kimi_linear"}, "without a rotated part"),
        ({"model_type": "mamba2"}, "no attention"),
    ],
)  # fmt: skip
def test_families_without_rope_are_refused(config_json: dict[str, Any], message: str) -> None:
    config_json = {**BASE, **config_json}
    with pytest.raises(ValueError, match=f"has no RoPE: .*{message}"):
        rope_config_from_hf(config_json)
    n_layers = config_json.get("n_layer", BASE["num_hidden_layers"])
    assert rope_configs_from_hf_layers(config_json) == [None] * n_layers


@pytest.mark.parametrize("alibi", [{}, {"alibi": False}, {"alibi": None}])
def test_falcon_without_alibi_rotates(alibi: dict[str, Any]) -> None:
    """Falcon's code rotates unless ``alibi`` is true (a null is false)."""
    assert rope_config_from_hf({**BASE, "model_type": "falcon", **alibi}).rope_type == "default"


def test_an_empty_scaling_dict_is_not_the_class_default() -> None:
    """``rope_parameters: {}`` is given (transformers' class fills in only a missing one)."""
    bare = {k: v for k, v in BASE.items() if k != "rope_theta"}
    assert rope_config_from_hf({**bare, "model_type": "gpt_oss", "rope_parameters": {}},
                              max_seq_len=256).rope_type == "default"  # fmt: skip


def test_rope_scaling_is_read_over_rope_parameters() -> None:
    """transformers takes ``rope_scaling or rope_parameters``."""
    linear = {"rope_type": "linear", "factor": 2.0}
    config_json = {**BASE, "model_type": "llama", "rope_scaling": linear,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
    assert rope_config_from_hf(config_json).rope_type == "linear"
    assert rope_config_from_hf({**config_json, "rope_scaling": None}).rope_type == "default"


@pytest.mark.parametrize("given", [{}, {"rope_parameters": None}, {"rope_scaling": None}])
def test_a_config_without_scaling_takes_the_class_default(given: dict[str, Any]) -> None:
    """gpt-oss's config class (transformers 5.x) defaults to theta 150 000, 64-wide heads and
    YaRN x32 from 4 096 positions; a config.json without them, or with them null, means that."""
    bare = {k: v for k, v in BASE.items() if k != "rope_theta"}
    config_json = {**bare, "model_type": "gpt_oss", **given}
    cfg = rope_config_from_hf(config_json, max_seq_len=256)
    assert (cfg.base, cfg.head_dim, cfg.rope_type) == (150000.0, 64, "yarn")
    assert cfg.scaling is not None
    assert (cfg.scaling["factor"], cfg.scaling["original_max_position_embeddings"]) == (32.0, 4096)
    mixtral = rope_config_from_hf({**bare, "model_type": "mixtral", **given})
    assert (mixtral.base, mixtral.rope_type) == (1e6, "default")


@pytest.mark.parametrize("model_type", ["qwen3_next", "minimax", "lfm2", "afmoe", "bamba"])
def test_one_config_needs_no_layer_count(model_type: str) -> None:
    """rope_config_from_hf without layer_type reads no layer pattern (only rope_configs_from_hf_layers needs
    num_hidden_layers)."""
    config_json = {k: v for k, v in BASE.items() if k != "num_hidden_layers"}
    cfg = rope_config_from_hf({**config_json, "model_type": model_type, "head_dim": 64})
    assert cfg.head_dim == 64


def test_a_family_without_rope_says_so_without_a_layer_count() -> None:
    t5 = {"model_type": "t5", "num_layers": 6, "num_heads": 8, "d_model": 512}
    with pytest.raises(ValueError, match="has no RoPE: bucketed relative position biases"):
        rope_configs_from_hf_layers(t5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be > 0"),
        ({"model_type": "smollm3", "no_rope_layers": [1]}, "no_rope_layers must be a list of 2"),
        ({"model_type": "smollm3", "no_rope_layers": "1101"}, "no_rope_layers must be a list"),
        ({"partial_rotary_factor": 0.0}, "rotates no channel"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                           "long_factor": [1.0] * 8},
          "original_max_position_embeddings": 0}, "original_max_position_embeddings must be > 0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": None}}, r"needs the key\(s\) \['factor'\]"),
    ],
)  # fmt: skip
def test_malformed_configs_are_value_errors(change: dict[str, Any], message: str) -> None:
    """Not a ZeroDivisionError, IndexError or TypeError from deep inside: a ValueError naming
    the key."""
    config_json = {**BASE, "model_type": "llama", **change}
    with pytest.raises(ValueError, match=message):
        rope_configs_from_hf_layers(config_json)
