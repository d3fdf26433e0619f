"""``rope_config_from_hf`` on a ``config.json`` that leaves RoPE keys out, for every family
transformers has a config class for.

A Hub ``config.json`` often omits what its config class defaults to (Mixtral's theta 1e6,
gpt-oss's YaRN, Qwen3.5's 256-wide heads); transformers fills it in from the class. mila_py
keeps those class defaults in a table; this scan builds each family's config class from the
same bare sizes and checks that mila_py reads what the class holds: theta, scaling type and
parameters, head size, rotated channels. A mismatch prints the table entry that fixes it.

The table is generated from the transformers release ``pyproject.toml`` pins: with that release
a mismatch fails; with another, its differences are that release's drift and are reported as a
skip that lists them (``hf_versions.skip_drift_from_pinned_transformers``).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from typing import Any

import pytest
from hf_versions import HF_PINNED, skip_drift_from_pinned_transformers

from mila_py.components import RopeConfig
from mila_py.interop.hf_rope import rope_config_from_hf, rope_configs_from_hf_layers

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: sizes a bare config.json gives: 128-wide heads (the common M-RoPE sections fit them), and
#: 144-wide ones no class defaults to (so a class's fixed 128 shows); a value the class gives
#: both BARE and OTHER is a class default, not derived from them
BARE = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "max_position_embeddings": 4096}  # fmt: skip
ODD = {**BARE, "hidden_size": 1152}
OTHER = {"hidden_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "max_position_embeddings": 8192}  # fmt: skip
#: top-level keys a config.json may give beside no scaling dict: the class's default dict,
#: when it holds them, wins (transformers only ``setdefault``s them into it)
TOP_LEVEL = ({"rope_theta": 33333.0}, {"partial_rotary_factor": 0.5})
#: scaling types RopeConfig implements; the others (vision "axial", ...) are not text RoPE
SUPPORTED = {"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"}
#: refusals that are right for the class default (Mistral scales queries after RoPE; the
#: families without RoPE or that RopeConfig cannot express)
REFUSALS = ("llama_4_scaling_beta", "has no RoPE", "cannot express")


def _config_classes() -> list[tuple[str, Any]]:
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    found = []
    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        module = model_type_to_module_name(model_type)
        try:
            configs = importlib.import_module(
                f"transformers.models.{module}.configuration_{module}"
            )
        except Exception:  # a family whose config needs another package
            continue
        if hasattr(configs, class_name):
            found.append((model_type, getattr(configs, class_name)))
    return found


def _flat_rope(hf: Any) -> dict[str, Any] | None:
    params = getattr(hf, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return None
    if any(isinstance(v, dict) or v is None for v in params.values()):
        return None  # per layer type: test_rope_layer_types covers those families
    if params.get("rope_type", params.get("type", "default")) not in SUPPORTED:
        return None
    return params


def _expected(hf: Any, params: dict[str, Any]) -> dict[str, Any]:
    """What the family's rotary module computes from the class's config."""
    latent = getattr(hf, "qk_rope_head_dim", None)
    head_dim = latent or getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None))
    rotated = head_dim if latent or factor is None else int(head_dim * factor)
    scaling = {k: v for k, v in params.items() if k in ("factor", "low_freq_factor",
               "high_freq_factor", "beta_fast", "beta_slow", "original_max_position_embeddings")}  # fmt: skip
    return {"base": float(params.get("rope_theta", 10000.0)),
            "rope_type": params.get("rope_type", params.get("type", "default")),
            "head_dim": head_dim, "rotated": rotated, **scaling}  # fmt: skip


def _read(cfg: RopeConfig, keys: Any) -> dict[str, Any]:
    got = {"base": cfg.base, "rope_type": cfg.rope_type, "head_dim": cfg.head_dim,
           "rotated": cfg.rotated_dim}  # fmt: skip
    for key in keys:
        if key not in got:
            got[key] = (cfg.scaling or {}).get(key)
    return got


def _entry(cls: Any, hf: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The class defaults of this family as a table entry: the values the class gives both
    sets of sizes. Theta and the rotated fraction go into the entry's ``rope_parameters``
    when the class's default dict holds them (a top-level key cannot replace them)."""
    other = cls(**OTHER)
    other_params = _flat_rope(other) or {}
    entry: dict[str, Any] = {}
    held: dict[str, Any] = {}
    for (key, generic), given in zip(
        (("rope_theta", 10000.0), ("partial_rotary_factor", 1.0)), TOP_LEVEL, strict=True
    ):
        value = params.get(key, getattr(hf, key, None))
        if value is None or value != other_params.get(key, getattr(other, key, None)):
            continue
        if (_flat_rope(cls(**BARE, **given)) or {}).get(key) == value != given[key]:
            held[key] = value
        elif value != generic:
            entry[key] = value
    for key in ("head_dim", "qk_rope_head_dim"):
        if getattr(hf, key, None) and getattr(hf, key) == getattr(other, key, None):
            entry[key] = getattr(hf, key)
    if held or params.get("rope_type", params.get("type", "default")) != "default":
        entry["rope_parameters"] = {
            **{k: v for k, v in params.items() if other_params.get(k) == v and k not in held},
            **held,
        }
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in held:
                entry["rope_parameters"].pop(key, None)
    return entry


