"""The tokenizer reads a Hugging Face folder as transformers' AutoTokenizer does (compared on the
same files, built here with the ``tokenizers`` trainers), and streams text as ids arrive."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chat_templates import CHATML, CONVERSATIONS, LLAMA3, SYSTEM_CONVERSATION
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_helpers import byte_level_tokenizer, sentencepiece_tokenizer, write_folder

from mila_py.interop import ChatTemplateError, StreamDecoder, Tokenizer

ROOT = Path(__file__).resolve().parents[1]

BYTE_LEVEL_CONFIG = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|eot_id|>",
    "chat_template": LLAMA3,
}
SENTENCEPIECE_CONFIG = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "chat_template": CHATML,
}
KINDS = ("byte_level", "sentencepiece", "sentencepiece_legacy")

TEXTS = [
    "Hello world",
    "Hello, world! It's a test.",
    " leading space",
    "trailing space ",
    "  two leading, \t tab,\n\nnew lines\r\n",
    "",
    " ",
    "   ",
    "\n",
    "你好，世界！我们在测试。",
    "龍の巣 — 稀な漢字 𠜎",  # CJK outside the training text: byte fallback / byte level
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇨🇦🇫🇷",
    "Zürich ŧ ∑ ǅ Ωmega café naïve",
    "mixed: abc你好😀 123 3.14159",
    "<s>special</s> in text <|eot_id|>",
    "<|begin_of_text|>user<|im_start|> x",
    "\u200b zero width \ufeff bom \ufffd replacement",
    "x" * 300,
]


def _build(kind: str, folder: Path, config: dict[str, Any] | None = None) -> Path:
    if kind == "byte_level":
        tok, base = byte_level_tokenizer(), BYTE_LEVEL_CONFIG
    else:
        tok, base = sentencepiece_tokenizer(legacy=kind.endswith("legacy")), SENTENCEPIECE_CONFIG
    return write_folder(folder, tok, {**base, **(config or {})})


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: _build(kind, root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def tokenizers_(folders: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_pretrained(folder) for kind, folder in folders.items()}


def _auto(folder: Path, **kwargs: Any) -> Any:
    transformers = pytest.importorskip(
        "transformers", reason="transformers' AutoTokenizer is the reference compared to"
    )
    return transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Any]:
    return {kind: _auto(folder) for kind, folder in folders.items()}


# ----------------------------------------------------------------------------- encode / decode
@pytest.mark.parametrize("kind", KINDS)
def test_encode_decode_as_transformers(
    kind: str, tokenizers_: dict[str, Tokenizer], references: dict[str, Any]
) -> None:
    tok, ref = tokenizers_[kind], references[kind]
    fallback = 0
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == ref.encode(text, add_special_tokens=add), (text, add)
            for skip in (False, True):
                got = tok.decode(ids, skip_special_tokens=skip)
                assert got == ref.decode(ids, skip_special_tokens=skip), (text, add, skip)
        fallback += sum(tok.id_to_token(i).startswith("<0x") for i in tok.encode(text))  # type: ignore[union-attr]
    if kind != "byte_level":
        assert fallback > 0  # the texts do reach the byte pieces


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_as_transformers(
    kind: str, tokenizers_: dict[str, Tokenizer], references: dict[str, Any]
) -> None:
    tok, ref = tokenizers_[kind], references[kind]
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(ref, name), name
        assert getattr(tok, f"{name}_id") == getattr(ref, f"{name}_id"), name
    assert tok.bos_token is not None and tok.bos_token_id is not None
    assert tok.special_tokens_map == ref.special_tokens_map
    assert tok.vocab_size == ref.vocab_size
    assert len(tok) == len(ref)
    assert tok.all_special_tokens == ref.all_special_tokens
    assert tok.all_special_ids == ref.all_special_ids
    assert tok.encode("a")[0] == tok.bos_token_id  # the post-processor's BOS


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT, kind=st.sampled_from(KINDS))
def test_random_text_as_transformers(
    text: str, kind: str, tokenizers_: dict[str, Tokenizer], references: dict[str, Any]
) -> None:
    tok, ref = tokenizers_[kind], references[kind]
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.decode(ids) == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_decode_checks_ids(tokenizers_: dict[str, Tokenizer], references: dict[str, Any]) -> None:
    tok, ref = tokenizers_["sentencepiece"], references["sentencepiece"]
    ids = [*tok.encode("hello"), len(tok) + 5]  # past the vocabulary: decodes to nothing
    assert tok.decode(ids) == ref.decode(ids) == tok.decode(ids[:-1])
    np = pytest.importorskip("numpy")
    assert tok.decode(np.array(ids[:-1], dtype=np.int64)) == tok.decode(ids[:-1])
    assert tok.decode(ids[1]) == ref.decode(ids[1]) == tok.decode(ids[1:2])
    assert tok.decode(np.int32(ids[1])) == tok.decode(ids[1:2])
    with pytest.raises(ValueError, match="decode: ids must be >= 0, got -1"):
        tok.decode([1, -1])
    with pytest.raises(TypeError, match=re.escape("decode: ids must be ints, got 1.0")):
        tok.decode([1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got a str"):
        tok.decode("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="encode: text must be a str, got list"):
        tok.encode(["hello"])  # type: ignore[arg-type]


# -------------------------------------------------------------------- tokenizer_config.json
def test_config_special_tokens_as_transformers(tmp_path: Path) -> None:
    """AddedToken dicts, a named token missing from the vocabulary (added, as transformers
    adds it), extra special tokens (one of them a vocabulary piece, then matched whole)."""
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "normalized": True},
        "pad_token": "<pad>",
        "additional_special_tokens": ["<extra>", "▁the"],
    }  # fmt: skip
    folder = _build("sentencepiece", tmp_path, config)
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert len(tok) == len(ref) == tok.vocab_size + 2
    assert tok.pad_token == "<pad>" and tok.pad_token_id == ref.pad_token_id == tok.vocab_size
    text = "the <pad> the<extra> x </s> the"
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.token_to_id("▁the") in ids and tok.token_to_id("<extra>") in ids
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_map_json_as_transformers(tmp_path: Path) -> None:
    """The legacy file overrides the config's tokens, unless the config has an
    ``added_tokens_decoder`` (then transformers does not read it)."""
    folder = _build("sentencepiece", tmp_path / "a", {"eos_token": "</s>", "pad_token": None})
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<unk>"}, "pad_token": "<s>"})
    )
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert (tok.eos_token, tok.pad_token) == (ref.eos_token, ref.pad_token) == ("<unk>", "<s>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert (tok.eos_token, tok.pad_token) == (ref.eos_token, ref.pad_token) == ("</s>", None)


@pytest.mark.parametrize(
    "add_bos, add_eos", [(True, False), (True, True), (False, True), (False, False)]
)
def test_legacy_bos_eos_flags(tmp_path: Path, add_bos: bool, add_eos: bool) -> None:
    """Without a post-processor in tokenizer.json the config's flags decide (as transformers'
    fast Llama tokenizer builds its post-processor from them: transformers 5 honours them when
    passed, and is given them here); with one, the post-processor decides."""
    flags = {"add_bos_token": add_bos, "add_eos_token": add_eos}
    bare = write_folder(
        tmp_path / "bare",
        sentencepiece_tokenizer(),
        {**SENTENCEPIECE_CONFIG, **flags},
        post_processor=False,
    )
    tok, ref = Tokenizer.from_pretrained(bare), _auto(bare, **flags)
    for text in ("hello world", ""):
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert (ids[:1] == [tok.bos_token_id]) == add_bos
        assert (ids[-1:] == [tok.eos_token_id]) == add_eos
        assert tok.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
    with_processor = _build("sentencepiece", tmp_path / "processor", flags)
    tok, ref = Tokenizer.from_pretrained(with_processor), _auto(with_processor)
    assert tok.encode("hello") == ref.encode("hello")
    assert (
        tok.encode("hello")[0] == tok.bos_token_id and tok.encode("hello")[-1] != tok.eos_token_id
    )


def test_split_special_tokens_as_transformers(tmp_path: Path) -> None:
    folder = _build("byte_level", tmp_path, {"split_special_tokens": True})
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    text = "<|eot_id|> and <|im_start|>"
    assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token_id not in tok.encode(text, add_special_tokens=False)
    again = Tokenizer(byte_level_tokenizer(), eos_token="<|eot_id|>", split_special_tokens=True)
    again.save_pretrained(tmp_path / "saved")
    saved, saved_ref = Tokenizer.from_pretrained(tmp_path / "saved"), _auto(tmp_path / "saved")
    assert saved.encode(text) == saved_ref.encode(text) == tok.encode(text)
    assert again.encode(text) == tok.encode(text)


def test_config_errors_name_the_key_and_file(tmp_path: Path) -> None:
    cases = {
        "bos_token": 5,
        "eos_token": {"content": 3},
        "pad_token": {"content": "<p>", "lstrip": "no"},
        "chat_template": [{"name": "default"}],
        "add_bos_token": "true",
        "split_special_tokens": 1,
        "additional_special_tokens": "<x>",
    }
    for key, value in cases.items():
        folder = _build("sentencepiece", tmp_path / key, {key: value})
        with pytest.raises(ValueError, match=rf"'{key}' of {folder / 'tokenizer_config.json'}"):
            Tokenizer.from_pretrained(folder)
    folder = _build("sentencepiece", tmp_path / "json")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape("tokenizer_config.json is not valid JSON")):
        Tokenizer.from_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        Tokenizer.from_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a tokenizers file"):
        Tokenizer.from_pretrained(folder)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json .*tokenizer\.model"):
        Tokenizer.from_pretrained(tmp_path / "spm")
    folder = _build("sentencepiece", tmp_path / "flags", {"add_eos_token": True, "eos_token": None})
    with pytest.raises(ValueError, match="add_eos_token=True but there is no eos_token"):
        Tokenizer.from_pretrained(folder)


def test_without_a_config_file(tmp_path: Path) -> None:
    folder = _build("byte_level", tmp_path)
    (folder / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_pretrained(folder)
    assert tok.bos_token is None and tok.chat_template is None
    assert tok.decode(tok.encode("hi 😀")) == "<|begin_of_text|>hi 😀"
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("kind", KINDS)
def test_apply_chat_template_as_transformers(
    kind: str, tokenizers_: dict[str, Tokenizer], references: dict[str, Any]
) -> None:
    tok, ref = tokenizers_[kind], references[kind]
    for messages in [*CONVERSATIONS, SYSTEM_CONVERSATION]:
        for prompt in (False, True):
            text = tok.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert isinstance(text, str)
            assert text == ref.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=False
            )
            ids = tok.apply_chat_template(messages, add_generation_prompt=prompt)
            assert ids == ref.apply_chat_template(
                messages, add_generation_prompt=prompt, return_dict=False
            )
            assert ids == tok.encode(text, add_special_tokens=False)
    batch = [CONVERSATIONS[0], CONVERSATIONS[1]]
    assert tok.apply_chat_template(batch, tokenize=False) == ref.apply_chat_template(
        batch, tokenize=False
    )
    assert tok.apply_chat_template(batch) == ref.apply_chat_template(batch, return_dict=False)


def test_llama3_chat_tokens(tokenizers_: dict[str, Tokenizer]) -> None:
    """The template's control tokens encode as single special ids (one BOS, one eot per turn)."""
    tok = tokenizers_["byte_level"]
    ids = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 3
    assert ids[-3:] == tok.encode("<|end_header_id|>\n\n", add_special_tokens=False)


