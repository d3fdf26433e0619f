"""Hugging Face ``config.json`` -> :class:`RopeConfig`: for a model, a layer type, or each layer.

Behind :func:`rope_config_from_hf` and :func:`rope_configs_from_hf_layers`. Everything a model's
own transformers code decides beyond the ``config.json`` keys lives in the tables here:

- vision-language families: how M-RoPE assigns frequencies to position axes, the section their
  code defaults to, the pair layout;
- families whose layer types carry their own RoPE (Gemma 3's sliding layers rotate with theta
  10 000 and its full layers with 1 000 000): what a transformers 4.x ``config.json`` (flat
  keys such as ``rope_local_base_freq``) means per layer type, and which layer is which type
  when the config has no ``layer_types``;
- layers that rotate nothing (``no_rope_layers``, Cohere 2's full layers);
- pair layouts, latent-attention RoPE heads, and the defaults of each config class (one table,
  merged under the config so that every key is read one way).
"""

from __future__ import annotations

import copy
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mila_py.components._layer import is_int
from mila_py.interop.hf_rope_defaults import CLASS_DEFAULTS, TEXT_MODEL_TYPES
from mila_py.rope.scaling import rope_type_name

if TYPE_CHECKING:
    from mila_py.rope.config import RopeConfig, RopeLayout

__all__ = [
    "HF_LAYER_TYPES",
    "hf_int_problem",
    "hf_layer_types_problem",
    "hf_real_problem",
    "rope_config_from_hf",
    "rope_configs_from_hf_layers",
]

#: vision-language model families whose text RoPE is M-RoPE, by how their code assigns axes
_INTERLEAVED_AXES = frozenset(
    {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe", "qwen4_exp",
     "cosmos3_edge", "cohere_compass"}
)  # fmt: skip
#: the section a family's code takes when the config has none
_DEFAULT_SECTIONS = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "paddleocr_vl"), (16, 24, 24)),
    **dict.fromkeys(("glm4v", "glm4v_moe", "glm_image", "glm_ocr"), (8, 12, 12)),
    **dict.fromkeys(
        ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "cosmos3_edge", "cohere_compass"),
        (24, 20, 20),
    ),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen4_exp"), (11, 11, 10)),
}
#: vision-language families that pair channels (2i, 2i + 1) (``rotate_half_llm``)
_PAIRED_LAYOUT = frozenset({"glm4v", "glm_ocr"})
#: text families whose code pairs channels (2i, 2i + 1) of q/k as HF stores the weights
#: (``rotate_every_two``, ``view_as_complex``, ``rotate_half_llm``, Cohere's ``::2``);
#: ``model_type`` without a ``_text`` suffix
_PAIRED_TYPES = frozenset(
    {"gptj", "codegen", "cohere", "cohere2", "cohere2_moe", "helium", "glm", "glm4", "ernie4_5",
     "ernie4_5_moe", "moonshine", "moonshine_streaming", "llama4", "roformer",
     "openai_privacy_filter", "blt", "blt_local_encoder", "blt_local_decoder",
     "blt_global_transformer", "blt_patcher"}
)  # fmt: skip
#: multi-head latent attention families whose code rotates its separate RoPE head in the half
#: layout (the others pair (2i, 2i + 1) unless ``rope_interleave`` is false)
_MLA_HALF = frozenset({"minicpm3", "hy_v4"})


def _defaults(keys: tuple[str, ...], **values: Any) -> dict[str, dict[str, Any]]:
    return {k: dict(values) for k in keys}


#: class defaults the generated table (rope_hf_defaults.CLASS_DEFAULTS) cannot hold, which
#: override it: keys under the family's own name, the per-layer-type families' head sizes,
#: the sizes Hub configs leave out. Merged under the config, so every key is then read the
#: one way. Keyed by ``model_type`` without ``_text``.
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {"rotary_pct": 0.25},
    **_defaults(("gptj", "codegen"), rotary_dim=64),
    "jetmoe": {"kv_channels": 128},
    "gemma4": {"head_dim": 256},
    "mimo_v2_flash": {"head_dim": 192},
    # the sizes Hub configs leave out (Gemma 3's multimodal text_config)
    "gemma3": {"head_dim": 256, "hidden_size": 2304, "num_attention_heads": 8,
               "num_key_value_heads": 4, "max_position_embeddings": 131072,
               "num_hidden_layers": 26},
    "gemma3n": {"head_dim": 256, "hidden_size": 2048, "num_attention_heads": 8,
                "num_key_value_heads": 2, "max_position_embeddings": 32768,
                "num_hidden_layers": 35},
}  # fmt: skip
#: GPT-NeoX reads ``rotary_pct`` and ``rotary_emb_base`` and ignores the top-level
#: ``partial_rotary_factor`` and ``rope_theta``
_NEOX = frozenset({"gpt_neox", "gpt_neox_japanese"})
#: the GPT-2 style names HF's ``attribute_map`` gives GPT-J and CodeGen configs
_ALIASES = {
    "num_attention_heads": "n_head",
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_hidden_layers": "n_layer",
}
#: keys a family's config class stores under its own name (its ``attribute_map`` or the
#: attribute its attention reads), by ``model_type`` without ``_text``
_FAMILY_ALIASES: dict[str, dict[str, str]] = {
    "jetmoe": {"head_dim": "kv_channels"},
    "zamba2": {"head_dim": "attention_head_dim"},
    "moonshine": {
        "num_attention_heads": "decoder_num_attention_heads",
        "num_key_value_heads": "decoder_num_key_value_heads",
        "num_hidden_layers": "decoder_num_hidden_layers",
    },
    "bailing_hybrid": {"max_position_embeddings": "model_max_length"},
}
#: families with a ``layer_rope_theta`` list (0 = the layer has no RoPE): Granite-SWA rotates
#: each layer with its own theta; Muse's code reads only zero or not (its one rotary module
#: has the model's theta)
_LAYER_THETA_OWN = frozenset({"granite_swa", "granitemoe_swa"})
_LAYER_THETA_SWITCH = frozenset({"muse_glimmer", "muse_spark"})
#: families whose RoPE is switched by a key: (key, its class default, the values that turn
#: RoPE on, as the family's code tests them)
_ROPE_SWITCHES: dict[str, tuple[str, Any, Callable[[Any], bool], str]] = {
    "esm": ("position_embedding_type", "absolute", lambda v: v == "rotary", "'rotary'"),
    "granitemoehybrid": ("position_embedding_type", None, lambda v: v == "rope", "'rope'"),
    "zamba2": ("use_mem_rope", False, bool, "true"),
    "falcon": ("alibi", False, lambda v: not v, "false"),
}
#: text families refused, with what their code does that RopeConfig cannot express
_REFUSED = {
    "deepseek_v4": "RoPE on the last channels of each head (and a second RoPE for its "
    "compressed keys)",
    "nanochat": "a rotation by -theta (its rotate_half is cat(x2, -x1))",
}
_LEARNED = "learned absolute position embeddings"
_MAMBA = "no position encoding in its attention layers (its Mamba layers carry the order)"
_RECURRENT = "no attention (a recurrent model)"
#: families without RoPE, with what they use instead (their configs would otherwise read as
#: a default RoPE: GPT-2's ``n_head``, ``n_embd`` are the names GPT-J's are read by)
_NO_ROPE = {
    **dict.fromkeys(
        ("gpt2", "gpt_neo", "gpt_bigcode", "openai-gpt", "opt", "biogpt", "bart", "mbart",
         "bert", "roberta", "xlm-roberta", "electra", "distilbert", "camembert"),
        _LEARNED,
    ),
    **dict.fromkeys(("xglm", "ctrl", "whisper"), "sinusoidal absolute position embeddings"),
    **dict.fromkeys(("bloom", "mpt"), "ALiBi attention biases"),
    "t5": "bucketed relative position biases",
    "kimi_linear": "a latent attention without a rotated part",
    **dict.fromkeys(("jamba", "nemotron_h", "zamba"), _MAMBA),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"), _RECURRENT),
}  # fmt: skip
_NOT_EXPRESSIBLE = {
    "ernie4_5_vl_moe": "M-RoPE over reordered frequencies (h w h w ... t t)",
    "hunyuan_vl": "xD-RoPE (four sections over the doubled channels) with NTK alpha",
}

