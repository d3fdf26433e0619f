"""RopeConfig: the frozen, validated description of a rotary position embedding."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mila_py.components.rope_scaling import (
    BOOKKEEPING_KEYS,
    RopeType,
    check_scaling,
    check_scaling_values,
    get_rope_type,
    rope_type_name,
)

__all__ = ["FrozenDict", "RopeConfig", "RopeLayout"]


class RopeLayout(enum.StrEnum):
    """Which channels of a head form a rotated pair.

    HALF pairs ``(i, i + d/2)`` (Llama, Mila, GPT-NeoX "rotate_half"); INTERLEAVED pairs
    ``(2i, 2i + 1)`` (GPT-J, Meta's original Llama checkpoints). Named by layout on purpose:
    family names ("neox style") mean opposite things in different libraries.
    """

    HALF = "half"
    INTERLEAVED = "interleaved"


class FrozenDict(Mapping[str, Any]):
    """An immutable, hashable mapping (lists inside become tuples)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = {str(k): _freeze(v) for k, v in data.items()}
        self._hash = hash(tuple(sorted(self._data.items(), key=lambda kv: kv[0])))

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == {k: _freeze(v) for k, v in other.items()}
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._data)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._data.items()}


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _freeze(value.tolist())
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RopeConfig:
    """Configuration of a rotary position embedding.

    Args:
        channels: width of Q, ``n_heads * head_dim``.
        n_heads: query heads.
        n_kv_heads: key heads (``n_kv_heads <= n_heads``; GQA/MQA when smaller).
        max_seq_len: table size: the longest context served (positions ``0..max_seq_len-1``).
        base: the frequency base theta.
        rotary_dim: channels rotated per head, the first ones (0 = the whole head); even. Frequencies
            use exponents over ``rotary_dim`` (the common convention); for Mila's convention, where
            pairs span the whole head and frequencies past the rotated part are zero, use the
            scaling type ``"proportional"``.
        layout: ``"half"`` pairs ``(i, i + d/2)``; ``"interleaved"`` pairs ``(2i, 2i + 1)``.
        scaling: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict with ``rope_type``
            (or legacy ``type``): default, linear, dynamic, yarn, llama3, longrope, proportional or
            any type added with ``register_rope_type``. Its ``mrope_section`` and
            ``mrope_interleaved`` keys (Qwen2-VL, Qwen3-VL, GLM-4V) move to the fields below, and
            Qwen2-VL's legacy ``"type": "mrope"`` reads as ``"default"``, as transformers does.
        mrope_section: multimodal RoPE (M-RoPE): how many of the ``n_freq = rotated_dim // 2``
            frequencies follow each of the three position axes (temporal, height, width); they
            sum to ``n_freq``. Calls then take positions ``[3, B, T]`` (see :meth:`mrope_axes`);
            positions without the axis mean one position on every axis (text tokens).
        mrope_interleaved: Qwen3-VL's assignment of frequencies to axes (``t h w t h w ...``)
            instead of Qwen2-VL's contiguous sections.

    Raises:
        ValueError: on any invalid value, saying what to fix; in the scaling dict, a NaN or
            infinite number anywhere, or a bool or str where a number goes (see
            :func:`~mila_py.components.rope_scaling.check_scaling_values`).
        TypeError: a non-int size or a non-dict scaling.
    """

    channels: int
    n_heads: int
    n_kv_heads: int
    max_seq_len: int
    base: float = 10000.0
    rotary_dim: int = 0
    layout: RopeLayout | str = RopeLayout.HALF
    scaling: Mapping[str, Any] | None = None
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "layout", RopeLayout(self.layout))
        except ValueError:
            raise ValueError(
                f"RopeConfig: layout must be 'half' (pairs i, i+d/2) or 'interleaved' "
                f"(pairs 2i, 2i+1), got {self.layout!r}"
            ) from None
        if self.scaling is not None:
            if not isinstance(self.scaling, Mapping):
                raise TypeError(
                    f"RopeConfig: scaling must be a dict like {{'rope_type': 'yarn', ...}} or None, "
                    f"got {self.scaling!r}"
                )
            self._lift_mrope(dict(self.scaling))
        if self.mrope_section is not None:
            section = self.mrope_section
            if isinstance(section, str | bytes) or not hasattr(section, "__iter__"):
                raise TypeError(
                    f"RopeConfig: mrope_section must be three ints (temporal, height, width), "
                    f"got {section!r}"
                )
            object.__setattr__(self, "mrope_section", _freeze(section))
        self.validate()

    def _lift_mrope(self, params: dict[str, Any]) -> None:
        """Move the M-RoPE keys of the scaling dict to their fields; freeze what is left."""
        for key in ("mrope_section", "mrope_interleaved"):
            if key not in params:
                continue
            value = params.pop(key)
            field = getattr(self, key)
            if field is not None and field is not False and _freeze(field) != _freeze(value):
                raise ValueError(
                    f"RopeConfig: scaling carries {key}={value!r} but {key}={field!r}; give it once"
                )
            object.__setattr__(self, key, value)
        if rope_type_name(params) == "mrope":  # Qwen2-VL's legacy name
            params.pop("type", None)
            params["rope_type"] = "default"
        object.__setattr__(self, "scaling", FrozenDict(params))

    def validate(self) -> None:
        """Check every field and the scaling dict (called on construction).

        Raises:
            ValueError: naming the field, the value and what is expected.
        """
        for name in ("channels", "n_heads", "n_kv_heads", "max_seq_len", "rotary_dim"):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"RopeConfig: {name} must be an int, got {value!r}")
        for name in ("channels", "n_heads", "n_kv_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RopeConfig: {name} must be > 0, got {getattr(self, name)}")
        if self.channels % self.n_heads:
            raise ValueError(
                f"RopeConfig: channels ({self.channels}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"RopeConfig: head_dim = channels / n_heads = {self.head_dim} must be even "
                "(RoPE rotates pairs of channels)"
            )
        if self.n_kv_heads > self.n_heads:
            raise ValueError(
                f"RopeConfig: n_kv_heads ({self.n_kv_heads}) must be <= n_heads ({self.n_heads})"
            )
        if (
            isinstance(self.base, bool)
            or not isinstance(self.base, int | float)
            or not math.isfinite(self.base)
            or self.base <= 1.0
        ):
            raise ValueError(f"RopeConfig: base must be a finite number > 1, got {self.base!r}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"RopeConfig: rotary_dim must be even and in [0, head_dim={self.head_dim}] "
                f"(0 = whole head), got {self.rotary_dim}"
            )
        check_scaling_values(self.scaling)  # before rope_theta and partial_rotary_factor are read
        scaling = self.scaling or {}
        theta = scaling.get("rope_theta")
        if theta is not None and float(theta) != float(self.base):
            raise ValueError(
                f"RopeConfig: scaling carries rope_theta={theta} but base={self.base}; set "
                "base=<rope_theta> (or use RopeConfig.from_hf, which does)"
            )
        prf = scaling.get("partial_rotary_factor")
        if prf is not None and int(self.head_dim * float(prf)) != self.rotated_dim:
            raise ValueError(
                f"RopeConfig: scaling carries partial_rotary_factor={prf} (rotary_dim "
                f"{int(self.head_dim * float(prf))}) but rotary_dim={self.rotated_dim}; set "
                "rotary_dim to match (or use RopeConfig.from_hf)"
            )
        check_scaling(self.scaling, self.head_dim, self.rotated_dim, self.max_seq_len)
        self._validate_mrope()

    def _validate_mrope(self) -> None:
        if isinstance(self.mrope_interleaved, np.bool_):
            object.__setattr__(self, "mrope_interleaved", bool(self.mrope_interleaved))
        if not isinstance(self.mrope_interleaved, bool):
            raise TypeError(
                f"RopeConfig: mrope_interleaved must be a bool, got {self.mrope_interleaved!r}"
            )
        section = self.mrope_section
        if section is None:
            if self.mrope_interleaved:
                raise ValueError("RopeConfig: mrope_interleaved=True needs an mrope_section")
            return
        n_freq = self.rotated_dim // 2
        if len(section) != 3 or not all(_is_int(v) and v >= 0 for v in section):
            raise ValueError(
                "RopeConfig: mrope_section must be three ints >= 0 (frequencies of the temporal, "
                f"height and width axes), got {section!r}"
            )
        if sum(section) != n_freq:
            raise ValueError(
                f"RopeConfig: mrope_section {list(section)} must sum to the {n_freq} rotated "
                f"frequencies (rotated_dim {self.rotated_dim} / 2), got {sum(section)}"
            )
        if self.mrope_interleaved:
            axes = self.mrope_axes()
            if (axes.count(1), axes.count(2)) != (section[1], section[2]):
                raise ValueError(
                    f"RopeConfig: interleaved mrope_section {list(section)} does not fit "
                    f"{n_freq} frequencies: height and width take every third one from 1 and 2, "
                    f"so each needs 3 * count <= {n_freq} + 1"
                )

    @property
    def head_dim(self) -> int:
        return self.channels // self.n_heads

    @property
    def kv_channels(self) -> int:
        """Width of K, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def rotated_dim(self) -> int:
        """``rotary_dim``, or ``head_dim`` when ``rotary_dim == 0``."""
        return self.rotary_dim or self.head_dim

    @property
    def is_mrope(self) -> bool:
        """Whether positions may carry three axes (``mrope_section`` is set)."""
        return self.mrope_section is not None

    def mrope_axes(self) -> tuple[int, ...]:
        """The position axis (0 temporal, 1 height, 2 width) of each rotated frequency.

        Contiguous sections (Qwen2-VL, GLM-4V): the first ``mrope_section[0]`` frequencies
        follow axis 0, the next ``mrope_section[1]`` axis 1, the rest axis 2. Interleaved
        (Qwen3-VL): frequency ``i`` follows axis 1 when ``i % 3 == 1`` and ``i < 3 *
        mrope_section[1]``, axis 2 when ``i % 3 == 2`` and ``i < 3 * mrope_section[2]``, else 0.

        Raises:
            ValueError: the config has no ``mrope_section``.
        """
        if self.mrope_section is None:
            raise ValueError("RopeConfig.mrope_axes: this config has no mrope_section")
        t, h, w = self.mrope_section
        if not self.mrope_interleaved:
            return (0,) * t + (1,) * h + (2,) * w
        axes = []
        for i in range(t + h + w):
            if i % 3 == 1 and i < 3 * h:
                axes.append(1)
            elif i % 3 == 2 and i < 3 * w:
                axes.append(2)
            else:
                axes.append(0)
        return tuple(axes)

    @property
    def rope_type(self) -> str:
        return rope_type_name(self.scaling)

    @property
    def rope_type_entry(self) -> RopeType:
        return get_rope_type(self.rope_type)

    def table_key(self) -> tuple[Any, ...]:
        """What determines the cos/sin table (layout and head counts do not), with the type
        (:attr:`rope_type_entry`) beside it: the scaling parameters, sorted, without the keys
        that name the type or repeat ``base`` and ``rotary_dim``, so ``None`` and
        ``{"rope_type": "default"}``, or ``type`` and ``rope_type``, share one table."""
        params = (self.scaling or {}).items()
        return (
            self.head_dim,
            self.rotated_dim,
            float(self.base),
            self.max_seq_len,
            tuple(sorted((k, v) for k, v in params if k not in BOOKKEEPING_KEYS)),
        )

    @classmethod
    def from_hf(
        cls,
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
        ``no_rope_layers``, ...). :meth:`from_hf_layers` gives the config of every layer.

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
        from mila_py.components.rope_hf import rope_config_from_hf

        return rope_config_from_hf(
            config, layer_type=layer_type, max_seq_len=max_seq_len, layout=layout
        )

    @classmethod
    def from_hf_layers(
        cls,
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
            max_seq_len, layout: as in :meth:`from_hf`.

        Raises:
            ValueError: as :meth:`from_hf`, ``layer_types`` of the wrong length, or
                per-layer-type parameters without ``layer_types`` or a family pattern.
        """
        from mila_py.components.rope_hf import rope_configs_from_hf_layers

        return rope_configs_from_hf_layers(config, max_seq_len=max_seq_len, layout=layout)