def test_chat_template_sources_as_transformers(tmp_path: Path) -> None:
    """Named templates (a list in the config), chat_template.jinja over the config's, and
    additional_chat_templates/ beside it."""
    messages = CONVERSATIONS[1]
    named = [{"name": "default", "template": LLAMA3}, {"name": "chatml", "template": CHATML}]
    folder = _build("byte_level", tmp_path / "named", {"chat_template": named})
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert tok.chat_template == {"default": LLAMA3, "chatml": CHATML}
    for name in (None, "chatml", "{{ messages | length }}"):
        got = tok.apply_chat_template(messages, chat_template=name, tokenize=False)
        assert got == ref.apply_chat_template(messages, chat_template=name, tokenize=False)
    folder = _build("byte_level", tmp_path / "jinja", {"chat_template": "ignored {{ x }}"})
    (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert tok.chat_template == CHATML
    assert tok.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
        messages, tokenize=False
    )
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(LLAMA3, encoding="utf-8")
    tok, ref = Tokenizer.from_pretrained(folder), _auto(folder)
    assert tok.chat_template == ref.chat_template == {"default": CHATML, "tool_use": LLAMA3}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    got = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert got == ref.apply_chat_template(messages, tools=tools, tokenize=False)
    assert got.startswith("<|begin_of_text|>")  # the tool_use template was chosen