FULL, SLIDING = "full_attention", "sliding_attention"
LINEAR = "linear_attention"
#: a family's default layer pattern: the type of layer ``i`` from the config
Pattern = Callable[[int, Mapping[str, Any]], str]


def _full_every(
    n: int, *, first: bool = False, key: str = ""
) -> Callable[[int, Mapping[str, Any]], bool]:
    """Layer ``i`` is a full-attention layer when ``(i + 1) % n == 0`` (and layer 0 if ``first``);
    ``config[key]``, when set, replaces ``n``."""

    def is_full(i: int, config: Mapping[str, Any]) -> bool:
        every = int(config.get(key) or n) if key else n
        return (i + 1) % every == 0 or (first and i == 0)

    return is_full


def _two_types(is_full: Callable[[int, Mapping[str, Any]], bool], other: str = SLIDING) -> Pattern:
    """Full attention where ``is_full``, ``other`` elsewhere."""
    return lambda i, config: FULL if is_full(i, config) else other


_EVERY_SIXTH = _two_types(_full_every(6))


@dataclass(frozen=True)
class _LayeredFamily:
    """What a family's transformers code does with RoPE per layer type.

    Attributes:
        defaults: the ``rope_parameters`` its config class takes when ``config.json`` has none.
        theta_keys: per layer type, the flat key that holds its ``rope_theta`` in a
            transformers 4.x ``config.json`` and the default when that key is missing too.
        scaling_to: the layer types a flat ``rope_scaling`` dict applies to.
            Empty: the family's code reads none (one in config.json is refused).
        pattern: the default layer pattern (without ``layer_types``).
        global_head: Gemma 4: full-attention layers use ``global_head_dim`` (default 512), and
            the last layer is always a full-attention one.
        kv_factor: per layer type, a multiple of ``num_key_value_heads`` its layers use.
        partial: the factor of an entry without ``partial_rotary_factor``.
    """

    defaults: Mapping[str, Mapping[str, Any] | None]
    theta_keys: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    scaling_to: tuple[str, ...] = (FULL,)
    pattern: Pattern = _EVERY_SIXTH
    global_head: bool = False
    kv_factor: Mapping[str, int] = field(default_factory=dict)
    partial: float | None = None


def _lfm3_layer(i: int, config: Mapping[str, Any]) -> str:
    """LFM3: full attention at ``i % 4 == 2``, sliding at ``i % 4 == 0`` past layer 0,
    convolutions elsewhere."""
    return FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else "conv"


_BOTH_DEFAULT = {SLIDING: {"rope_type": "default"}, FULL: {"rope_type": "default"}}
_GEMMA3_THETAS = {FULL: ("rope_theta", 1e6), SLIDING: ("rope_local_base_freq", 1e4)}
_GEMMA3 = _LayeredFamily(
    _BOTH_DEFAULT,
    _GEMMA3_THETAS,
    pattern=_two_types(_full_every(6, key="sliding_window_pattern")),
)
_MODERNBERT = _LayeredFamily(
    _BOTH_DEFAULT,
    {FULL: ("global_rope_theta", 160000.0), SLIDING: ("local_rope_theta", 10000.0)},
    scaling_to=(FULL, SLIDING),
    pattern=_two_types(
        lambda i, config: i % int(config.get("global_attn_every_n_layers") or 3) == 0
    ),
)
#: the proportional RoPE of Gemma 4's and LFM3's full layers (a theta of 1e6)
_PROPORTIONAL = {"rope_type": "proportional", "rope_theta": 1e6}
#: model_type without ``_text`` -> its family (text and multimodal names alike)
_LAYERED: dict[str, _LayeredFamily] = {
    "gemma3": _GEMMA3,
    "gemma3n": _LayeredFamily(_BOTH_DEFAULT, _GEMMA3_THETAS, pattern=_two_types(_full_every(5))),
    **dict.fromkeys(("modernbert", "modernbert-decoder"), _MODERNBERT),
    # transformers 5.x's Olmo3Config pops rope_theta for the full layers and so gives the
    # sliding ones its class default (5e5, which every released checkpoint uses); here both
    # take the checkpoint's theta, as OLMo 3's own training code does.
    "olmo3": _LayeredFamily(
        _BOTH_DEFAULT,
        {FULL: ("rope_theta", 500000.0), SLIDING: ("rope_theta", 500000.0)},
        pattern=_two_types(_full_every(4)),
    ),
    "gemma4": _LayeredFamily(
        {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {**_PROPORTIONAL, "partial_rotary_factor": 0.25},
        },
        scaling_to=(),
        global_head=True,
    ),
    "mimo_v2_flash": _LayeredFamily(
        {
            FULL: {"rope_type": "default", "rope_theta": 5e6},
            SLIDING: {"rope_type": "default", "rope_theta": 1e4},
        },
        scaling_to=(),
        pattern=_two_types(_full_every(6, first=True)),
        kv_factor={SLIDING: 2},  # its sliding layers have twice the key heads
        partial=0.334,
    ),
    "lfm3": _LayeredFamily(
        {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {**_PROPORTIONAL, "partial_rotary_factor": 0.5},
        },
        scaling_to=(),
        pattern=_lfm3_layer,
    ),
}
#: families whose ``no_rope_layers[i] == 0`` marks a layer without RoPE (the name is HF's)
_NO_ROPE_FAMILIES = frozenset({"smollm3", "llama4", "mistral_large4"})
#: families whose full-attention layers have no RoPE: Cohere 2, AFMoE and Flint rotate their
#: sliding layers only; EXAONE 4 and Kolibri 1 too, when they have a ``sliding_window``
_SLIDING_ONLY = frozenset(
    {"cohere2", "cohere2_moe", "exaone4", "exaone_moe", "afmoe", "flint", "kolibri1"}
)
#: their ``sliding_window`` class defaults
_WINDOW_DEFAULTS = {"kolibri1": 513, "flint": 513, "afmoe": 1024}
#: without a ``sliding_window`` every layer of these rotates
_ALL_ROTATE_WITHOUT_WINDOW = frozenset({"exaone4", "exaone_moe", "kolibri1"})
#: these rotate a layer only where it has a window (none: no sliding layer rotates)
_ROTATE_WITH_WINDOW = frozenset({"cohere2", "cohere2_moe", "flint"})
#: layer types without an attention that rotates (recurrent, convolution and MLP-only layers;
#: HF's ``linear_attention`` covers Mamba, Gated DeltaNet and lightning attention)
_UNROTATED_TYPES = frozenset({"linear_attention", "mamba", "conv", "moe", "mlp", "recurrent"})
#: the ``layer_types`` entries a config may carry: transformers' ``ALLOWED_LAYER_TYPES``, the
#: legacy names it remaps (``_LEGACY_LAYER_TYPE_REMAP``) and the unrotated types above
#: (Nemotron-H's ``mlp``); anything else is a typo or a type this module cannot know
HF_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "window_attention",
     "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
     "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
     "reference_sliding_attention", "linear_attention", "sparse", "dense",
     "mamba", "attention", "deepseek_sparse_attention", "qwen_sparse_attention"}
) | _UNROTATED_TYPES  # fmt: skip


