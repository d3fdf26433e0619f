"""Hugging Face Llama checkpoints: config and tensor-name mapping, reading and writing safetensors.

A Hugging Face ``LlamaForCausalLM`` (or ``MistralForCausalLM``, ``Qwen2ForCausalLM`` or
``Qwen3ForCausalLM``, without an effective sliding window) directory holds ``config.json`` and ``model.safetensors`` (or a sharded
``model.safetensors.index.json`` plus its shards). This module turns the config into a
:class:`~mila_py.models.LlamaConfig` and the tensors into the names of mila_py's
component tree::

    model.embed_tokens.weight                     -> embed_tokens.weight
    model.layers.{i}.input_layernorm.weight       -> layer{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v}_proj.weight -> layer{i}.self_attn.qkv_proj.weight
                                                      (concatenated along the output axis)
    model.layers.{i}.self_attn.{q,k,v}_proj.bias   -> layer{i}.self_attn.qkv_proj.bias
                                                      (Qwen2; Llama with attention_bias)
    model.layers.{i}.self_attn.o_proj.weight      -> layer{i}.self_attn.o_proj.weight
    model.layers.{i}.self_attn.o_proj.bias        -> layer{i}.self_attn.o_proj.bias
                                                      (Llama, Qwen3 with attention_bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight  -> layer{i}.self_attn.{q,k}_norm.weight (Qwen3)
    model.layers.{i}.post_attention_layernorm.weight -> layer{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight -> layer{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.bias  -> layer{i}.mlp.{gate,up,down}_proj.bias
                                                      (Llama with mlp_bias)
    model.norm.weight                             -> norm.weight
    lm_head.weight                                -> lm_head.weight (absent when tied)

Hugging Face Llama stores Q and K already in the ``rotate_half`` layout (mila_py's
``layout="half"``), so no permutation is applied.

Neither transformers nor torch is needed: the files are read with ``safetensors.numpy``
(``ml_dtypes`` gives NumPy its ``bfloat16``). A load casts each tensor to the model's precision
(a BF16 checkpoint into a BF16 model is copied as it is); :func:`checkpoint_precision` reads
the precision a checkpoint is stored in, which ``Llama.from_pretrained`` defaults to.
:func:`read_hf_checkpoint` widens BF16/FP16 tensors to float32.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes  # also registers numpy's "bfloat16" dtype, which safetensors.numpy needs
import numpy as np

from mila_py.components._layer import is_int
from mila_py.files import atomic_write_all
from mila_py.interop.generation_config import GenerationDefaults
from mila_py.interop.hf_rope import (
    hf_int_problem,
    hf_layer_types_problem,
    hf_real_problem,
    rope_config_from_hf,
)
from mila_py.interop.tokenizer import TOKENIZER_NAME, Tokenizer
from mila_py.models.llama.config import LlamaConfig
from mila_py.models.llama.network import Llama
from mila_py.precision import Precision
from mila_py.rope.config import RopeConfig
from mila_py.rope.scaling import rope_type_name
from mila_py.serialization import (
    open_safetensors,
    read_safetensors,
    readable_on_host,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "checkpoint_precision",
    "eos_token_ids",
    "hf_to_mila",
    "hf_weight_files",
    "llama_config_from_hf",
    "llama_config_to_hf",
    "load_hf_files",
    "load_hf_weights",
    "mila_to_hf",
    "read_hf_checkpoint",
    "read_hf_config",
    "read_hf_tensors",
    "read_text_files",
    "save_hf_checkpoint",
]

#: ``model_type`` values whose checkpoints this module maps (verified against transformers).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# model types whose attention_bias puts biases on Q, K, V and the output projection
_ATTENTION_BIAS_TYPES = ("llama", "qwen3")
# model types whose use_sliding_window is off unless the config says otherwise
_WINDOW_OFF_TYPES = ("qwen2", "qwen3")

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_REQUIRED_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "hidden_dim",
    "max_position_embeddings": "max_seq_len",
}

# Keys read as ints, as real numbers and as bools, beside _REQUIRED_KEYS (ints); a null is
# the key's default where transformers gives one (num_key_value_heads: num_attention_heads)
_OPTIONAL_INT_KEYS = ("num_key_value_heads", "head_dim")
_REAL_KEYS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
_BOOL_KEYS = ("tie_word_embeddings", "mlp_bias", "attention_bias")

# Buffers some older transformers versions saved; they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

# Per-layer HF name (under "model.layers.{i}.") -> mila name (under "layer{i}.").
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_QKV = ("self_attn.q_proj.{}", "self_attn.k_proj.{}", "self_attn.v_proj.{}")
_QKV_MILA = "self_attn.qkv_proj.{}"


# ---------------------------------------------------------------------------------------- config
def llama_config_from_hf(config: Mapping[str, Any], *, context: int | None = None) -> LlamaConfig:
    """Make a :class:`LlamaConfig` from a Hugging Face ``config.json`` dict.

    Maps ``vocab_size``, ``hidden_size`` -> ``dim``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` -> ``hidden_dim``,
    ``max_position_embeddings`` -> ``max_seq_len``, ``rms_norm_eps`` -> ``norm_eps`` (HF default
    1e-6), ``tie_word_embeddings`` -> ``tie_embeddings`` (default False) and ``head_dim``. RoPE
    (``rope_theta``, ``rope_parameters`` or legacy ``rope_scaling``) goes through
    :func:`rope_config_from_hf`, so every scaling type maps the same way as there.

    Attention biases: ``qwen2`` checkpoints have them on Q, K and V (``qkv_bias``); a ``llama``
    or ``qwen3`` config's ``attention_bias`` puts them on Q, K, V and the output projection
    (``qkv_bias`` and ``out_bias``). ``qwen3`` checkpoints RMS-normalize each head of Q and K
    (``qk_norm``, with ``rms_norm_eps``). ``pretraining_tp`` is ignored, as transformers 5 does (in 4.x it only
    split the matmuls into slices, the same arithmetic).

    Raises:
        ValueError: naming every key that is missing or that mila_py's Llama cannot express:
            ``model_type`` other than llama/mistral/qwen2/qwen3, ``mlp_bias`` outside llama
            configs, ``attention_bias`` outside llama and qwen3 configs,
            ``hidden_act`` other than silu, ``partial_rotary_factor`` < 1, an effective
            ``sliding_window``, ``layer_types`` other than full attention,
            ``quantization_config``; and every key of the wrong type: an int key (sizes,
            ``sliding_window``, ``max_window_layers``) that is a float (a whole one too), a str
            or a bool; a real one (``rms_norm_eps``, ``rope_theta``, ``partial_rotary_factor``)
            that is a str, a bool, NaN or infinite; a bool one (``tie_word_embeddings``,
            ``attention_bias``, ``mlp_bias``, ``use_sliding_window``) that is not a bool;
            ``layer_types`` that is not a list of transformers' layer types or (where read)
            has not one entry per layer; a ``text_config`` that is not a dict. YaRN's ``mscale``/``mscale_all_dim`` are accepted: their
            attention factor is folded into cos/sin and, as in HF Llama, the softmax scale stays
            ``1/sqrt(head_dim)``.

    ``context``: the longest context the model will be built for (default
    ``max_position_embeddings``); a sliding window that covers it never binds, so it is
    accepted (Mistral-7B-v0.1's window of 4096 with builds of ``seq_len <= 4096``). Builds
    longer than ``context`` would then attend past the window: keep them within it.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"llama_config_from_hf: config must be a dict, got {type(config).__name__}")
    problems: list[str] = []
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(
            f"model_type={model_type!r}: only {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints are "
            "supported"
        )
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    problems += [
        f"{key}: missing (needed for LlamaConfig.{_REQUIRED_KEYS[key]})" for key in missing
    ]
    mistyped = _type_problems(config)
    problems += mistyped
    mlp_bias = bool(config.get("mlp_bias", False))
    if mlp_bias and model_type != "llama":
        problems.append(
            f"mlp_bias=True: {model_type} models do not read it (only llama configs do)"
        )
    attention_bias = bool(config.get("attention_bias", False))
    if attention_bias and model_type not in _ATTENTION_BIAS_TYPES:
        problems.append(
            f"attention_bias=True: {model_type} models do not read it (only "
            f"{'/'.join(_ATTENTION_BIAS_TYPES)} configs do)"
        )
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r}: mila_py's SwiGLU uses silu")
    if config.get("quantization_config") is not None:
        problems.append("quantization_config: quantized checkpoints are not supported")
    # Qwen2/Qwen3 take their layers' attention from layer_types when it is there; Mistral
    # ignores it and slides on every layer (a malformed list is refused all the same)
    layer_types = config.get("layer_types")
    n_layers = config.get("num_hidden_layers")
    layer_problem = hf_layer_types_problem(layer_types)
    if layer_problem is not None:
        mistyped.append(layer_problem)
        problems.append(layer_problem)
    elif model_type == "mistral" or not layer_types:
        problems += _sliding_window_problems(config, model_type, context)
    elif any(t != "full_attention" for t in layer_types):
        problems.append(f"layer_types={sorted(set(layer_types))}: only full_attention is supported")
    elif is_int(n_layers) and len(layer_types) != n_layers:
        problems.append(
            f"layer_types: {len(layer_types)} entries for num_hidden_layers={n_layers} "
            "(one per layer)"
        )

    rope: RopeConfig | None = None
    if not missing and not mistyped:  # rope_config_from_hf reads the same keys
        try:
            rope = rope_config_from_hf(config)
        except (ValueError, TypeError) as exc:
            # transformers reads a rope_scaling over a rope_parameters, as rope_config_from_hf does
            key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
            problems.append(f"{key}: {exc}")
    if rope is not None and rope.rotary_dim:
        prf = (config.get("rope_scaling") or config.get("rope_parameters") or {}).get(
            "partial_rotary_factor", config.get("partial_rotary_factor")
        )
        problems.append(
            f"partial_rotary_factor={prf}: mila_py's Llama rotates the whole head "
            f"({rope.rotary_dim} of {rope.head_dim} channels requested)"
        )
    if problems:
        raise ValueError(
            "llama_config_from_hf: this config cannot be loaded as a mila_py Llama:\n  "
            + "\n  ".join(problems)
        )
    assert rope is not None
    n_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim: int | None = rope.head_dim  # Qwen3's missing head_dim is its class's 128
    if hidden % n_heads == 0 and head_dim == hidden // n_heads:
        head_dim = None
    return LlamaConfig(
        vocab_size=int(config["vocab_size"]),
        dim=hidden,
        n_layers=int(config["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        hidden_dim=int(config["intermediate_size"]),
        max_seq_len=int(config["max_position_embeddings"]),
        rope_base=float(rope.base),
        rope_scaling=rope.scaling,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=None if head_dim is None else int(head_dim),
        qkv_bias=model_type == "qwen2" or attention_bias,
        out_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        mlp_bias=mlp_bias,
    )


def _type_problems(config: Mapping[str, Any]) -> list[str]:
    """The keys ``llama_config_from_hf`` reads whose values have the wrong type: ints that are
    not ints (``int()`` would truncate ``2.7`` or read ``"32"``; a whole float is refused too),
    real numbers that are bools, strings, NaN or infinite, bools that are not bools (``"false"``
    would read as true), a ``text_config`` that is not a dict. A null is the key's default,
    except ``rms_norm_eps``'s."""
    problems: list[str] = []
    for key in (*_REQUIRED_KEYS, *_OPTIONAL_INT_KEYS):
        value = config.get(key)
        problem = None if value is None else hf_int_problem(key, value)
        if problem is not None:
            problems.append(problem)
    for key in _REAL_KEYS:
        if key not in config or (config[key] is None and key != "rms_norm_eps"):
            continue
        problem = hf_real_problem(key, config[key])
        if problem is not None:
            problems.append(problem)
    for key in _BOOL_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool | np.bool_):
            problems.append(
                f"{key} must be a bool (true or false), got {value!r} ({type(value).__name__})"
            )
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        problems.append(f"text_config must be a dict (the text model's config), got {text!r}")
    return problems


def _sliding_window_problems(
    config: Mapping[str, Any], model_type: Any, context: int | None = None
) -> list[str]:
    """The sliding window a config without ``layer_types`` gets in transformers, if it is
    shorter than the context (``context``, else ``max_position_embeddings``): Mistral slides
    on every layer (window 4096 when the key is absent); Qwen2/Qwen3 only with
    ``use_sliding_window``, on the layers from ``max_window_layers`` (28) on. The keys it reads
    of the wrong type are problems too (then no window is worked out)."""
    if model_type not in ("mistral", *_WINDOW_OFF_TYPES):
        return []  # Llama reads no sliding_window key
    window = config.get("sliding_window", 4096)
    n_layers, max_pos = config.get("num_hidden_layers"), config.get("max_position_embeddings")
    typed = [] if window is None else [hf_int_problem("sliding_window", window)]
    if model_type in _WINDOW_OFF_TYPES:
        first, use = config.get("max_window_layers", 28), config.get("use_sliding_window", False)
        if first is not None or use:  # read only when the layers may slide
            typed.append(hf_int_problem("max_window_layers", first))
        if use is not None and not isinstance(use, bool | np.bool_):
            typed.append(
                f"use_sliding_window must be a bool (true or false), got {use!r} "
                f"({type(use).__name__})"
            )
    problems = [p for p in typed if p is not None]
    if problems or not all(is_int(v) for v in (n_layers, max_pos) if v is not None):
        return problems  # the mistyped sizes are problems of their own
    sliding = True
    if model_type in _WINDOW_OFF_TYPES:
        sliding = bool(use) and (n_layers is None or int(first) < int(n_layers))
    limit = max_pos if context is None else context
    if window is None or not sliding or (limit is not None and int(window) >= int(limit)):
        return []
    what = f"max_position_embeddings={max_pos}" if context is None else f"the context {context}"
    return [
        f"sliding_window={window}: mila_py's attention is full causal attention (accepted only "
        f"when the window covers {what}; a shorter seq_len= can make it so)"
    ]


#: the RoPE types transformers' Llama-family models read (its ``ROPE_INIT_FUNCTIONS``)
_HF_ROPE_TYPES = frozenset(
    {"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"}
)


def _check_hf_scaling(cfg: LlamaConfig) -> None:
    """Refuse a RoPE scaling a transformers model would compute differently."""
    if not cfg.rope_scaling:
        return
    name = rope_type_name(cfg.rope_scaling)
    if name not in _HF_ROPE_TYPES:
        raise ValueError(
            f"llama_config_to_hf: rope_type {name!r} is not one transformers reads "
            f"({', '.join(sorted(_HF_ROPE_TYPES))}); the checkpoint would not load"
        )
    original = cfg.rope_scaling.get("original_max_position_embeddings")
    if name == "dynamic" and original != cfg.max_seq_len:
        raise ValueError(
            f"llama_config_to_hf: dynamic RoPE from original_max_position_embeddings "
            f"{original}: transformers 5 scales it from max_position_embeddings "
            f"({cfg.max_seq_len}), so the checkpoint would compute other logits; build with "
            f"max_seq_len={original}, or use another scaling"
        )


def llama_config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict describing ``cfg``: ``Qwen3ForCausalLM`` with Q/K head
    norms, else ``Qwen2ForCausalLM`` when only the QKV projection has a bias, else
    ``LlamaForCausalLM``.

    The RoPE parameters are written both as transformers 5 ``rope_parameters`` and as the
    ``rope_theta`` / ``rope_scaling`` keys that 4.x reads.

    Raises:
        ValueError: a combination no transformers model has: an output-projection bias without
            a QKV bias, or Q/K head norms with a QKV bias only; a RoPE scaling transformers
            would read differently: a type it does not have (``ntk_alpha``), or a ``dynamic``
            whose ``original_max_position_embeddings`` is not ``max_seq_len`` (transformers 5
            scales dynamic RoPE from ``max_position_embeddings``).
    """
    if cfg.out_bias and not cfg.qkv_bias:
        raise ValueError(
            "llama_config_to_hf: out_bias without qkv_bias has no Hugging Face model "
            "(Llama's attention_bias is both, Qwen2's is QKV only)"
        )
    if cfg.mlp_bias and (cfg.qk_norm or cfg.qkv_bias != cfg.out_bias):
        raise ValueError(
            "llama_config_to_hf: mlp_bias is a Llama option; Llama has no Q/K norms and its "
            "attention_bias is on Q, K, V and the output projection together"
        )
    if cfg.qk_norm and cfg.qkv_bias != cfg.out_bias:
        raise ValueError(
            "llama_config_to_hf: qk_norm with a QKV bias only has no Hugging Face model "
            "(Qwen3's attention_bias is on Q, K, V and the output projection)"
        )
    _check_hf_scaling(cfg)
    model_type = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias != cfg.out_bias else "llama"
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    scaling = _plain(dict(cfg.rope_scaling)) if cfg.rope_scaling else None
    if scaling is not None:  # the legacy "type" key written as transformers 5 names it
        scaling = {"rope_type": rope_type_name(scaling), **scaling}
        scaling.pop("type", None)
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_base}
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "mlp_bias": cfg.mlp_bias,
        "rope_theta": cfg.rope_base,
        "rope_parameters": rope_parameters,
    }
    if model_type in _WINDOW_OFF_TYPES:
        out["use_sliding_window"] = False
    if model_type in _ATTENTION_BIAS_TYPES:
        out["attention_bias"] = cfg.out_bias
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _plain(value: Any) -> Any:
    """FrozenDict/tuples -> dicts/lists (JSON-serializable)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------- names
def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name (with the ``model.`` prefix) and its shape, in model order."""
    d, v, f = cfg.dim, cfg.vocab_size, cfg.hidden_dim
    hd = cfg.head_dim or d // cfg.n_heads
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv, d)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (f, d)
        shapes[p + "mlp.up_proj.weight"] = (f, d)
        shapes[p + "mlp.down_proj.weight"] = (d, f)
        if cfg.mlp_bias:
            shapes[p + "mlp.gate_proj.bias"] = (f,)
            shapes[p + "mlp.up_proj.bias"] = (f,)
            shapes[p + "mlp.down_proj.bias"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _mila_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every mila parameter name and its shape, in ``Llama.named_parameters()`` order."""
    hf = _hf_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for name, mila in _name_pairs(cfg):
        if isinstance(name, tuple):  # Q, K and V stacked along the output axis
            rows = sum(hf[n][0] for n in name)
            out[mila] = (rows, *hf[name[0]][1:])
        else:
            out[mila] = hf[name]
    return out


def _name_pairs(cfg: LlamaConfig) -> Iterator[tuple[str | tuple[str, str, str], str]]:
    """(HF name or (q, k, v) names, mila name) in mila's parameter order."""
    yield "model.embed_tokens.weight", "embed_tokens.weight"
    for i in range(cfg.n_layers):
        hp, mp = f"model.layers.{i}.", f"layer{i}."
        yield hp + "input_layernorm.weight", mp + "input_layernorm.weight"
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            q, k, v = (hp + name.format(kind) for name in _QKV)
            yield (q, k, v), mp + _QKV_MILA.format(kind)
        if cfg.qk_norm:
            for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                yield hp + norm, mp + norm
        for hf_name, mila_name in _LAYER_DIRECT.items():
            if hf_name != "input_layernorm.weight":
                yield hp + hf_name, mp + mila_name
            biased = cfg.out_bias if hf_name.startswith("self_attn.") else cfg.mlp_bias
            if hf_name.endswith("_proj.weight") and biased:
                bias = hf_name.removesuffix("weight") + "bias"
                yield hp + bias, mp + bias
    yield "model.norm.weight", "norm.weight"
    if not cfg.tie_embeddings:
        yield "lm_head.weight", "lm_head.weight"


def _check(
    tensors: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], problems: list[str]
) -> None:
    problems += [
        f"missing: {name} {shape}" for name, shape in expected.items() if name not in tensors
    ]
    problems += [f"unexpected: {name}" for name in tensors if name not in expected]
    problems += [
        f"shape of {name}: got {tuple(np.shape(tensors[name]))}, expected {shape}"
        for name, shape in expected.items()
        if name in tensors and tuple(np.shape(tensors[name])) != shape
    ]


def _match(
    tensors: Mapping[str, Any], cfg: LlamaConfig, same: Callable[[Any, Any], bool]
) -> tuple[dict[str, Any], list[str]]:
    """``tensors`` (anything with a ``shape``) by full HF name, and every problem of names and
    shapes: the ``model.`` prefix added, ignored buffers dropped, a tied ``lm_head.weight``
    dropped when ``same`` finds it equal to the embedding (or taken as the embedding, when
    stored alone)."""
    problems: list[str] = []
    named: dict[str, Any] = {}
    for name, array in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        full = name if name.startswith("model.") or name == "lm_head.weight" else "model." + name
        if full in named:
            problems.append(f"duplicate: {name} (given with and without the 'model.' prefix)")
            continue
        named[full] = array
    if cfg.tie_embeddings and "lm_head.weight" in named:
        head = named.pop("lm_head.weight")
        embed = named.setdefault("model.embed_tokens.weight", head)  # tied: either names both
        if head is not embed and (np.shape(head) != np.shape(embed) or not same(head, embed)):
            problems.append(
                "unexpected: lm_head.weight differs from model.embed_tokens.weight but the "
                "config ties them (tie_word_embeddings=true)"
            )
    _check(named, _hf_shapes(cfg), problems)
    return named, problems


def hf_to_mila(tensors: Mapping[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Rename (and fuse Q/K/V of) Hugging Face Llama tensors into mila_py parameter names.

    Names may carry the ``model.`` prefix (``LlamaForCausalLM``) or not (a bare ``LlamaModel``).
    ``*.rotary_emb.inv_freq`` buffers are ignored. With ``cfg.tie_embeddings`` a
    ``lm_head.weight`` equal to the embedding is dropped, and one stored alone is the embedding
    (as transformers ties them on load). Arrays keep their dtype.

    Returns:
        ``{mila name: array}`` in ``Llama.named_parameters()`` order.

    Raises:
        ValueError: listing every missing, unexpected or mis-shaped tensor (nothing is returned).
    """
    named, problems = _match(tensors, cfg, np.array_equal)
    if problems:
        raise ValueError(
            "hf_to_mila: the tensors do not match the Llama config:\n  " + "\n  ".join(problems)
        )
    out: dict[str, np.ndarray] = {}
    for hf_name, mila_name in _name_pairs(cfg):
        if isinstance(hf_name, tuple):
            out[mila_name] = np.concatenate([np.asarray(named[n]) for n in hf_name], axis=0)
        else:
            out[mila_name] = np.asarray(named[hf_name])
    return out


def mila_to_hf(tensors: Mapping[str, Any], cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """The inverse of :func:`hf_to_mila`: mila_py names -> ``LlamaForCausalLM`` names.

    ``qkv_proj.weight`` is split into ``q_proj``, ``k_proj`` and ``v_proj``; no ``lm_head.weight``
    is written for tied embeddings (as ``save_pretrained`` does). Arrays are on the host: a CuPy
    array comes through ``.get()``, a NumPy one is passed on as it is (Q, K and V split off as
    copies); nothing is written into ``tensors``.

    Raises:
        ValueError: listing every missing, unexpected or mis-shaped tensor.
    """
    problems: list[str] = []
    _check(tensors, _mila_shapes(cfg), problems)
    if problems:
        raise ValueError(
            "mila_to_hf: the tensors do not match the Llama config:\n  " + "\n  ".join(problems)
        )
    hd = cfg.head_dim or cfg.dim // cfg.n_heads
    q_rows, kv_rows = cfg.n_heads * hd, cfg.n_kv_heads * hd
    out: dict[str, np.ndarray] = {}
    for hf_name, mila_name in _name_pairs(cfg):
        array = _host(tensors[mila_name])
        if isinstance(hf_name, tuple):
            q_name, k_name, v_name = hf_name
            out[q_name] = array[:q_rows].copy()
            out[k_name] = array[q_rows : q_rows + kv_rows].copy()
            out[v_name] = array[q_rows + kv_rows :].copy()
        else:
            out[hf_name] = array
    return out


def _host(array: Any) -> np.ndarray:
    get = getattr(array, "get", None)
    if get is not None and not isinstance(array, np.ndarray):
        array = get()
    return np.asarray(array)


# ---------------------------------------------------------------------------------------- files
def _widen(array: np.ndarray) -> np.ndarray:
    if array.dtype in (np.float16, np.dtype(ml_dtypes.bfloat16)):
        return array.astype(np.float32)
    return array


def eos_token_ids(path: str | os.PathLike[str]) -> list[int] | None:
    """The EOS ids that ``transformers.generate`` stops at for the checkpoint folder ``path``:
    ``eos_token_id`` of its ``generation_config.json`` when there is one (often several ids, as
    for chat models), else of its ``config.json``; None when neither names any. Pass them to
    :meth:`Llama.generate`'s ``eos_token_id``. :class:`~mila_py.interop.GenerationDefaults`
    reads the rest of the generation defaults.

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: an ``eos_token_id`` that is not an int or a list of ints.
    """
    root = Path(path)
    if not (root / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"eos_token_ids: {root} has no {CONFIG_NAME}")
    try:
        ids = GenerationDefaults.from_pretrained(root).eos_token_ids
    except ValueError as exc:
        raise ValueError(f"eos_token_ids: {exc}") from exc
    return list(ids) or None


def read_text_files(
    path: str | os.PathLike[str],
) -> tuple[Tokenizer | None, GenerationDefaults]:
    """What :meth:`Llama.from_pretrained` reads beside the weights of the checkpoint folder
    ``path``: its tokenizer (``tokenizer.json`` and ``tokenizer_config.json``; None where there
    is no ``tokenizer.json``) and its generation defaults (``generation_config.json``, with
    ``config.json`` for the ids it does not name).

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: a tokenizer or generation file that does not parse (the message names it).
    """
    root = Path(path)
    if not (root / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"read_text_files: {root} has no {CONFIG_NAME}")
    tokenizer = Tokenizer.from_pretrained(root) if (root / TOKENIZER_NAME).is_file() else None
    return tokenizer, GenerationDefaults.from_pretrained(root)


#: ``torch_dtype`` / ``dtype`` values of ``config.json`` and safetensors dtypes -> precisions
_CONFIG_DTYPES = {
    "float32": Precision.FP32,
    "float": Precision.FP32,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "bfloat16": Precision.BF16,
    "float64": Precision.FP64,
    "double": Precision.FP64,
}
_FILE_DTYPES = {
    "F32": Precision.FP32,
    "F16": Precision.FP16,
    "BF16": Precision.BF16,
    "F64": Precision.FP64,
}


def checkpoint_precision(
    config: Mapping[str, Any], files: list[tuple[Path, list[str] | None]]
) -> Precision:
    """The precision a checkpoint is stored in: ``config.json``'s ``dtype`` (transformers 5)
    or ``torch_dtype`` (4.x), as ``"bfloat16"``, ``"float16"``, ``"float32"`` or
    ``"torch.bfloat16"``; where neither names a float type (absent, ``"auto"``), the dtype of
    the first float tensor in the weight files' headers (nothing is read beyond them); FP32
    when there is none.

    Args:
        config: the ``config.json`` dict (a ``text_config`` inside it is looked at too).
        files: :func:`hf_weight_files`' list.
    """
    for where in (config, config.get("text_config")):
        if not isinstance(where, Mapping):
            continue
        for key in ("dtype", "torch_dtype"):
            value = where.get(key)
            if isinstance(value, str):
                found = _CONFIG_DTYPES.get(value.strip().lower().removeprefix("torch."))
                if found is not None:
                    return found
    for file, names in files:
        with open_safetensors(file, "checkpoint_precision") as f:
            for name in f.keys() if names is None else names:
                found = _FILE_DTYPES.get(f.get_slice(name).get_dtype())
                if found is not None:
                    return found
    return Precision.FP32


def _read_json(file: Path, who: str) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{who}: {file} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{who}: {file} holds a {type(value).__name__}, not a JSON object")
    return value


def _checkpoint_root(path: str | os.PathLike[str], who: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{who}: {root} is not a directory (expected a Hugging Face checkpoint folder with "
            f"{CONFIG_NAME} and {WEIGHTS_NAME} or {INDEX_NAME})"
        )
    if not (root / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{who}: {root} has no {CONFIG_NAME}")
    return root


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint folder (no weights are read).

    Raises:
        FileNotFoundError: the folder or its ``config.json`` is missing.
        ValueError: ``config.json`` is not a JSON object.
    """
    return _read_json(_checkpoint_root(path, "read_hf_config") / CONFIG_NAME, "read_hf_config")


def hf_weight_files(path: str | os.PathLike[str]) -> list[tuple[Path, list[str] | None]]:
    """The safetensors files of a checkpoint folder and the tensors to take from each (None:
    all of them), checked without reading any tensor: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json`` (a stale ``model.safetensors`` beside an index wins, as in
    transformers).

    Every weight file must lie inside the folder: an index entry naming an absolute path or
    a path with a ``..`` part, or a file that is a link resolving outside the folder, is
    refused before any file is opened. (One exception: a snapshot folder of the Hugging Face
    hub cache, ``<repo>/snapshots/<revision>/``, holds links into ``<repo>/blobs/``, which
    are followed.)

    Raises:
        FileNotFoundError: no weights, or shards the index names that are not there.
        ValueError: an index that is not ``{"weight_map": {name: shard}}``, weight files
            outside the folder (each index entry named: tensor and shard), shards that are
            not safetensors or lack tensors the index maps to them (every one listed at once).
    """
    who = "read_hf_checkpoint"
    root = _checkpoint_root(path, who)
    single, index = root / WEIGHTS_NAME, root / INDEX_NAME
    by_shard: dict[str, list[str] | None] = {}
    if single.is_file():
        by_shard[WEIGHTS_NAME] = None
    elif not index.is_file():
        raise FileNotFoundError(
            f"{who}: {root} has neither {WEIGHTS_NAME} nor {INDEX_NAME} "
            "(PyTorch .bin checkpoints are not supported; re-save with safe_serialization=True)"
        )
    else:
        weight_map = _read_json(index, who).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{who}: {index} has no weight_map of tensor names to shard files")
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)  # type: ignore[union-attr]
    _check_contained(root, by_shard, who)
    missing = [s for s in by_shard if not (root / s).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{who}: {INDEX_NAME} names shards that are not in {root}: "
            + ", ".join(sorted(missing))
        )
    problems = []
    for shard, names in by_shard.items():
        try:
            with open_safetensors(root / shard, who) as f:
                available = set(f.keys())
        except ValueError as exc:
            problems.append(str(exc))
            continue
        absent = [n for n in names or () if n not in available]
        if absent:
            problems.append(
                f"{who}: {root / shard} lacks tensors the index maps to it: {', '.join(absent)}"
            )
    if problems:
        raise ValueError("; ".join(problems))
    return [(root / shard, names) for shard, names in by_shard.items()]


def _check_contained(root: Path, by_shard: Mapping[str, list[str] | None], who: str) -> None:
    """Refuse weight files that are not inside ``root`` (an index from elsewhere must not make
    a load read ``/proc/self/environ`` or another folder's files).

    Raises:
        ValueError: naming every such file, with the tensors the index maps to it.
    """
    real_root = root.resolve()
    # the hub cache keeps a snapshot's files as links to ../../blobs/<hash>
    blobs = real_root.parent.parent / "blobs" if real_root.parent.name == "snapshots" else None
    problems = []
    for shard, names in by_shard.items():
        if os.path.isabs(shard) or shard.startswith(("/", "\\")):
            why = "an absolute path"
        elif ".." in Path(shard).parts or ".." in shard.split("\\"):
            why = "a path with '..' in it"
        else:
            real = (root / shard).resolve()
            if real.is_relative_to(real_root) or (blobs is not None and real.parent == blobs):
                continue
            why = f"a link to {real}, outside the folder"
        if names is None:
            problems.append(f"{shard!r} is {why}")
        else:
            shown = ", ".join(repr(n) for n in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            problems.append(f"tensor {shown}{more} -> shard {shard!r}: {why}")
    if problems:
        raise ValueError(
            f"{who}: {root} names weight files outside the checkpoint folder (refused before "
            "opening anything):\n  " + "\n  ".join(problems)
        )


def read_hf_tensors(
    files: list[tuple[Path, list[str] | None]],
) -> dict[str, np.ndarray]:
    """``{HF name: array}`` of :func:`hf_weight_files`'s list; BF16 and FP16 tensors are
    widened to float32 one at a time."""
    tensors: dict[str, np.ndarray] = {}
    for file, names in files:
        tensors.update(read_safetensors(file, "read_hf_checkpoint", names, _widen))
    return tensors


def read_hf_checkpoint(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a Hugging Face checkpoint directory.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``, or with
            ``model.safetensors.index.json`` and the shards it names.

    Returns:
        ``(config dict, {HF name: array})``; BF16 and FP16 tensors are widened to float32.

    Raises:
        FileNotFoundError: the directory, its ``config.json``, or its weights are missing.
        ValueError: files that do not parse, or shards that lack tensors their index names
            (see :func:`hf_weight_files`).
    """
    config = read_hf_config(path)
    return config, read_hf_tensors(hf_weight_files(path))


def save_hf_checkpoint(
    model: Llama, path: str | os.PathLike[str], *, precision: Precision | str | None = None
) -> None:
    """Write a built :class:`Llama` as a Hugging Face checkpoint directory: float32 weights
    for FP32 and FP64 models, BF16 / FP16 weights for models of those precisions (their
    ``config.json`` names the dtype, which ``from_pretrained`` then defaults to), or the
    weights in ``precision`` where given (``"bf16"``, ``Precision.FP32``, ...; FP64 writes
    float32; rounded to nearest even where narrower).

    ``path`` gets ``config.json`` (see :func:`llama_config_to_hf`) and ``model.safetensors``
    that ``AutoModelForCausalLM.from_pretrained`` loads. All or nothing: both files are
    written to temporary files first and renamed into place only when both are whole, the
    weights first and ``config.json`` last, so a failed save leaves a checkpoint already in
    ``path`` as it was (other files in the folder are left alone).

    Raises:
        TypeError: ``model`` is not a Llama.
        RuntimeError: ``model`` is not built.
        ValueError: a config no Hugging Face model has, or an unknown ``precision`` (nothing
            is written).
        OSError: ``"save_hf_checkpoint: cannot write <file> (...)"``: the folder or a file
            cannot be written; the folder's files are then as they were.
    """
    from safetensors.numpy import save_file

    who = "save_hf_checkpoint"
    if not isinstance(model, Llama):
        raise TypeError(f"{who}(model, path): model must be a Llama, got {type(model).__name__}")
    if not model.is_built:
        raise RuntimeError(f"{model._describe()}: build it before save_hf_checkpoint()")
    config = llama_config_to_hf(model.config)  # refused before anything is written
    try:
        written = Precision.parse(model.precision if precision is None else precision)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{who}: precision: {exc}") from None
    dtype = written.numpy_dtype if written.is_reduced else np.dtype(np.float32)
    config["torch_dtype"] = config["dtype"] = _TORCH_NAMES[np.dtype(dtype)]
    config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    ctx = model.execution_context
    params = {name: readable_on_host(ctx, p) for name, p in model.named_parameters()}
    tensors = {
        k: np.ascontiguousarray(v, dtype=dtype) for k, v in mila_to_hf(params, model.config).items()
    }
    root = Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"{who}: cannot write {root} ({type(exc).__name__}: {exc})") from exc
    atomic_write_all(
        [
            (
                root / WEIGHTS_NAME,
                lambda tmp: save_file(tensors, os.fspath(tmp), metadata={"format": "pt"}),
            ),
            (root / CONFIG_NAME, lambda tmp: tmp.write_text(config_text, encoding="utf-8")),
        ],
        who=who,
    )


#: the dtype names transformers writes in config.json
_TORCH_NAMES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
}


def load_hf_weights(model: Llama, tensors: Mapping[str, Any]) -> None:
    """Copy Hugging Face-named tensors into a built :class:`Llama`'s parameters.

    All or nothing: every missing, unexpected or mis-shaped tensor (and any non-float one) is
    reported in one error, and then no parameter has changed. Values are cast to the model's
    precision.

    Raises:
        RuntimeError: the model is not built.
        ValueError: listing every problem.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"load_hf_weights: model must be a Llama, got {type(model).__name__}")
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"load_hf_weights: tensors must be a mapping of HF names to arrays, got "
            f"{type(tensors).__name__} (a checkpoint folder: read_hf_checkpoint(path), or "
            "Llama.from_pretrained(path))"
        )
    if not model.is_built:
        raise RuntimeError(f"{model._describe()}: build it before load_hf_weights()")
    ctx = model.execution_context
    entries = {name: _array_entry(ctx, value) for name, value in tensors.items()}
    _load_entries(model, entries, "cannot load the Hugging Face weights")


def load_hf_files(model: Llama, files: list[tuple[Path, list[str] | None]]) -> None:
    """Load the safetensors files of :func:`hf_weight_files` into a built :class:`Llama`, one
    tensor at a time: what a load holds beyond the model's parameters is about one tensor
    (Q, K and V are copied into their rows of the fused QKV parameter, never concatenated).

    All or nothing: the files' headers are checked first, and every missing, unexpected,
    mis-shaped or non-float tensor is reported in one error before any tensor is read. Values
    are cast to the model's precision.

    Raises:
        RuntimeError: the model is not built.
        ValueError: listing every problem; files that are not safetensors.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"load_hf_files: model must be a Llama, got {type(model).__name__}")
    if not model.is_built:
        raise RuntimeError(f"{model._describe()}: build it before load_hf_files()")
    with contextlib.ExitStack() as stack:
        entries: dict[str, _Entry] = {}
        for file, names in files:
            f = stack.enter_context(open_safetensors(file, "read_hf_checkpoint"))
            for name in f.keys() if names is None else names:
                entries[name] = _file_entry(f, name)
        folder = files[0][0].parent if files else "the checkpoint"
        _load_entries(model, entries, f"cannot load the Hugging Face weights of {folder}")


@dataclass(frozen=True)
class _Entry:
    """A checkpoint tensor before it is read: its shape and dtype (a safetensors or NumPy
    name), whether NumPy reads it as floats, and how to read it whole or by leading rows."""

    shape: tuple[int, ...]
    dtype: str
    floating: bool
    read: Callable[[], Any]
    rows: Callable[[int, int], Any]


#: safetensors float types NumPy reads (with ml_dtypes' bfloat16)
_FLOAT_TYPES = frozenset({"F64", "F32", "F16", "BF16"})


def _file_entry(f: Any, name: str) -> _Entry:
    header = f.get_slice(name)  # the header's record only: nothing is read yet
    dtype = header.get_dtype()
    return _Entry(
        tuple(header.get_shape()),
        dtype,
        dtype in _FLOAT_TYPES,
        lambda: f.get_tensor(name),
        lambda start, stop: f.get_slice(name)[start:stop],
    )


def _array_entry(ctx: Any, value: Any) -> _Entry:
    array = value if ctx.is_device_array(value) else np.asarray(value)
    dtype = np.dtype(array.dtype)
    floating = bool(np.issubdtype(dtype, np.floating)) or dtype == ml_dtypes.bfloat16
    return _Entry(
        tuple(array.shape),
        str(dtype),
        floating,
        lambda: array,
        lambda start, stop: array[start:stop],
    )


#: bytes of each of two tensors compared at a time (a tied head stored beside its embedding)
_COMPARE_BYTES = 1 << 24


def _same_entries(a: _Entry, b: _Entry) -> bool:
    """Equal values, compared a block of rows at a time (never two whole tensors at once)."""
    if not a.shape:
        return bool(np.array_equal(_host(a.read()), _host(b.read())))
    n = a.shape[0]
    row = max(1, int(np.prod(a.shape[1:])) * 8)  # bytes of a row, at most
    step = max(1, _COMPARE_BYTES // row)
    return all(  # (a file's slices do not stop at the end as NumPy's do)
        np.array_equal(_host(a.rows(i, min(i + step, n))), _host(b.rows(i, min(i + step, n))))
        for i in range(0, n, step)
    )


def _load_entries(model: Llama, entries: Mapping[str, _Entry], what: str) -> None:
    """Check ``entries`` against the model (every problem at once, nothing loaded), then read
    each and copy it into its parameter (or its rows of the fused QKV parameter)."""
    cfg = model.config
    named, problems = _match(entries, cfg, _same_entries)
    expected = _hf_shapes(cfg)
    for name, entry in named.items():
        if name not in expected or entry.floating:
            continue
        if entry.dtype.startswith("F"):  # float8 and the like: floats NumPy has no type for
            problems.append(f"dtype of {name}: {entry.dtype} is a float type NumPy cannot read")
        else:
            problems.append(f"dtype of {name}: {entry.dtype} is not a float type")
    if problems:
        raise ValueError(
            f"{model._describe()}: {what}; nothing was loaded:\n  " + "\n  ".join(problems)
        )
    ctx = model.execution_context
    dtype = model.precision.numpy_dtype
    params = dict(model.named_parameters())
    for hf_name, mila_name in _name_pairs(cfg):
        param = params[mila_name]
        if isinstance(hf_name, tuple):  # Q, K and V: consecutive rows of the fused parameter
            start = 0
            for name in hf_name:
                stop = start + named[name].shape[0]
                _copy_into(ctx, param[start:stop], named[name].read(), dtype)
                start = stop
        else:
            _copy_into(ctx, param, named[hf_name].read(), dtype)


def _copy_into(ctx: Any, dst: Any, value: Any, dtype: Any) -> None:
    """``dst[...] = value`` cast to ``dtype``, the model's precision (``dst`` may carry it in
    another dtype: bfloat16 as ``uint16`` bits on an older CuPy); a host value reaches a GPU's
    ``dst`` through one upload of its own size."""
    if ctx.is_device_array(value):  # NumPy on the CPU: cast as it is copied, no temporary
        dst[...] = value
    else:
        dst[...] = ctx.to_device(np.asarray(value).astype(dtype, copy=False))