def test_apply_chat_template_errors(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["byte_level"]
    with pytest.raises(ValueError, match="empty"):
        tok.apply_chat_template([])
    bad = "{{ raise_exception('no system turns here') }}"
    with pytest.raises(ChatTemplateError, match="no system turns here"):
        tok.apply_chat_template(CONVERSATIONS[0], chat_template=bad)


# -------------------------------------------------------------------------------- saving
@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip(
    kind: str, tmp_path: Path, folders: dict[str, Path], tokenizers_: dict[str, Tokenizer]
) -> None:
    tok = tokenizers_[kind]
    config = json.loads((folders[kind] / "tokenizer_config.json").read_text())
    config["model_max_length"] = 4096  # a key the class does not own: kept as it was
    source = _build(kind, tmp_path / "source", config)
    tok = Tokenizer.from_pretrained(source)
    out = tmp_path / "out"
    tok.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    again, ref = Tokenizer.from_pretrained(out), _auto(out)
    assert again.special_tokens_map == tok.special_tokens_map == ref.special_tokens_map
    assert again.chat_template == tok.chat_template == ref.chat_template
    assert len(again) == len(tok) == len(ref)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text) == ref.encode(text)
    messages = CONVERSATIONS[2]
    assert again.apply_chat_template(messages) == ref.apply_chat_template(
        messages, return_dict=False
    )