def hf_int_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` as the int ``config.json`` key ``key`` holds, or None.

    An int (NumPy's too), not a bool, a str or a float: ``int()`` would truncate ``2.7`` in
    silence, and a whole float such as ``32.0`` is refused as well (transformers keeps it a
    float, which its own code may not expect either)."""
    if is_int(value):
        return None
    whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    hint = " (refused even when whole: write it as an int)" if whole else ""
    return f"{key} must be an int, got {value!r} ({type(value).__name__}){hint}"


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_)


def hf_real_problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` as the real number ``config.json`` key ``key`` holds, or
    None: an int or a float (NumPy's too), finite; not a bool, not a str."""
    if not _is_real(value):
        return f"{key} must be a real number (int or float), got {value!r} ({type(value).__name__})"
    if not math.isfinite(value):
        return f"{key} must be finite, got {value!r}"
    return None


def hf_layer_types_problem(value: Any) -> str | None:
    """What is wrong with a ``layer_types`` value, or None: a list of the names in
    :data:`HF_LAYER_TYPES` (null: absent)."""
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        return f"layer_types must be a list of layer type names, got {value!r}"
    unknown = sorted({repr(t) for t in value if not isinstance(t, str) or t not in HF_LAYER_TYPES})
    if unknown:
        return (
            f"layer_types holds unknown layer type(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(HF_LAYER_TYPES))}"
        )
    return None


def _as_int(key: str, value: Any) -> int:
    problem = hf_int_problem(key, value)
    if problem is not None:
        raise TypeError(f"rope_config_from_hf: {problem}")
    return int(value)


def _as_real(key: str, value: Any) -> float:
    problem = hf_real_problem(key, value)
    if problem is not None:
        error = ValueError if _is_real(value) else TypeError  # a real number: not finite
        raise error(f"rope_config_from_hf: {problem}")
    return float(value)


def _exaone_full(i: int, config: Mapping[str, Any]) -> bool:
    """EXAONE 4's pattern: every ``sliding_window_pattern``-th layer is full (default 4), or
    the ``"G"`` layers of a string pattern such as ``"LLLG"``."""
    pattern = config.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        return pattern[i % len(pattern)].upper() == "G"
    return (i + 1) % int(pattern or 4) == 0


def _flint_full(i: int, config: Mapping[str, Any]) -> bool:
    """Flint's pattern: full attention on the first two layers, every fourth from layer 1, and
    the last."""
    return i < 2 or i % 4 == 1 or i == int(config["num_hidden_layers"]) - 1


def _lfm2_full(i: int, config: Mapping[str, Any]) -> bool:
    """LFM2's ``full_attn_idxs`` (none given: every layer)."""
    indices = config.get("full_attn_idxs")
    return indices is None or i in indices


def _olmo_hybrid_full(i: int, config: Mapping[str, Any]) -> bool:
    """OLMo-Hybrid: every fourth layer, and the last one when that gives none."""
    n = int(config["num_hidden_layers"])
    return i % 4 == 3 or (n < 4 and i == n - 1)


def _recurrent_gemma_layer(i: int, config: Mapping[str, Any]) -> str:
    """Recurrent Gemma's ``block_types`` repeated: its attention blocks slide."""
    blocks = list(config.get("block_types") or ("recurrent", "recurrent", "attention"))
    return LINEAR if blocks[i % len(blocks)] == "recurrent" else SLIDING


#: layer patterns of one-RoPE families whose layers differ in rotating or not, for configs
#: without ``layer_types``
_FLAT_PATTERNS: dict[str, Pattern] = {
    "cohere2": _two_types(_full_every(4, key="sliding_window_pattern")),
    "exaone4": _two_types(_exaone_full),
    "exaone_moe": _two_types(_exaone_full),
    "afmoe": _two_types(_full_every(4, key="global_attn_every_n_layers")),
    "flint": _two_types(_flint_full),
    "kolibri1": _two_types(_full_every(5)),
    **dict.fromkeys(
        ("qwen3_next", "qwen3_5", "qwen3_5_moe"),
        _two_types(_full_every(4, key="full_attention_interval"), LINEAR),
    ),
    "minimax": _two_types(lambda i, config: i % 2 == 0, LINEAR),
    "olmo_hybrid": _two_types(_olmo_hybrid_full, LINEAR),
    "bailing_hybrid": _two_types(_full_every(6, key="layer_group_size"), LINEAR),
    "bamba": _two_types(lambda i, config: i in (config.get("attn_layer_indices") or ()), LINEAR),
    "recurrent_gemma": _recurrent_gemma_layer,
    **dict.fromkeys(("lfm2", "lfm2_moe"), _two_types(_lfm2_full, "conv")),
}


#: families whose rotary module reads a "dynamic" dict with an ``alpha`` as fixed NTK scaling
_NTK_ALPHA_FAMILIES = frozenset({"hunyuan_v1_dense", "hunyuan_v1_moe"})


def _ntk_alpha(params: dict[str, Any]) -> dict[str, Any]:
    """HunYuan's ``{"type": "dynamic", "alpha": a, ...}`` as its code reads it: the base
    stretched by ``a^(d / (d - 2))``, nothing length-dependent (the other keys are unused)."""
    if rope_type_name(params) != "dynamic" or not params.get("alpha"):
        return params
    kept: dict[str, Any] = {"rope_type": "ntk_alpha", "alpha": params["alpha"]}
    kept.update((k, params[k]) for k in ("rope_theta", "partial_rotary_factor") if k in params)
    return kept


def _text_type(model_type: Any) -> str | None:
    """``model_type`` without a ``_text`` suffix (``llama4_text`` -> ``llama4``), or the family
    of the language model a multimodal family uses (``exaone4_5_text`` -> ``exaone4``, from
    ``TEXT_MODEL_TYPES``)."""
    if not isinstance(model_type, str):
        return None
    family = model_type.removesuffix("_text")
    return TEXT_MODEL_TYPES.get(family, family).removesuffix("_text")


def _vlm_family(model_type: Any) -> str | None:
    """The family of a ``model_type`` among the vision-language ones known here (its longest
    name that ``model_type`` is, or starts with followed by ``_``: ``qwen3_vl_moe_text`` ->
    ``qwen3_vl_moe``), or None."""
    if not isinstance(model_type, str):
        return None
    known = (*_DEFAULT_SECTIONS, *_NOT_EXPRESSIBLE)
    matches = [f for f in known if model_type == f or model_type.startswith(f + "_")]
    return max(matches, key=len) if matches else None


def _is_per_layer_type(raw: Mapping[str, Any]) -> bool:
    """``{"full_attention": {...}, "sliding_attention": {...}}`` rather than one dict."""
    values = list(raw.values())
    return (
        bool(values)
        and all(v is None or isinstance(v, Mapping) for v in values)
        and any(isinstance(v, Mapping) for v in values)
    )


class _HfRope:
    """One ``config.json`` resolved as the model's code would: text config, per-layer-type
    RoPE parameters, layer types, per-layer head overrides."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise TypeError(
                f"rope_config_from_hf: config must be a dict, got {type(config).__name__}"
            )
        text = config.get("text_config")
        if text is not None and not isinstance(text, Mapping):
            raise TypeError(
                f"rope_config_from_hf: text_config must be a dict (the text model's config), got "
                f"{text!r}"
            )
        if isinstance(text, Mapping) and "num_attention_heads" not in config:
            outer = config.get("model_type")
            config = {"model_type": TEXT_MODEL_TYPES.get(str(outer), outer), **text}
        self.text_type = family_type = _text_type(config.get("model_type")) or ""
        renamed = {**_ALIASES, **_FAMILY_ALIASES.get(family_type, {})}
        defaults = {**CLASS_DEFAULTS.get(family_type, {}), **_CLASS_DEFAULTS.get(family_type, {})}
        #: the class's scaling dict, for a config without one
        self.default_scaling: Mapping[str, Any] = defaults.pop("rope_parameters", {})
        merged = {**defaults, **config}
        aliases = {
            k: merged[a]
            for k, a in renamed.items()
            if config.get(k) is None and merged.get(a) is not None
        }
        if family_type == "zamba2" and config.get("head_dim") is None and "head_dim" not in aliases:
            hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
            if hidden and heads:  # its class: attention_head_dim = 2 * hidden_size // heads
                aliases["head_dim"] = 2 * int(hidden) // int(heads)
        self.config: Mapping[str, Any] = {**merged, **aliases}
        config = self.config
        given = config.get("layer_types")
        problem = hf_layer_types_problem(given)
        if problem is not None:
            error = ValueError if isinstance(given, list | tuple) else TypeError
            raise error(f"rope_config_from_hf: {problem}")
        self.model_type = config.get("model_type")
        self.vlm = _vlm_family(self.model_type)
        if self.vlm in _NOT_EXPRESSIBLE:
            raise ValueError(
                f"rope_config_from_hf: {self.model_type!r} uses {_NOT_EXPRESSIBLE[self.vlm]}, "
                "which RopeConfig cannot express"
            )
        if self.text_type in _REFUSED:
            raise ValueError(
                f"rope_config_from_hf: {self.model_type!r} uses {_REFUSED[self.text_type]}, "
                "which RopeConfig cannot express"
            )
        switch = _ROPE_SWITCHES.get(self.text_type)
        #: why this config has no RoPE at all (a family without RoPE, or its switch is off)
        self.rope_off: str | None = _NO_ROPE.get(self.text_type)
        if switch is not None:
            key, default, rotates, wanted = switch
            value = config.get(key, default)
            if not rotates(value):
                self.rope_off = f"{key}={value!r} (RoPE needs {key}={wanted})"
        self.family = _LAYERED.get(self.text_type)
        # transformers reads a 4.x ``rope_scaling`` over ``rope_parameters`` when both are there
        nested = config.get("rope_parameters")
        if nested is None:  # the class's default dict (an empty one stays empty)
            nested = copy.deepcopy(dict(self.default_scaling))
        raw = config.get("rope_scaling") or nested
        if not isinstance(raw, Mapping):
            raise ValueError(f"rope_config_from_hf: rope_scaling must be a dict, got {raw!r}")
        self.per_type: dict[str, dict[str, Any] | None] | None = None
        if self.family is not None:
            self.per_type = self._family_parameters(self.family)
        elif _is_per_layer_type(raw):
            self.per_type = {k: None if v is None else dict(v) for k, v in raw.items()}
        self.flat = None if self.per_type is not None else dict(raw)
        if self.text_type in _NTK_ALPHA_FAMILIES and self.flat:
            self.flat = _ntk_alpha(self.flat)

    def _family_parameters(self, family: _LayeredFamily) -> dict[str, dict[str, Any] | None]:
        """HF's ``convert_rope_params_to_dict`` of the family, on either config.json format."""
        config = self.config
        nested = config.get("rope_parameters")
        if nested is not None and not (isinstance(nested, Mapping) and _is_per_layer_type(nested)):
            raise ValueError(
                f"rope_config_from_hf: a {self.model_type} config's rope_parameters must be a dict "
                f"per layer type ({FULL}, {SLIDING}), got {nested!r}"
            )
        source = nested if nested is not None else family.defaults
        per_type = {k: None if v is None else copy.deepcopy(dict(v)) for k, v in source.items()}
        flat = config.get("rope_scaling")
        if isinstance(flat, Mapping) and flat and not _is_per_layer_type(flat):
            if not family.scaling_to:
                raise ValueError(
                    f"rope_config_from_hf: {self.model_type} reads no flat rope_scaling; give "
                    f"rope_parameters per layer type ({FULL}, {SLIDING})"
                )
            flat = dict(flat)
            if "type" in flat and "rope_type" not in flat:  # the 4.x name
                flat["rope_type"] = flat.pop("type")
            for layer_type in family.scaling_to:
                per_type[layer_type] = {**(per_type.get(layer_type) or {}), **flat}
        for layer_type, (key, default) in family.theta_keys.items():
            # these families' code gives a null or missing entry the default RoPE
            entry = per_type.get(layer_type) or {"rope_type": "default"}
            theta = config.get(key)
            entry.setdefault("rope_theta", default if theta is None else theta)
            per_type[layer_type] = entry
        if family.partial is not None:
            for params in per_type.values():
                if params is not None:
                    params.setdefault("partial_rotary_factor", family.partial)
        return per_type

    # ------------------------------------------------------------------------------ layers
    @functools.cached_property
    def layer_types(self) -> list[str] | None:
        """The type of each layer: ``layer_types``, else the family's pattern; None when the
        model has one RoPE for all its layers and no list."""
        given = self.config.get("layer_types")
        if given:  # checked in __init__: names from HF_LAYER_TYPES
            kinds = list(given)
        elif self.text_type in _NO_ROPE_FAMILIES:
            return self._no_rope_layer_types()
        else:
            family = self.family
            pattern = family.pattern if family else _FLAT_PATTERNS.get(self.text_type)
            if pattern is None:
                return None
            kinds = [pattern(i, self.config) for i in range(self._n_layers())]
        if self.family is not None and self.family.global_head and kinds:
            kinds[-1] = FULL  # Gemma 4 forces its last layer to full attention
        return kinds

    def _no_rope_layer_types(self) -> list[str] | None:
        """Llama 4 names its RoPE layers chunked_attention and the others full_attention;
        SmolLM3's NoPE layers slide when ``use_sliding_window`` is set."""
        rotates = [self.uses_rope(i, None) for i in range(self._n_layers())]
        if self.text_type == "llama4":
            return ["chunked_attention" if r else FULL for r in rotates]
        if self.text_type == "smollm3":
            slide = bool(self.config.get("use_sliding_window")) and (
                self.config.get("sliding_window") is not None
            )
            return [SLIDING if slide and not r else FULL for r in rotates]
        return None

    def _n_layers(self) -> int:
        if self.config.get("num_hidden_layers") is None:
            raise ValueError("rope_config_from_hf: config.json has no 'num_hidden_layers'")
        return _as_int("num_hidden_layers", self.config["num_hidden_layers"])

    def uses_rope(self, index: int, layer_type: str | None) -> bool:
        """False for the layers a model leaves unrotated: layers of a type without attention
        (``linear_attention``, ``conv``, ...); SmolLM3's and Llama 4's
        ``no_rope_layers[i] == 0`` (by default every ``no_rope_layer_interval``-th, 4); and the
        full-attention layers of Cohere 2, AFMoE, Flint, EXAONE 4 and Kolibri 1 (Cohere 2 MoE's
        dense prefix layers rotate when its ``prefix_dense_sliding_window_pattern`` is 1;
        without a ``sliding_window`` EXAONE 4's and Kolibri 1's layers all rotate, and Cohere
        2's and Flint's sliding layers do not)."""
        if layer_type in _UNROTATED_TYPES:
            return False
        thetas = self.layer_thetas
        if thetas is not None and not thetas[index]:
            return False
        if self.text_type in _NO_ROPE_FAMILIES:
            flags = self.config.get("no_rope_layers")
            if flags:
                n = self._n_layers()
                if not isinstance(flags, Sequence) or isinstance(flags, str) or len(flags) != n:
                    raise ValueError(
                        f"rope_config_from_hf: no_rope_layers must be a list of "
                        f"{n} (num_hidden_layers) flags, got {flags!r}"
                    )
                return bool(flags[index])
            return (index + 1) % int(self.config.get("no_rope_layer_interval") or 4) != 0
        family = self.text_type
        if family in _SLIDING_ONLY:
            if layer_type is None:
                raise ValueError(
                    f"rope_config_from_hf: a {self.model_type} config needs layer_types to tell "
                    "which layers rotate"
                )
            window = self.config.get("sliding_window", _WINDOW_DEFAULTS.get(family, 4096))
            if window is None and family in _ALL_ROTATE_WITHOUT_WINDOW:
                return True
            if layer_type == SLIDING and (window is not None or family not in _ROTATE_WITH_WINDOW):
                return True
            if family != "cohere2_moe":
                return False
            mlp = self.config.get("mlp_layer_types")
            if not mlp:
                raise ValueError(
                    "rope_config_from_hf: a cohere2_moe config needs mlp_layer_types to tell "
                    "which full-attention layers rotate"
                )
            pattern = self.config.get("prefix_dense_sliding_window_pattern", 1)
            return mlp[index] == "dense" and pattern == 1
        return True

    @functools.cached_property
    def layer_thetas(self) -> list[float] | None:
        """``layer_rope_theta`` of the families that read it (Muse's class default when the
        config has none: every 4th layer from the end without RoPE), else None."""
        if self.text_type not in _LAYER_THETA_OWN | _LAYER_THETA_SWITCH:
            return None
        thetas = self.config.get("layer_rope_theta")
        if thetas is None and self.text_type in _LAYER_THETA_SWITCH:
            n = self._n_layers()
            return [0.0 if (n - 1 - i) % 4 == 0 else 1.0 for i in range(n)]
        if thetas is None:
            return None
        return [_as_real(f"layer_rope_theta[{i}]", t) for i, t in enumerate(thetas)]

    @functools.cached_property
    def _per_layer(self) -> dict[int, Any] | None:
        """``per_layer_config`` by layer index (transformers 5.x writes the keys zero-padded)."""
        per_layer = self.config.get("per_layer_config")
        if not isinstance(per_layer, Mapping):
            return None
        return {int(k): v for k, v in per_layer.items()}

    def overrides(self, index: int, layer_type: str | None) -> dict[str, Any]:
        """Head sizes layer ``index`` sets apart from the model's (``per_layer_config``, or
        Gemma 4's ``global_head_dim`` on its full-attention layers, Laguna's
        ``num_attention_heads_per_layer``), and Granite-SWA's theta of the layer."""
        found: dict[str, Any] = {}
        thetas = self.layer_thetas
        if thetas is not None and self.text_type in _LAYER_THETA_OWN and thetas[index]:
            found["rope_theta"] = thetas[index]
        heads_per_layer = self.config.get("num_attention_heads_per_layer")
        if heads_per_layer:
            found["num_attention_heads"] = _as_int(
                f"num_attention_heads_per_layer[{index}]", heads_per_layer[index]
            )
        family = self.family
        if family is not None and layer_type is not None and layer_type in family.kv_factor:
            n_kv = self.config.get("num_key_value_heads") or self.config["num_attention_heads"]
            found["num_key_value_heads"] = (
                _as_int("num_key_value_heads", n_kv) * family.kv_factor[layer_type]
            )
        per_layer = self._per_layer
        if per_layer is not None:
            entry = per_layer.get(index) or {}
            keys = ("head_dim", "num_key_value_heads", "num_attention_heads")
            return found | {k: entry[k] for k in keys if k in entry}
        if family is not None and family.global_head and layer_type == FULL:
            found["head_dim"] = _as_int(
                "global_head_dim", self.config.get("global_head_dim") or 512
            )
            kv = self.config.get("num_global_key_value_heads")
            if kv is not None and self.config.get("attention_k_eq_v", False):
                found["num_key_value_heads"] = _as_int("num_global_key_value_heads", kv)
        return found

    # ------------------------------------------------------------------------------ one config
    def parameters(self, layer_type: str | None) -> dict[str, Any] | None:
        """The RoPE parameter dict of ``layer_type`` (None: the layer type rotates nothing)."""
        if self.per_type is None:
            known = self.layer_types if layer_type is not None else None
            if layer_type is not None and known is not None and layer_type not in known:
                raise ValueError(
                    f"rope_config_from_hf: layer_type {layer_type!r} is not in the config's "
                    f"layer_types {sorted(set(known))}"
                )
            return dict(self.flat or {})
        if layer_type is None:
            raise ValueError(
                f"rope_config_from_hf: this {self.model_type or 'model'} config gives each layer "
                f"type its own RoPE ({', '.join(sorted(self.per_type))}); pass layer_type=..., or "
                "use rope_configs_from_hf_layers for one config per layer"
            )
        if layer_type not in self.per_type:
            raise ValueError(
                f"rope_config_from_hf: no RoPE parameters for layer_type {layer_type!r}; the config "
                f"has {sorted(self.per_type)}"
            )
        entry = self.per_type[layer_type]
        return None if entry is None else dict(entry)

    def _rotated(self, params: Mapping[str, Any], name: str, head_dim: int) -> int:
        """Channels rotated per head, counted as the family's code counts them:
        ``partial_rotary_factor`` (GPT-NeoX: ``rotary_pct``), else a ``rotary_dim`` (GPT-J,
        CodeGen, MiniMax-M2; null: the whole head); class defaults are in the config already."""
        config = self.config
        key = "partial_rotary_factor"
        prf = params.get(key)
        if prf is None:
            key = "rotary_pct" if self.text_type in _NEOX else "partial_rotary_factor"
            prf = config.get(key)
        if prf is None and "rotary_dim" in config:
            given = config["rotary_dim"]
            return head_dim if given is None else _as_int("rotary_dim", given)
        prf = 1.0 if prf is None else _as_real(key, prf)
        rotary = 2 * int(prf * head_dim // 2) if name == "proportional" else int(head_dim * prf)
        if rotary <= 0:  # RopeConfig reads rotary_dim 0 as the whole head
            raise ValueError(
                f"rope_config_from_hf: head_dim {head_dim} * partial_rotary_factor {prf} rotates "
                "no channel"
            )
        if rotary % 2:
            raise ValueError(
                f"rope_config_from_hf: head_dim {head_dim} * partial_rotary_factor {prf} = "
                f"{rotary} rotated channels is odd"
            )
        return rotary

    def _paired(self, mla: bool) -> bool:
        """Whether the family's code pairs channels (2i, 2i + 1)."""
        if mla:
            return self.text_type not in _MLA_HALF and bool(
                self.config.get("rope_interleave", True)
            )
        return self.text_type in _PAIRED_TYPES or self.vlm in _PAIRED_LAYOUT

    def build(
        self,
        params: dict[str, Any],
        heads: Mapping[str, Any],
        max_seq_len: int | None,
        layout: RopeLayout | str | None,
    ) -> RopeConfig:
        from mila_py.rope.config import RopeConfig, RopeLayout

        config = {**self.config, **heads}
        if config.get("max_position_embeddings") is None and max_seq_len is not None:
            config["max_position_embeddings"] = max_seq_len  # (Recurrent Gemma has none)
        needed = ("num_attention_heads", "hidden_size", "max_position_embeddings")
        missing = [key for key in needed if config.get(key) is None]
        if missing:
            hint = " (or pass max_seq_len=...)" if missing == ["max_position_embeddings"] else ""
            raise ValueError(f"rope_config_from_hf: config.json has no {missing[0]!r}{hint}")
        n_heads, hidden, max_pos = (_as_int(key, config[key]) for key in needed)
        for key, value in zip(needed, (n_heads, hidden, max_pos), strict=True):
            if value <= 0:
                raise ValueError(f"rope_config_from_hf: {key} must be > 0, got {value}")
        n_kv = _as_int("num_key_value_heads", config.get("num_key_value_heads") or n_heads)
        head_dim = _as_int("head_dim", config.get("head_dim") or hidden // n_heads)
        mla = config.get("qk_rope_head_dim") is not None
        if mla:  # latent attention: a RoPE head per query head and one key head shared by all
            head_dim, n_kv = _as_int("qk_rope_head_dim", config["qk_rope_head_dim"]), 1
            if head_dim <= 0:
                raise ValueError(
                    f"rope_config_from_hf: qk_rope_head_dim is {head_dim}: this model's latent "
                    "attention rotates nothing"
                )
        base = heads.get("rope_theta", params.get("rope_theta"))  # a layer's own theta first
        base_key = "rope_theta"
        neox = self.text_type in _NEOX  # reads rotary_emb_base, not a top-level rope_theta
        for key in ("rotary_emb_base",) if neox else ("rope_theta", "rotary_emb_base"):
            if base is None:
                base_key, base = key, config.get(key)
        base = 10000.0 if base is None else _as_real(base_key, base)
        name = rope_type_name(params)
        rotary_dim = head_dim if mla else self._rotated(params, name, head_dim)
        if params.get("llama_4_scaling_beta") is not None:
            raise ValueError(
                "rope_config_from_hf: llama_4_scaling_beta (Ministral 3, Mistral 4) scales the "
                "queries by 1 + beta * log(1 + floor(position / "
                "original_max_position_embeddings)) after RoPE, which Rope does not do; below "
                "that length the factor is 1, so drop the key from the config if your contexts "
                "stay there, or apply the factor to Q in attention"
            )
        # "interleaved": Qwen3-Omni's, and "max_position_embeddings": Mistral's copy of the
        # model's; transformers ignores both
        for key in ("rope_theta", "partial_rotary_factor", "type", "interleaved", "rope_type"):
            params.pop(key, None)
        params.pop("max_position_embeddings", None)
        if self.vlm is not None:  # the model's code: its default section, its axis assignment
            params.setdefault("mrope_section", _DEFAULT_SECTIONS[self.vlm])
            params["mrope_interleaved"] = self.vlm in _INTERLEAVED_AXES
            section = [int(n) for n in params["mrope_section"]]
            if params["mrope_interleaved"] and len(section) == 3:
                # interleaving sets only the height and width frequencies; every other one
                # stays temporal, so a section short of the rotated pairs gives axis 0 the rest
                spare = rotary_dim // 2 - sum(section)
                if spare > 0:
                    params["mrope_section"] = [section[0] + spare, *section[1:]]
        original = "original_max_position_embeddings"
        if name == "dynamic":
            params[original] = max_pos  # HF 5.x: dynamic always scales from max_position_embeddings
        elif name in ("llama3", "yarn", "longrope"):
            if config.get(original) is not None:
                params[original] = _as_int(original, config[original])
            elif params.get(original) is None:
                params[original] = max_pos
            else:
                params[original] = _as_int(original, params[original])
            if params[original] <= 0:
                raise ValueError(
                    f"rope_config_from_hf: {original} must be > 0, got {params[original]}"
                )
            if name in ("yarn", "longrope") and params.get("factor") is None:
                params["factor"] = max_pos / params[original]
        scaling = None if name == "default" and not params else {"rope_type": name, **params}
        if layout is None:
            layout = RopeLayout.INTERLEAVED if self._paired(mla) else RopeLayout.HALF
        return RopeConfig(
            channels=n_heads * head_dim,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            max_seq_len=int(max_seq_len or max_pos),
            base=base,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            layout=layout,
            scaling=scaling,
        )


def rope_config_from_hf(
    config: Mapping[str, Any],
    *,
    layer_type: str | None = None,
    max_seq_len: int | None = None,
    layout: RopeLayout | str | None = None,
) -> RopeConfig:
    """Build a RopeConfig from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x).

    Reads ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``max_position_embeddings``, ``rope_theta``, ``partial_rotary_factor`` and the scaling dict
    (``rope_scaling`` or ``rope_parameters``). Values HF would take from the model config
    (``original_max_position_embeddings``, a missing YaRN/LongRoPE ``factor``) are written into
    the scaling dict, so the result computes what HF computes even if ``max_seq_len`` differs
    from ``max_position_embeddings``.

    Vision-language configs: a config whose text model sits in ``text_config`` is read from
    there, as the family of that text model (a ``text_config`` without a ``model_type`` is
    the one the multimodal class defaults to: Aya Vision's Cohere 2, PaliGemma's Gemma). M-RoPE follows what the model's own code does, which the ``model_type`` decides:
    the Qwen3-VL family (``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``, ``qwen3_5_moe``,
    ``qwen3_omni_moe``, ``qwen4_exp``, ``cosmos3_edge``) always interleaves its axes, the
    Qwen2-VL and GLM-4V families never do, whatever ``mrope_interleaved`` says (without a
    ``model_type`` the flag decides), and a config without ``mrope_section`` gets the one
    the model's code defaults to; GLM-4.1V and GLM-OCR pair channels ``(2i, 2i + 1)``.
    ERNIE-4.5-VL and HunYuan-VL, whose multimodal RoPE this class cannot express, are refused.

    Layer types: models whose layers rotate differently (Gemma 3's sliding layers with theta
    10 000, its full layers with 1 000 000 and a linear factor; ModernBERT; OLMo 3; Gemma 4,
    whose full layers are wider; MiMo-V2-Flash, whose sliding layers have twice the key
    heads) give ``rope_parameters`` per layer type. Name the type with ``layer_type``; the
    transformers 4.x keys of these families are read as their code reads them:
    ``rope_local_base_freq``, ``global_rope_theta``/``local_rope_theta``, a flat
    ``rope_scaling`` (Gemma 3 and OLMo 3 apply it to their full layers, ModernBERT to
    both, Gemma 4 and MiMo read none), Gemma 4's ``global_head_dim`` and the zero-padded
    ``per_layer_config`` keys transformers 5.x writes. Without ``layer_types``, each
    family's own pattern decides (Gemma 3's ``sliding_window_pattern``, Llama 4's
    ``no_rope_layers``, ...). :func:`rope_configs_from_hf_layers` gives the config of every layer.

    Families: the pair layout is the one the family's code applies to q/k as HF stores the
    weights: ``(2i, 2i + 1)`` for GPT-J, CodeGen, Cohere (1, 2), Helium, GLM, GLM-4,
    ERNIE-4.5, Moonshine, Llama 4, RoFormer, BLT; halves for the rest. Partial rotary comes
    from ``partial_rotary_factor``, else GPT-NeoX's ``rotary_pct``, GPT-J's ``rotary_dim``,
    or the factor the family's config class defaults to (Phi, StableLM, Persimmon, GLM,
    Qwen3-Next, Nemotron, ...); GPT-NeoX's ``rotary_emb_base`` is its theta. A key the
    config leaves out (or a null scaling dict) takes what the family's transformers config
    class defaults to, where that differs from the generic reading: theta (Mixtral 1e6,
    Llama 4 5e5, ...), head size (Qwen3.5 256, Gemma 256, ...), latent RoPE head, scaling
    (gpt-oss's YaRN x32, Apertus's llama3, ...); the table is checked against every
    transformers config class. GPT-J's ``n_head``/``n_embd`` names are read too. Multi-head latent attention (a
    ``qk_rope_head_dim``: DeepSeek-V2/V3, Kimi-K2, MiniCPM3, ...) gives the config of the
    RoPE part: ``qk_rope_head_dim`` channels per query head and one shared key head,
    paired ``(2i, 2i + 1)`` unless ``rope_interleave`` is false (MiniCPM3 by halves); HF
    writes those pairs back in half order, which changes no attention score. DeepSeek-V4
    (RoPE on the last channels) and nanochat (rotation by -theta) are refused, and so are
    configs without RoPE: families that have none (GPT-2, OPT, BLOOM, Jamba, Kimi-Linear,
    Mamba, ...: the error names what they use) and RoPE switched off by the family's key
    (Falcon's ``alibi``, ESM's ``position_embedding_type``, ...). A ``rope_scaling`` is read
    over a ``rope_parameters``, as transformers does.

    Args:
        config: the parsed ``config.json``.
        layer_type: which layer type's RoPE (``"full_attention"``, ``"sliding_attention"``,
            ...); required when the config has per-layer-type RoPE parameters, checked
            against ``layer_types`` otherwise.
        max_seq_len: table size; defaults to ``max_position_embeddings``.
        layout: ``"half"`` or ``"interleaved"``; None picks the one of the ``model_type``
            (see Families above; ``"half"`` for Llama-family checkpoints).

    Raises:
        ValueError: a missing key, a config RopeConfig cannot express, a NaN or infinite
            number (``rope_theta``, a scaling value, ...) or an unknown name in
            ``layer_types``.
        TypeError: a key of the wrong type: a size that is not an int (a float, even a
            whole one, a str, a bool), a ``rope_theta`` or ``partial_rotary_factor`` that
            is not a real number, a ``layer_types`` that is not a list, a ``text_config``
            that is not a dict.
    """
    hf = _HfRope(config)
    if hf.rope_off is not None:
        raise ValueError(
            f"rope_config_from_hf: this {hf.model_type} config has no RoPE: {hf.rope_off}"
        )
    params = hf.parameters(layer_type)
    if params is None:
        raise ValueError(
            f"rope_config_from_hf: layer_type {layer_type!r} rotates nothing (its rope_parameters "
            "are null)"
        )
    heads: dict[str, Any] = {}
    kinds = hf.layer_types if layer_type is not None else None
    if kinds is not None:
        rotating = {hf.uses_rope(i, t) for i, t in enumerate(kinds) if t == layer_type}
        if rotating == {False}:
            raise ValueError(
                f"rope_config_from_hf: the {layer_type} layers of this {hf.model_type} model "
                "rotate nothing"
            )
        if len(rotating) > 1:
            raise ValueError(
                f"rope_config_from_hf: some {layer_type} layers of this {hf.model_type} model "
                "rotate and some do not; use rope_configs_from_hf_layers"
            )
        found = {
            tuple(sorted(hf.overrides(i, t).items()))
            for i, t in enumerate(kinds)
            if t == layer_type
        }
        if len(found) > 1:
            raise ValueError(
                f"rope_config_from_hf: the {layer_type} layers differ in head sizes "
                f"({sorted(found)}); use rope_configs_from_hf_layers"
            )
        heads = dict(found.pop()) if found else {}
    elif hf.layer_thetas is not None or hf.config.get("num_attention_heads_per_layer"):
        n_layers = hf._n_layers()
        each = {
            tuple(sorted(hf.overrides(i, None).items()))
            for i in range(n_layers)
            if hf.uses_rope(i, None)
        }
        if len(each) > 1:
            raise ValueError(
                f"rope_config_from_hf: the layers of this {hf.model_type} model rotate with "
                "different thetas or head counts (layer_rope_theta, "
                "num_attention_heads_per_layer); use rope_configs_from_hf_layers"
            )
        heads = dict(each.pop()) if each else {}
    return hf.build(params, heads, max_seq_len, layout)


def rope_configs_from_hf_layers(
    config: Mapping[str, Any],
    *,
    max_seq_len: int | None = None,
    layout: RopeLayout | str | None = None,
) -> list[RopeConfig | None]:
    """One RopeConfig per layer of a Hugging Face ``config.json`` dict, None where a layer
    rotates nothing.

    For models whose layers differ: the type of layer ``i`` is ``layer_types[i]`` (or the
    pattern the family's code derives when the list is missing, e.g. Gemma 3's
    ``sliding_window_pattern``), each type takes its own entry of a per-layer-type
    ``rope_parameters`` (a null or missing entry: no RoPE, except in Gemma 3/3n, ModernBERT
    and OLMo 3, whose code fills in the default), ``per_layer_config`` (Gemma 4) sets head
    sizes per layer. Unrotated: SmolLM3's, Llama 4's and Mistral Large 3's
    ``no_rope_layers``; the full-attention layers of Cohere 2, EXAONE 4 (and 4.5), AFMoE,
    Flint and Kolibri 1 (Cohere 2's and Flint's sliding ones too, without a
    ``sliding_window``); layers without attention (``linear_attention`` of Qwen3-Next,
    Qwen3.5, MiniMax, OLMo-Hybrid, Bailing-Hybrid and Bamba, Recurrent Gemma's recurrent
    blocks, LFM2's and LFM3's ``conv``, by ``layer_types`` or the family's default
    pattern). A config without RoPE gives None for every layer. Layers that resolve
    alike share one (equal) config, so :func:`get_rope` gives them one table. A model with
    one RoPE gives the same config for every layer.

    Args:
        config: the parsed ``config.json`` (needs ``num_hidden_layers``).
        max_seq_len, layout: as in :func:`rope_config_from_hf`.

    Raises:
        ValueError: as :func:`rope_config_from_hf`, ``layer_types`` of the wrong length, or
            per-layer-type parameters without ``layer_types`` or a family pattern.
    """
    hf = _HfRope(config)
    if hf.rope_off is not None and config.get("num_hidden_layers") is None:
        raise ValueError(
            f"rope_configs_from_hf_layers: this {hf.model_type} config has no RoPE: "
            f"{hf.rope_off} (and no num_hidden_layers to give each layer None)"
        )
    n_layers = hf._n_layers()
    if hf.rope_off is not None:  # a family without RoPE, or its switch is off
        return [None] * n_layers
    kinds = hf.layer_types
    if kinds is None and hf.per_type is not None:
        raise ValueError(
            "rope_configs_from_hf_layers: the config gives RoPE per layer type "
            f"({', '.join(sorted(hf.per_type))}) but no layer_types to say which layer is which"
        )
    if kinds is not None and len(kinds) != n_layers:
        raise ValueError(
            f"rope_configs_from_hf_layers: layer_types has {len(kinds)} entries for "
            f"{n_layers} num_hidden_layers"
        )
    made: dict[Any, RopeConfig | None] = {}
    result: list[RopeConfig | None] = []
    for index in range(n_layers):
        kind = kinds[index] if kinds is not None else None
        layer_type = None if hf.per_type is None else kind  # None: one RoPE for every type
        heads = hf.overrides(index, kind)
        rotates = hf.uses_rope(index, kind) and (hf.per_type is None or kind in hf.per_type)
        key = (layer_type, tuple(sorted(heads.items())), rotates)
        if key not in made:
            params = hf.parameters(layer_type) if rotates else None
            made[key] = None if params is None else hf.build(params, heads, max_seq_len, layout)
        result.append(made[key])
    return result
