"""A checkpoint's generation defaults: the ``generation_config.json`` of a Hugging Face folder
(the ids to stop at, the sampling settings the model was published with), read strictly.

Absent keys take transformers' defaults (``do_sample`` false, ``temperature`` 1, ``top_p`` 1,
``top_k`` 50, ``repetition_penalty`` 1), so :class:`GenerationDefaults` holds what
``transformers.generate`` would use. ``eos_token_id``, ``bos_token_id`` and ``pad_token_id``
fall back to ``config.json`` (its top level, then its ``text_config``) where
``generation_config.json`` is missing or does not name them.

In mila_py's terms greedy decoding is ``temperature=0``: ``do_sample`` false means greedy
whatever ``temperature`` says, and :meth:`GenerationDefaults.generate_kwargs` gives the
arguments of :meth:`~mila_py.models.Llama.generate` accordingly.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GenerationDefaults"]

GENERATION_CONFIG_NAME = "generation_config.json"
CONFIG_NAME = "config.json"

_ID_KEYS = ("bos_token_id", "pad_token_id")
_REAL_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint asks generation to use.

    Attributes:
        eos_token_ids: the ids that end a sequence (chat models often list several, e.g. an
            end-of-turn id beside the end-of-text id); empty where none is named.
        bos_token_id: the beginning-of-sequence id, or None.
        pad_token_id: the padding id, or None.
        temperature: the sampling temperature (used only where ``do_sample``), >= 0.
        top_p: nucleus sampling's probability mass, in (0, 1]; 1 keeps every token.
        top_k: how many most likely tokens to sample among; 0 keeps every token.
        min_p: drop tokens below ``min_p`` times the top probability, in [0, 1], or None.
        repetition_penalty: > 0; 1 is none.
        do_sample: sample (True) or decode greedily (False).
        max_new_tokens: how many tokens to generate at most, >= 1, or None.
    """

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    min_p: float | None = None
    repetition_penalty: float = 1.0
    do_sample: bool = False
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range.

        Raises:
            ValueError: a field of the wrong type or out of range.
        """
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name == "eos_token_ids":
                ok = isinstance(value, tuple) and all(_is_int(i) for i in value)
                expected: str | None = "a tuple of ints"
            else:
                expected = _problem(name, value)
                ok = expected is None
            if not ok:
                raise ValueError(f"GenerationDefaults: {name} must be {expected}, got {value!r}")

    @property
    def greedy(self) -> bool:
        """True where the checkpoint decodes greedily (``do_sample`` false)."""
        return not self.do_sample

    @property
    def sampling_temperature(self) -> float:
        """The temperature in mila_py's terms: 0 (greedy) unless ``do_sample``."""
        return float(self.temperature) if self.do_sample else 0.0

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`~mila_py.models.Llama.generate` these
        defaults ask for: ``temperature`` (0 when greedy), ``top_k`` and ``top_p`` (None where
        they keep every token or decoding is greedy), ``eos_token_id`` and ``pad_token_id``
        (None where unset), and ``max_new_tokens`` where the checkpoint gives one.
        ``min_p`` and ``repetition_penalty`` are not among them (``generate`` has neither)."""
        sample = self.do_sample and self.temperature > 0
        kwargs: dict[str, Any] = {
            "temperature": self.sampling_temperature,
            "top_k": self.top_k if sample and self.top_k > 0 else None,
            "top_p": self.top_p if sample and self.top_p < 1 else None,
            "eos_token_id": list(self.eos_token_ids) or None,
            "pad_token_id": self.pad_token_id,
        }
        if self.max_new_tokens is not None:
            kwargs["max_new_tokens"] = self.max_new_tokens
        return kwargs

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> GenerationDefaults:
        """The defaults of a checkpoint folder: its ``generation_config.json``, with
        ``config.json`` for the ids it does not name.

        Raises:
            FileNotFoundError: ``folder`` has neither file.
            ValueError: a file that is not a JSON object, or a key of the wrong type or range
                (the message names the key and the file).
        """
        root = Path(folder)
        generation_file, config_file = root / GENERATION_CONFIG_NAME, root / CONFIG_NAME
        if not generation_file.is_file() and not config_file.is_file():
            raise FileNotFoundError(
                f"GenerationDefaults.from_pretrained: {root} has neither {GENERATION_CONFIG_NAME} "
                f"nor {CONFIG_NAME}"
            )
        generation = _read_json(generation_file) if generation_file.is_file() else {}
        config = _read_json(config_file) if config_file.is_file() else {}
        text_config = config.get("text_config")
        fallbacks = [(config, config_file)]
        if isinstance(text_config, dict):
            fallbacks.append((text_config, config_file))
        values: dict[str, Any] = {}
        for key in ("eos_token_id", *_ID_KEYS):
            for source, file in [(generation, generation_file), *fallbacks]:
                if source.get(key) is not None:
                    values[key] = (source[key], file)
                    break
        for key in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "do_sample",
            "max_new_tokens",
        ):
            if generation.get(key) is not None:
                values[key] = (generation[key], generation_file)
        fields = {
            ("eos_token_ids" if key == "eos_token_id" else key): _field(key, value, file)
            for key, (value, file) in values.items()
        }
        return cls(**fields)


def _field(key: str, value: Any, file: Path) -> Any:
    """One key's value, type-checked: the error names the key and the file."""

    def wrong(expected: str) -> ValueError:
        return ValueError(
            f"GenerationDefaults.from_pretrained: {key!r} of {file} must be {expected}, got {value!r}"
        )

    if key == "eos_token_id":
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(_is_int(i) for i in ids):
            raise wrong("an int or a non-empty list of ints")
        return tuple(ids)
    expected = _problem(key, value)
    if expected is not None:
        raise wrong(expected)
    return float(value) if key in _REAL_KEYS else value


def _problem(key: str, value: Any) -> str | None:
    """None where ``value`` suits field ``key``, else what the field expects."""
    if key in (*_ID_KEYS, "max_new_tokens", "min_p") and value is None:
        return None
    if key in _ID_KEYS:
        return None if _is_int(value) else "an int or null"
    if key == "do_sample":
        return None if isinstance(value, bool) else "true or false"
    if key in ("top_k", "max_new_tokens"):
        low = 0 if key == "top_k" else 1
        return None if _is_int(value) and value >= low else f"an int >= {low}"
    if key not in _REAL_KEYS:
        raise KeyError(f"GenerationDefaults: no field {key!r}")
    if not _is_real(value) or not math.isfinite(value):
        return "a finite number"
    ranges = {
        "temperature": (value >= 0, "a number >= 0"),
        "top_p": (0 < value <= 1, "a number in (0, 1]"),
        "min_p": (0 <= value <= 1, "a number in [0, 1]"),
        "repetition_penalty": (value > 0, "a number > 0"),
    }
    ok, expected = ranges[key]
    return None if ok else expected


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"GenerationDefaults.from_pretrained: {file} is not valid JSON ({exc})"
        ) from exc
    if not isinstance(value, dict):
        raise ValueError(
            f"GenerationDefaults.from_pretrained: {file} holds a {type(value).__name__}, not a JSON object"
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