def _is_composite(cls: Any) -> bool:
    """A multimodal outer config: its RoPE is its text config's (tested through that one)."""
    return "text_config" in (getattr(cls, "sub_configs", None) or {})


def _check(model_type: str, cls: Any, given: dict[str, Any]) -> str | None:
    """What is wrong in mila_py's reading of ``given`` for this family, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            hf = cls(**given)
        except Exception:  # an audio or vision config that takes other sizes
            return None
    params = _flat_rope(hf)
    if params is None or not hasattr(hf, "num_attention_heads"):
        return None
    want = _expected(hf, params)
    try:
        got = _read(rope_config_from_hf({**given, "model_type": model_type}), want)
    except ValueError as error:
        message = str(error)
        if any(reason in message for reason in REFUSALS):
            return None
        if want["rotated"] % 2 and "is odd" in message:
            return None
        if "mrope_section" in message and f"rotated_dim {want['rotated']} " in message:
            return None  # the class's section does not fit its own rotated channels either
        got = {"error": message}
    if got == want:
        return None
    return f"{model_type!r}: {_entry(cls, cls(**BARE), _flat_rope(cls(**BARE)) or {})},  # mila {got}, class {want}"


@pytest.mark.parametrize(
    "given",
    [BARE, ODD, *({**BARE, **top} for top in TOP_LEVEL)],
    ids=["bare", "odd", "theta", "partial"],
)
def test_bare_configs_read_as_their_config_class_fills_them_in(given: dict[str, Any]) -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    wrong: list[str] = []
    checked = 0
    for model_type, cls in _config_classes():
        if _is_composite(cls):
            continue
        problem = _check(model_type, cls, given)
        checked += 1
        if problem is not None:
            wrong.append(problem)
    assert checked > 100
    skip_drift_from_pinned_transformers("the class-default table", wrong)
    assert not wrong, "class defaults read wrongly; table entries:\n" + "\n".join(wrong)


def test_text_model_types_are_the_composite_classes_default_text_configs() -> None:
    from mila_py.interop.hf_rope_defaults import TEXT_MODEL_TYPES

    logging.getLogger("transformers").setLevel(logging.ERROR)
    classes = _config_classes()
    found: dict[str, str] = {}
    for model_type, cls in classes:
        if not _is_composite(cls):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                text = cls().text_config
            except Exception:  # a class that needs arguments
                continue
        inner = getattr(text, "model_type", None)
        same = not inner or inner.removesuffix("_text") == model_type.removesuffix("_text")
        if not same and not inner.startswith(model_type + "_"):
            found[model_type] = inner
    # another release's families the table names but that release lacks are not drift
    known = {model_type for model_type, _ in classes}
    pinned = transformers.__version__ == HF_PINNED
    differences = [
        f"{model_type!r}: class {found.get(model_type)!r}, table {TEXT_MODEL_TYPES.get(model_type)!r}"
        for model_type in sorted(found.keys() | TEXT_MODEL_TYPES.keys())
        if found.get(model_type) != TEXT_MODEL_TYPES.get(model_type)
        and (pinned or model_type in known)
    ]
    skip_drift_from_pinned_transformers("the class-default table's text families", differences)
    assert not differences, "TEXT_MODEL_TYPES differs:\n" + "\n".join(differences)


def _drift_skip(differences: list[str]) -> str | None:
    """The reason ``skip_drift_from_pinned_transformers`` skips with, or None where it returns."""
    try:
        skip_drift_from_pinned_transformers("the table", differences)
    except pytest.skip.Exception as skipped:
        return str(skipped.msg)
    return None


@pytest.mark.parametrize("installed", ["pinned", "newer"])
def test_drift_fails_with_the_pinned_release_and_is_listed_in_a_skip_otherwise(
    installed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hf_versions import HF_VERIFIED

    newer = f"{HF_VERIFIED[0]}.{HF_VERIFIED[1] + 1}.0"
    monkeypatch.setattr(transformers, "__version__", HF_PINNED if installed == "pinned" else newer)
    differences = ["'new_family': {'rope_theta': 1.0}", "'other_family': {'head_dim': 64}"]
    assert _drift_skip([]) is None
    reason = _drift_skip(differences)
    if installed == "pinned":
        assert reason is None  # the caller's assertion then fails on the differences
    else:
        assert reason is not None and newer in reason and HF_PINNED in reason
        assert all(difference in reason for difference in differences)


def test_a_text_config_without_model_type_is_read_as_its_text_family() -> None:
    """Aya Vision's text model is Cohere 2 (pairs (2i, 2i + 1), rotates its sliding layers
    only); PaliGemma's is Gemma (256-wide heads by default)."""
    text = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
            "num_hidden_layers": 4, "max_position_embeddings": 4096}  # fmt: skip
    aya = rope_configs_from_hf_layers({"model_type": "aya_vision", "text_config": text})
    assert [c is not None for c in aya] == [True, True, True, False]
    assert aya[0] is not None and aya[0].layout == "interleaved"
    gemma = rope_config_from_hf({"model_type": "paligemma", "text_config": text})
    assert gemma.head_dim == 256