def test_save_pretrained_keeps_legacy_and_named_settings(tmp_path: Path) -> None:
    flags = {"add_bos_token": True, "add_eos_token": True, "pad_token": "<pad>"}
    named = [{"name": "default", "template": LLAMA3}, {"name": "chatml", "template": CHATML}]
    folder = write_folder(
        tmp_path / "bare",
        sentencepiece_tokenizer(),
        {**SENTENCEPIECE_CONFIG, **flags, "chat_template": named},
        post_processor=False,
    )
    tok = Tokenizer.from_pretrained(folder)
    tok.save_pretrained(tmp_path / "out")
    again, ref = Tokenizer.from_pretrained(tmp_path / "out"), _auto(tmp_path / "out")
    assert again.encode("hi") == tok.encode("hi") == ref.encode("hi")
    assert tok.encode("hi")[0] == tok.bos_token_id and tok.encode("hi")[-1] == tok.eos_token_id
    assert again.chat_template == tok.chat_template == ref.chat_template
    assert again.pad_token_id == tok.pad_token_id == ref.pad_token_id


def test_save_pretrained_rewrites_a_chat_template_file(tmp_path: Path) -> None:
    """A chat_template.jinja already in the folder would shadow the config's template."""
    tok = Tokenizer.from_pretrained(_build("byte_level", tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "chat_template.jinja").write_text("stale {{ messages }}")
    tok.save_pretrained(out)
    assert (out / "chat_template.jinja").read_text() == LLAMA3
    assert Tokenizer.from_pretrained(out).chat_template == LLAMA3 == _auto(out).chat_template


def test_save_pretrained_is_all_or_nothing(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_build("byte_level", tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("old")
    (out / "tokenizer_config.json").mkdir()  # cannot be replaced by a file
    with pytest.raises(OSError, match=re.escape("Tokenizer.save_pretrained: cannot write")):
        tok.save_pretrained(out)
    assert (out / "tokenizer.json").read_text() == "old"
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


# -------------------------------------------------------------------------------- streaming
def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> tuple[list[str], str]:
    decoder = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [decoder.push(i) for i in ids]
    return pieces, decoder.flush()


@pytest.mark.parametrize("kind", KINDS)
def test_stream_of_texts_equals_decode(kind: str, tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_[kind]
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (False, True):
            pieces, rest = _stream(tok, ids, skip)
            assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip), text
            assert not any("\ufffd" in p for p in pieces) or "\ufffd" in text


def test_stream_holds_incomplete_characters(tokenizers_: dict[str, Tokenizer]) -> None:
    """A character split over byte pieces comes out whole, once no further byte can change it."""
    tok = tokenizers_["sentencepiece"]
    ids = tok.encode("a 𠜎 b", add_special_tokens=False)
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces.count("<0xF0>") == 1  # the rare character falls back to its four bytes
    decoder = tok.stream_decoder()
    out = [decoder.push(i) for i in ids]
    first = pieces.index("<0xF0>")
    assert out[first : first + 4] == ["", "", "", ""]  # no U+FFFD, no half character
    assert "𠜎" in out[first + 4]
    assert "".join(out) + decoder.flush() == "a 𠜎 b"
    byte_level = tokenizers_["byte_level"]
    ids = byte_level.encode("龍", add_special_tokens=False)
    assert len(ids) > 1  # split within the character's UTF-8 bytes
    decoder = byte_level.stream_decoder()
    assert [decoder.push(i) for i in ids][:-1] == [""] * (len(ids) - 1)
    assert decoder.flush() == "" and decoder.ids == []


def test_stream_keeps_sentencepiece_spaces(tokenizers_: dict[str, Tokenizer]) -> None:
    """The leading ``▁`` of each word becomes its space; only the text's first is stripped."""
    for kind in ("sentencepiece", "sentencepiece_legacy"):
        tok = tokenizers_[kind]
        text = "Hello  world, this is a test"
        ids = tok.encode(text, add_special_tokens=False)
        pieces, rest = _stream(tok, ids)
        assert "".join(pieces) + rest == text == tok.decode(ids)
        assert any(p.startswith(" ") for p in pieces[1:])


def test_stream_decoder_flush_starts_over(tokenizers_: dict[str, Tokenizer]) -> None:
    tok = tokenizers_["sentencepiece"]
    decoder = tok.stream_decoder()
    for text in ("first text", "second 你好"):
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(decoder.push(i) for i in ids) + decoder.flush() == text
    with pytest.raises(TypeError, match=re.escape("StreamDecoder.push: ids must be ints")):
        decoder.push("a")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mila_py Tokenizer"):
        StreamDecoder(tok.backend)  # type: ignore[arg-type]


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), kind=st.sampled_from(KINDS), skip=st.booleans())
def test_stream_of_random_ids_equals_decode(
    data: st.DataObject, kind: str, skip: bool, tokenizers_: dict[str, Tokenizer]
) -> None:
    """Any ids at all, byte pieces and special tokens among them (and ids past the vocabulary)."""
    tok = tokenizers_[kind]
    byte_pieces = sorted(tok._byte_piece_ids())
    ids_ = st.integers(0, len(tok) + 2)
    if byte_pieces:
        ids_ = ids_ | st.sampled_from(byte_pieces)
    ids = data.draw(st.lists(ids_, max_size=40))
    pieces, rest = _stream(tok, ids, skip)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(
        alphabet=st.sampled_from("ab 你好龍𠜎😀🎉👍🏽\u200d🇨🇦é\n\t")
        | st.characters(codec="utf-8", exclude_categories=("Cs",)),
        max_size=40,
    ),
    kind=st.sampled_from(KINDS),
)
def test_stream_of_encoded_text_equals_decode(
    text: str, kind: str, tokenizers_: dict[str, Tokenizer]
) -> None:
    tok = tokenizers_[kind]
    ids = tok.encode(text)
    pieces, rest = _stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids)


# ------------------------------------------------------------------------------ no transformers
def test_works_without_transformers(folders: dict[str, Path]) -> None:
    """Loading, encoding, decoding, chat templates and streaming import no transformers."""
    script = f"""
import sys
sys.modules["transformers"] = None  # any import of it fails
from mila_py.interop import Tokenizer
tok = Tokenizer.from_pretrained({str(folders["sentencepiece"])!r})
ids = tok.apply_chat_template([{{"role": "user", "content": "hi 😀"}}], add_generation_prompt=True)
d = tok.stream_decoder()
text = "".join(d.push(i) for i in ids) + d.flush()
assert text == tok.decode(ids) and "hi 😀" in text, text
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
