"""Generation defaults read as transformers' GenerationConfig reads them, strictly typed."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

from mila_py.interop import GenerationDefaults
from mila_py.interop.hf import eos_token_ids
from mila_py.models import Llama

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "do_sample",
    "max_new_tokens",
)

CASES: dict[str, dict[str, Any]] = {
    "llama3_instruct": {
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
    },
    "qwen": {
        "bos_token_id": 151643,
        "pad_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "min_p": 0.05,
        "max_new_tokens": 2048,
    },
    "greedy": {
        "eos_token_id": 2,
        "bos_token_id": 1,
        "pad_token_id": 0,
        "temperature": 0.3,
        "top_k": 0,
    },
    "bare": {},
    "ints_as_reals": {"eos_token_id": 7, "temperature": 1, "top_p": 1, "repetition_penalty": 2},
    "nulls": {"eos_token_id": 5, "temperature": None, "top_k": None, "pad_token_id": None},
}


def _write(
    folder: Path, generation: dict[str, Any] | None, config: dict[str, Any] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _transformers() -> Any:
    return pytest.importorskip(
        "transformers", reason="transformers' GenerationConfig is the reference compared to"
    )


def _effective(hf: Any, key: str) -> Any:
    """What transformers.generate uses for ``key``: the file's value, else its default."""
    value = getattr(hf, key)
    if value is None:
        value = type(hf)._get_default_generation_params().get(key)
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_as_transformers_reads_generation_config(case: str, tmp_path: Path) -> None:
    transformers = _transformers()
    folder = _write(tmp_path, CASES[case])
    ours = GenerationDefaults.from_pretrained(folder)
    hf = transformers.GenerationConfig.from_pretrained(str(folder))
    for key in SAMPLING_KEYS:
        assert getattr(ours, key) == _effective(hf, key), key
    eos = hf.eos_token_id
    assert ours.eos_token_ids == (
        () if eos is None else tuple(eos if isinstance(eos, list) else [eos])
    )
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert all(
        type(getattr(ours, k)) is float for k in ("temperature", "top_p", "repetition_penalty")
    )


def test_ids_fall_back_to_config_json_as_transformers(tmp_path: Path) -> None:
    """Without generation_config.json the ids come from config.json (transformers'
    ``GenerationConfig.from_model_config``); sampling keys keep their defaults."""
    transformers = _transformers()
    config = {
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": [2, 32000],
        "pad_token_id": 0,
    }
    folder = _write(tmp_path, None, config)
    ours = GenerationDefaults.from_pretrained(folder)
    hf = transformers.GenerationConfig.from_model_config(dict(config))
    assert ours.eos_token_ids == tuple(hf.eos_token_id) == (2, 32000)
    assert (ours.bos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.pad_token_id) == (1, 0)
    assert ours == GenerationDefaults(eos_token_ids=(2, 32000), bos_token_id=1, pad_token_id=0)


def test_each_id_falls_back_on_its_own(tmp_path: Path) -> None:
    """A generation_config.json that names only some ids takes the others from config.json
    (its top level, then its text_config)."""
    folder = _write(
        tmp_path,
        {"eos_token_id": 9, "temperature": 0.5, "do_sample": True},
        {"eos_token_id": 2, "pad_token_id": None, "text_config": {"pad_token_id": 3, "bos_token_id": 4},
         "bos_token_id": 1},
    )  # fmt: skip
    ours = GenerationDefaults.from_pretrained(folder)
    assert (ours.eos_token_ids, ours.bos_token_id, ours.pad_token_id) == ((9,), 1, 3)
    assert ours.temperature == 0.5 and ours.do_sample