def regenerate() -> dict[str, dict[str, Any]]:
    """The table anew from the installed transformers: every family the scan finds wrong
    with an empty table (the hand-kept ``hf_rope._CLASS_DEFAULTS`` still applied), until it
    finds none. ``python tests/test_rope_hf_class_defaults.py`` prints it."""
    from mila_py.interop import hf_rope_defaults as rope_hf_defaults

    logging.getLogger("transformers").setLevel(logging.ERROR)
    table = rope_hf_defaults.CLASS_DEFAULTS
    saved = dict(table)
    table.clear()
    try:
        for _ in range(3):  # an entry can change what the next variant reads
            changed = False
            for model_type, cls in _config_classes():
                if _is_composite(cls):
                    continue
                variants = [BARE, ODD, *({**BARE, **top} for top in TOP_LEVEL)]
                if any(_check(model_type, cls, given) for given in variants):
                    entry = _entry(cls, cls(**BARE), _flat_rope(cls(**BARE)) or {})
                    key = model_type.removesuffix("_text")
                    changed |= table.get(key) != entry
                    table[key] = entry
            if not changed:
                return dict(sorted(table.items()))
        raise AssertionError("the class-default table does not settle")
    finally:
        table.clear()
        table.update(saved)


if __name__ == "__main__":
    import pprint

    warnings.simplefilter("ignore")
    pprint.pprint(regenerate(), width=96)
