"""Text to token ids and back for Hugging Face checkpoints: a :class:`Tokenizer` over the
``tokenizers`` library's ``tokenizer.json`` (no tokenization is written here), with the special
tokens, legacy BOS/EOS flags and chat templates of ``tokenizer_config.json``, and a
:class:`StreamDecoder` that turns generated ids into text one token at a time.

It reads a folder as transformers' ``AutoTokenizer`` reads it into a fast tokenizer (the
tests compare the two on the same files), without needing transformers:

- ``tokenizer.json``: the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
  decoder, added tokens). Its truncation and padding settings are switched off, as
  transformers switches them off for a plain ``encode``.
- ``tokenizer_config.json``: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` (and
  ``sep_token``, ``cls_token``, ``mask_token``), each a string or an ``AddedToken`` dict;
  ``additional_special_tokens`` / ``extra_special_tokens``; ``chat_template`` (a string, or a
  list of ``{"name", "template"}`` dicts); ``split_special_tokens``; and ``add_bos_token`` /
  ``add_eos_token``, which apply only where ``tokenizer.json`` has no post-processor (the
  layout of older conversions, in which those flags were the only record of the BOS/EOS
  rule; a post-processor, where there is one, decides, as transformers 5 reads it).
- ``special_tokens_map.json``: the legacy place of the special tokens, read over the config's
  where the config has no ``added_tokens_decoder`` (as transformers does).
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja``: templates saved as files
  (transformers 4.43 and later); they replace the config's templates.

As in transformers, a named or extra special token that is not yet an added token of
``tokenizer.json`` is added as a special one (so text containing it encodes it as one token,
and ``skip_special_tokens`` drops it).
"""

from __future__ import annotations

import json
import numbers
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from mila_py.files import atomic_write_all
from mila_py.interop.chat_template import render_chat_template, select_chat_template

__all__ = ["SPECIAL_TOKEN_NAMES", "StreamDecoder", "Tokenizer"]

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_NAME = "special_tokens_map.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

#: the named special tokens, in transformers' order (the variables a chat template receives)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# config keys this module writes itself; every other key of a loaded config is saved unchanged
_OWN_KEYS = (*SPECIAL_TOKEN_NAMES, "chat_template", "add_bos_token", "add_eos_token")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")
# a byte-fallback piece: what tokenizers' ByteFallback decoder turns into one byte
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT = "\ufffd"

Token = str | AddedToken
ChatTemplate = str | Mapping[str, str]