def test_greedy_is_temperature_zero(tmp_path: Path) -> None:
    greedy = GenerationDefaults.from_pretrained(_write(tmp_path / "g", CASES["greedy"]))
    assert greedy.greedy and greedy.temperature == 0.3 and greedy.sampling_temperature == 0.0
    assert greedy.generate_kwargs() == {
        "temperature": 0.0,
        "top_k": None,
        "top_p": None,
        "eos_token_id": [2],
        "pad_token_id": 0,
    }
    sampled = GenerationDefaults.from_pretrained(_write(tmp_path / "s", CASES["qwen"]))
    assert not sampled.greedy and sampled.sampling_temperature == 0.7
    assert sampled.generate_kwargs() == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "max_new_tokens": 2048,
    }
    parameters = inspect.signature(Llama.generate).parameters
    for defaults in (greedy, sampled, GenerationDefaults()):
        assert set(defaults.generate_kwargs()) <= set(parameters)
    # top_k 0 and top_p 1 keep every token: mila_py says so with None
    wide = GenerationDefaults(do_sample=True, top_k=0, top_p=1.0)
    assert wide.generate_kwargs()["top_k"] is None and wide.generate_kwargs()["top_p"] is None


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("eos_token_id", "2", "an int or a non-empty list of ints"),
        ("eos_token_id", [], "an int or a non-empty list of ints"),
        ("eos_token_id", [1, 2.0], "an int or a non-empty list of ints"),
        ("eos_token_id", True, "an int or a non-empty list of ints"),
        ("pad_token_id", 1.5, "an int or null"),
        ("bos_token_id", "<s>", "an int or null"),
        ("temperature", "0.7", "a finite number"),
        ("temperature", True, "a finite number"),
        ("temperature", -0.1, "a number >= 0"),
        ("top_p", 0, "a number in (0, 1]"),
        ("top_p", 1.5, "a number in (0, 1]"),
        ("top_k", 40.0, "an int >= 0"),
        ("top_k", -1, "an int >= 0"),
        ("min_p", 2, "a number in [0, 1]"),
        ("repetition_penalty", 0, "a number > 0"),
        ("do_sample", "true", "true or false"),
        ("do_sample", 1, "true or false"),
        ("max_new_tokens", 0, "an int >= 1"),
        ("max_new_tokens", 10.0, "an int >= 1"),
    ],
)
def test_wrong_values_name_the_key_and_file(
    tmp_path: Path, key: str, value: Any, expected: str
) -> None:
    folder = _write(tmp_path, {key: value})
    message = f"'{key}' of {folder / 'generation_config.json'} must be {expected}, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerationDefaults.from_pretrained(folder)


def test_wrong_ids_in_config_json_name_that_file(tmp_path: Path) -> None:
    folder = _write(tmp_path, {"temperature": 0.5}, {"eos_token_id": "2"})
    with pytest.raises(ValueError, match=re.escape(f"'eos_token_id' of {folder / 'config.json'}")):
        GenerationDefaults.from_pretrained(folder)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError, match=re.escape("neither generation_config.json nor config.json")
    ):
        GenerationDefaults.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=re.escape("generation_config.json is not valid JSON")):
        GenerationDefaults.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        GenerationDefaults.from_pretrained(tmp_path)


def test_constructed_values_are_checked() -> None:
    assert GenerationDefaults().eos_token_ids == ()
    with pytest.raises(ValueError, match="eos_token_ids must be a tuple of ints"):
        GenerationDefaults(eos_token_ids=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\], got 2.0"):
        GenerationDefaults(top_p=2.0)
    with pytest.raises(ValueError, match="temperature must be a finite number, got nan"):
        GenerationDefaults(temperature=float("nan"))


def test_hf_eos_token_ids_reads_through_generation_defaults(tmp_path: Path) -> None:
    """``mila_py.interop.hf.eos_token_ids`` gives GenerationDefaults' ids (text_config included)."""
    folder = _write(tmp_path, {"temperature": 0.5}, {"text_config": {"eos_token_id": [5, 6]}})
    assert (
        eos_token_ids(folder)
        == [5, 6]
        == list(GenerationDefaults.from_pretrained(folder).eos_token_ids)
    )
    folder = _write(tmp_path / "none", {"top_k": 5}, {"model_type": "llama"})
    assert eos_token_ids(folder) is None
    folder = _write(tmp_path / "bad", {"eos_token_id": [1, "2"]}, {"model_type": "llama"})
    with pytest.raises(
        ValueError, match=r"eos_token_ids: .*'eos_token_id' of .*generation_config\.json"
    ):
        eos_token_ids(folder)