class Tokenizer:
    """A Hugging Face tokenizer: ``encode``, ``decode``, special tokens, chat templates.

    Build it with :meth:`from_pretrained` from a checkpoint folder; the constructor takes a
    ``tokenizers.Tokenizer`` and owns it from then on (it may add special tokens to it).

    Args:
        backend: the ``tokenizers`` pipeline.
        bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token: the
            named special tokens (a string or an ``AddedToken``), or None.
        extra_special_tokens: further special tokens (``additional_special_tokens``).
        chat_template: the Jinja chat template, or named templates (``"default"`` is used
            unless a call names another).
        add_bos_token, add_eos_token: where ``backend`` has no post-processor, whether
            ``encode(..., add_special_tokens=True)`` puts BOS first / EOS last (None: no).
        split_special_tokens: encode special tokens found in text as ordinary text.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``add_bos_token``/``add_eos_token`` without the token to add.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: Token | None = None,
        eos_token: Token | None = None,
        unk_token: Token | None = None,
        sep_token: Token | None = None,
        pad_token: Token | None = None,
        cls_token: Token | None = None,
        mask_token: Token | None = None,
        extra_special_tokens: Sequence[Token] = (),
        chat_template: ChatTemplate | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        split_special_tokens: bool = False,
    ) -> None:
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(
                f"Tokenizer: backend must be a tokenizers.Tokenizer, got {type(backend).__name__}"
            )
        named = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "sep_token": sep_token,
            "pad_token": pad_token,
            "cls_token": cls_token,
            "mask_token": mask_token,
        }
        for name, token in named.items():
            if token is not None and not isinstance(token, str | AddedToken):
                raise TypeError(
                    f"Tokenizer: {name} must be a str or a tokenizers.AddedToken, got {token!r}"
                )
        extra = list(extra_special_tokens)
        for token in extra:
            if not isinstance(token, str | AddedToken):
                raise TypeError(
                    f"Tokenizer: extra_special_tokens must be strs or AddedTokens, got {token!r}"
                )
        _check_template(chat_template, "Tokenizer: chat_template")
        for name, flag in (("add_bos_token", add_bos_token), ("add_eos_token", add_eos_token)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"Tokenizer: {name} must be a bool or None, got {flag!r}")
            token = named[name.removeprefix("add_")]
            if flag and token is None:
                raise ValueError(
                    f"Tokenizer: {name}=True but there is no {name.removeprefix('add_')} to add"
                )
        if not isinstance(split_special_tokens, bool):
            raise TypeError(
                f"Tokenizer: split_special_tokens must be a bool, got {split_special_tokens!r}"
            )
        self._backend = backend
        self._special = {name: _content(t) for name, t in named.items() if t is not None}
        self._extra = [_content(t) for t in extra]
        self._chat_template: ChatTemplate | None = (
            dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        )
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._split_special_tokens = split_special_tokens
        self._config: dict[str, Any] = {}  # the loaded tokenizer_config.json, saved back
        self._byte_ids: frozenset[int] | None = None

        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = []
        for token in [*(t for t in named.values() if t is not None), *extra]:
            added = _as_special(token)
            if added.content not in present:
                present.add(added.content)
                missing.append(added)
        if missing:
            backend.add_tokens(missing)
        if backend.post_processor is None and (add_bos_token or add_eos_token):
            backend.post_processor = self._bos_eos_processor()

    # ------------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint folder (see the module's docstring for
        the files read). Nothing is downloaded.

        Raises:
            FileNotFoundError: ``folder`` is not a folder or has no ``tokenizer.json``.
            ValueError: a file that is not valid JSON, or a key of the wrong type (the message
                names the key and the file).
        """
        root = Path(folder)
        if not root.is_dir():
            raise FileNotFoundError(f"Tokenizer.from_pretrained: {root} is not a folder")
        file = root / TOKENIZER_NAME
        if not file.is_file():
            hint = (
                " (it has a SentencePiece tokenizer.model: convert it once with transformers, "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
                if (root / "tokenizer.model").is_file()
                else ""
            )
            raise FileNotFoundError(
                f"Tokenizer.from_pretrained: {root} has no {TOKENIZER_NAME}{hint}"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:
            raise ValueError(
                f"Tokenizer.from_pretrained: {file} is not a tokenizers file ({exc})"
            ) from exc
        config_file = root / TOKENIZER_CONFIG_NAME
        config = _read_json(config_file) if config_file.is_file() else {}
        map_file = root / SPECIAL_TOKENS_MAP_NAME
        sources = {key: config_file for key in config}
        if map_file.is_file() and "added_tokens_decoder" not in config:
            special_map = _read_json(map_file)
            config = {**config, **special_map}
            sources.update(dict.fromkeys(special_map, map_file))

        def where(key: str) -> str:
            return f"{key!r} of {sources.get(key, config_file)}"

        named = {name: _config_token(config.get(name), where(name)) for name in SPECIAL_TOKEN_NAMES}
        extra = _config_extra_tokens(config, where)
        template = _config_template(config.get("chat_template"), where("chat_template"))
        files_template = _template_files(root)
        if files_template is not None:
            template = files_template
        flags = {}
        for key in ("add_bos_token", "add_eos_token", "split_special_tokens"):
            value = config.get(key)
            if value is not None and not isinstance(value, bool):
                raise ValueError(
                    f"Tokenizer.from_pretrained: {where(key)} must be true or false, got {value!r}"
                )
            flags[key] = value
        try:
            tokenizer = cls(
                backend,
                **named,
                extra_special_tokens=extra,
                chat_template=template,
                add_bos_token=flags["add_bos_token"],
                add_eos_token=flags["add_eos_token"],
                split_special_tokens=bool(flags["split_special_tokens"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"Tokenizer.from_pretrained: {root}: {exc}") from exc
        tokenizer._config = {k: v for k, v in config.items() if k not in _OWN_KEYS}
        return tokenizer

    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (created if
        missing), all or nothing; :meth:`from_pretrained` and transformers read them back to
        the same tokenizer. The keys of a loaded ``tokenizer_config.json`` that this class
        does not own are written back unchanged. Where ``folder`` already holds a
        ``chat_template.jinja`` (which readers prefer to the config's template), it is
        rewritten with this tokenizer's default template too.

        Raises:
            OSError: a file could not be written (no file is changed then).
        """
        root = Path(folder)
        root.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = dict(self._config)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for name, content in self._special.items():
            config[name] = content
        for key, flag in (
            ("add_bos_token", self._add_bos_token),
            ("add_eos_token", self._add_eos_token),
        ):
            if flag is not None:
                config[key] = flag
        if self._split_special_tokens:
            config["split_special_tokens"] = True
        if self._extra and "extra_special_tokens" not in config:
            config["additional_special_tokens"] = list(self._extra)
        template = self._chat_template
        if isinstance(template, Mapping):
            config["chat_template"] = [{"name": k, "template": v} for k, v in template.items()]
        elif template is not None:
            config["chat_template"] = template
        tokenizer_text = self._backend.to_str(pretty=True)
        config_text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        files: list[tuple[str | os.PathLike[str], Any]] = [
            (root / TOKENIZER_NAME, lambda p: p.write_text(tokenizer_text, encoding="utf-8")),
            (root / TOKENIZER_CONFIG_NAME, lambda p: p.write_text(config_text, encoding="utf-8")),
        ]
        default = template.get("default") if isinstance(template, Mapping) else template
        if (root / CHAT_TEMPLATE_NAME).is_file() and default is not None:
            files.append(
                (root / CHAT_TEMPLATE_NAME, lambda p: p.write_text(default, encoding="utf-8"))
            )
        atomic_write_all(files, who="Tokenizer.save_pretrained")

    # ---------------------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``; with ``add_special_tokens`` the post-processor's (BOS
        first for Llama), as ``AutoTokenizer.encode`` gives them.

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (one id, a list, a tuple or a 1-D integer array), as
        ``AutoTokenizer.decode`` gives it. Ids beyond the vocabulary decode to nothing, as
        in transformers (a model's embedding may be padded past the tokenizer's ids).

        Raises:
            TypeError: an id that is not an int.
            ValueError: a negative id.
        """
        return self._backend.decode(
            self._ids(ids, "decode"), skip_special_tokens=skip_special_tokens
        )

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A :class:`StreamDecoder` over this tokenizer: text as ids arrive."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token ``token`` (a vocabulary entry, not text), or None."""
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id``, or None where there is none."""
        token: str | None = self._backend.id_to_token(int(token_id))
        return token

    # ------------------------------------------------------------------------ special tokens
    @property
    def bos_token(self) -> str | None:
        """The beginning-of-sequence token, or None."""
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The end-of-sequence token (the config's; a chat model may stop at more ids, see
        :class:`~mila_py.interop.generation_config.GenerationDefaults`), or None."""
        return self._special.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """The padding token, or None."""
        return self._special.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        """The unknown-text token, or None."""
        return self._special.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        """The id of :attr:`bos_token`, or None."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of :attr:`eos_token`, or None."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """The id of :attr:`pad_token`, or None."""
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        """The id of :attr:`unk_token`, or None."""
        return self._special_id("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set, e.g. ``{"bos_token": "<s>", ...}`` (what a
        chat template receives as variables)."""
        return {name: self._special[name] for name in SPECIAL_TOKEN_NAMES if name in self._special}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once (transformers' order)."""
        named = [self._special[n] for n in SPECIAL_TOKEN_NAMES if n in self._special]
        return list(dict.fromkeys([*named, *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of :attr:`all_special_tokens`, in the same order."""
        ids = [self.token_to_id(token) for token in self.all_special_tokens]
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        """The size of the base vocabulary, without added tokens (transformers' meaning);
        ``len(tokenizer)`` counts them too."""
        size: int = self._backend.get_vocab_size(with_added_tokens=False)
        return size

    def __len__(self) -> int:
        """The number of ids, added tokens included (transformers' ``len(tokenizer)``)."""
        size: int = self._backend.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` underneath."""
        return self._backend

    # ---------------------------------------------------------------------------- chat
    @property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template source, named templates, or None."""
        return self._chat_template

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Render a conversation with the chat template and, with ``tokenize``, encode it,
        as transformers' ``apply_chat_template(..., return_dict=False)`` does.

        Args:
            conversation: the messages (dicts with ``role`` and ``content``), oldest first;
                or a list of such conversations.
            tools: tool JSON schemas, for templates that support tool use.
            documents: dicts for retrieval-augmented templates.
            chat_template: a template source or the name of one of the tokenizer's
                templates; None for the default.
            add_generation_prompt: end with the header that opens an assistant turn.
            continue_final_message: leave the final message open for the model to continue.
            tokenize: return token ids (encoded without adding special tokens: the template
                writes them) instead of the text.
            **kwargs: further template variables; they override the special tokens.

        Returns:
            ``list[int]`` (tokenize) or ``str``; for a list of conversations, a list of them.

        Raises:
            ChatTemplateError: the template fails or rejects the conversation (a ValueError).
            ValueError: no chat template, or an empty conversation.
            TypeError: a message that is not a dict.
        """
        template = select_chat_template(self._chat_template, chat_template, tools=tools)
        batched = (
            isinstance(conversation, Sequence)
            and len(conversation) > 0
            and isinstance(conversation[0], Sequence)
            and not isinstance(conversation[0], str | Mapping)
        )
        chats: Sequence[Any] = conversation if batched else [conversation]
        variables = {**self.special_tokens_map, **kwargs}
        results: list[Any] = []
        for chat in chats:
            text = render_chat_template(
                template,
                chat,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                **variables,
            )
            results.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        return results if batched else results[0]

    # ---------------------------------------------------------------------------- internals
    def _special_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self.token_to_id(token)

    def _ids(self, ids: int | Iterable[int], who: str) -> list[int]:
        if isinstance(ids, str | bytes):
            raise TypeError(f"Tokenizer.{who}: ids must be a sequence of ints, got a str")
        # numbers.Integral: Python and NumPy integers (bool too, refused below)
        items: Iterable[Any] = [ids] if isinstance(ids, int | numbers.Integral) else ids
        out = []
        for i in items:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"Tokenizer.{who}: ids must be ints, got {i!r}")
            value = int(i)
            if value < 0:
                raise ValueError(f"Tokenizer.{who}: ids must be >= 0, got {value}")
            out.append(value)
        return out

    def _bos_eos_processor(self) -> processors.PostProcessor:
        """The post-processor of the legacy flags (transformers' ``update_post_processor``)."""
        bos, eos = self._special.get("bos_token"), self._special.get("eos_token")
        add_bos = bool(self._add_bos_token) and bos is not None
        add_eos = bool(self._add_eos_token) and eos is not None
        single = f"{bos}:0 " * add_bos + "$A:0" + f" {eos}:0" * add_eos
        pair = single + f" {bos}:1" * add_bos + " $B:1" + f" {eos}:1" * add_eos
        specials = [
            (t, self._backend.token_to_id(t))
            for t, on in ((bos, add_bos), (eos, add_eos))
            if on and t is not None
        ]
        return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def _skipped_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` drops: every added token marked
        special (those of ``tokenizer.json`` too, not only :attr:`all_special_ids`)."""
        decoder = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)

    def _byte_piece_ids(self) -> frozenset[int]:
        """The ids of the vocabulary's ``<0xXX>`` byte-fallback pieces."""
        if self._byte_ids is None:
            vocab = self._backend.get_vocab(with_added_tokens=False)
            self._byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t))
        return self._byte_ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, len={len(self)}, "
            f"special_tokens={self.special_tokens_map}, "
            f"chat_template={'yes' if self._chat_template is not None else 'no'})"
        )


class StreamDecoder:
    """Generated ids to text, one id at a time: :meth:`push` returns the text that is final,
    :meth:`flush` the rest; everything returned, joined, is ``tokenizer.decode(ids)``.

    Text is held back while it could still change: while it ends in U+FFFD (an incomplete
    UTF-8 character, e.g. the first of a character's byte-level pieces or ``<0xE2>`` byte
    pieces) and while the last id that decodes to something is a ``<0xXX>`` byte piece (a
    following byte piece may join it, or make its whole group invalid: tokenizers' byte
    fallback decodes a run of byte pieces together, each one U+FFFD if the run is not UTF-8). Each step decodes a short window of ids, starting at the
    previous step's ids, so a decoder that strips the first leading space (SentencePiece's
    ``▁``) strips it on both sides of the comparison and spaces between pieces survive.

    Args:
        tokenizer: the :class:`Tokenizer` whose ``decode`` to follow.
        skip_special_tokens: as for :meth:`Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"StreamDecoder: tokenizer must be a mila_py Tokenizer, got "
                f"{type(tokenizer).__name__}"
            )
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_ids = tokenizer._byte_piece_ids()
        # ids that decode drops (specials when skipping them, ids past the vocabulary) leave
        # the byte pieces around them adjacent, so they do not end a byte group
        self._dropped = tokenizer._skipped_ids() if skip_special_tokens else frozenset()
        self._size = len(tokenizer)
        self._ids: list[int] = []
        self._in_bytes = False  # the last id decode keeps is a byte piece
        self._prefix = 0  # the window starts here: ids already returned, kept for context
        self._read = 0  # ids before this have been returned as text

    @property
    def ids(self) -> list[int]:
        """The ids pushed since the start or the last :meth:`flush`."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; the new text that is final ("" while it may still change).

        Raises:
            TypeError: ``token_id`` is not an int.
            ValueError: ``token_id`` is negative.
        """
        (value,) = self._tokenizer._ids([token_id], "StreamDecoder.push")
        self._ids.append(value)
        if value < self._size and value not in self._dropped:
            self._in_bytes = value in self._byte_ids
        if self._in_bytes:
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if (
            len(text) <= len(prefix_text)
            or text.endswith(_REPLACEMENT)
            or not text.startswith(prefix_text)
        ):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The text held back (the sequence has ended), and a fresh start for the next one."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._ids, self._prefix, self._read, self._in_bytes = [], 0, 0, False
        return text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        text: str = self._tokenizer.backend.decode(ids, skip_special_tokens=self._skip)
        return text


# -------------------------------------------------------------------------- config reading
def _content(token: Token) -> str:
    return token.content if isinstance(token, AddedToken) else token


def _as_special(token: Token) -> AddedToken:
    """``token`` as the special added token transformers adds for it."""
    if isinstance(token, str):
        return AddedToken(token, special=True)
    return AddedToken(
        token.content,
        single_word=token.single_word,
        lstrip=token.lstrip,
        rstrip=token.rstrip,
        normalized=token.normalized,
        special=True,
    )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"Tokenizer.from_pretrained: {file} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(
            f"Tokenizer.from_pretrained: {file} holds a {type(value).__name__}, not a JSON object"
        )
    return value


def _config_token(value: Any, where: str) -> Token | None:
    """A special token as a config writes it: a string, or an ``AddedToken`` dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        flags = {}
        for field in _ADDED_TOKEN_FIELDS:
            flag = value.get(field)
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(
                    f"Tokenizer.from_pretrained: {where}: {field} must be true or false, got {flag!r}"
                )
            if flag is not None:
                flags[field] = flag
        return AddedToken(value["content"], **flags)
    raise ValueError(
        f"Tokenizer.from_pretrained: {where} must be a string or an AddedToken object with a "
        f"string 'content', got {value!r}"
    )


def _config_extra_tokens(config: Mapping[str, Any], where: Any) -> list[Token]:
    for key in ("extra_special_tokens", "additional_special_tokens"):
        value = config.get(key)
        if value is None or value == [] or value == {}:
            continue
        if isinstance(value, dict):  # named model-specific tokens, e.g. {"image_token": "<image>"}
            items = list(value.values())
        elif isinstance(value, list):
            items = value
        else:
            raise ValueError(
                f"Tokenizer.from_pretrained: {where(key)} must be a list of tokens, got {value!r}"
            )
        tokens = [_config_token(item, where(key)) for item in items]
        return [t for t in tokens if t is not None]
    return []


def _config_template(value: Any, where: str) -> ChatTemplate | None:
    """``chat_template``: a string, or a list of ``{"name", "template"}`` dicts."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and isinstance(item.get("template"), str)
        for item in value
    ):
        return {item["name"]: item["template"] for item in value}
    raise ValueError(
        f"Tokenizer.from_pretrained: {where} must be a string or a list of "
        f'{{"name": str, "template": str}} objects, got {type(value).__name__}'
    )


def _template_files(root: Path) -> ChatTemplate | None:
    """The templates saved as files, which take priority over the config's."""
    templates: dict[str, str] = {}
    default = root / CHAT_TEMPLATE_NAME
    if default.is_file():
        templates["default"] = _read_text(default)
    folder = root / CHAT_TEMPLATE_DIR
    if folder.is_dir():
        for file in sorted(folder.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    if not templates:
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"Tokenizer.from_pretrained: {file} is not UTF-8 text ({exc})") from exc


def _check_template(template: Any, who: str) -> None:
    if template is None or isinstance(template, str):
        return
    if isinstance(template, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in template.items()
    ):
        return
    raise TypeError(f"{who} must be a str, a mapping of names to strs, or None; got {template!r}")
