"""Chat templates: a conversation (a list of ``{"role", "content", ...}`` dicts) rendered to the
prompt text a chat model was trained on, with the Jinja template its ``tokenizer_config.json``
carries, exactly as transformers' ``apply_chat_template(..., tokenize=False)`` renders it.

Templates come with checkpoints, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of the
data they are given), and everything a template sees is first rebuilt from plain JSON types
(dicts, lists, strings, numbers, booleans, None). The environment is the one transformers builds:

- ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``), and a ``{% generation %}...{% endgeneration %}`` block
  that renders its body (transformers uses it to mark assistant tokens);
- a ``tojson`` filter that does not escape HTML (``json.dumps`` with ``ensure_ascii=False`` and
  the ``indent``, ``separators`` and ``sort_keys`` options);
- the globals ``raise_exception(message)`` (raises :class:`ChatTemplateError`),
  ``strftime_now(format)`` (the local time now), and sandboxed ``dict`` and ``namespace``
  (a namespace refuses names that start with ``_``);
- the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, plus any
  extra keyword (a tokenizer passes its special tokens: ``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "render_chat_template", "select_chat_template"]

#: what a message's reasoning may be called; the first is the name chat templates read
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: the marker put after the final message for ``continue_final_message``, as transformers does
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template that does not compile, fails while rendering, or rejects its input
    through ``raise_exception(message)``; :attr:`message` is the template's own message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def select_chat_template(
    templates: str | Mapping[str, str] | None,
    chat_template: str | None = None,
    *,
    tools: Sequence[Any] | None = None,
) -> str:
    """The template source to render, chosen as transformers chooses it.

    Args:
        templates: a tokenizer's template (one string) or named templates.
        chat_template: a template source, or the name of one of ``templates``; None for the
            default (``"tool_use"`` when ``tools`` are given and there is one, else
            ``"default"``).
        tools: the tools a caller passes, which pick the ``"tool_use"`` template.

    Raises:
        ValueError: no template to render (none given and none named ``"default"``).
    """
    if isinstance(templates, Mapping):
        if chat_template is not None:
            return templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(
            f"select_chat_template: the tokenizer has several chat templates "
            f"{sorted(templates)} and none named 'default'; pass chat_template=<one of them>"
        )
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ValueError(
            "select_chat_template: the tokenizer has no chat template (no 'chat_template' in "
            "its tokenizer_config.json and no chat_template.jinja); pass chat_template=<jinja "
            "source>"
        )
    return templates


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render one conversation with ``template``, as transformers renders it.

    Args:
        template: the Jinja source (see :func:`select_chat_template`).
        messages: the conversation, oldest first: dicts with at least ``role``; keys whose
            value is None are dropped (templates test for a missing key, and would print
            ``None``), and ``reasoning``/``thinking`` are also given as ``reasoning_content``.
        add_generation_prompt: end with the header that starts an assistant turn.
        continue_final_message: leave the final message open so the model continues it
            (``True`` continues its ``content``; a string names the field to continue).
            Cannot be combined with ``add_generation_prompt``.
        tools: JSON schemas of the tools the model may call (``{"type": "function",
            "function": {...}}``), for templates that support tool use.
        documents: dicts (usually ``title`` and ``text``) for retrieval-augmented templates.
        **variables: further template variables, e.g. ``bos_token``, ``eos_token``,
            ``enable_thinking``.

    Returns:
        The rendered prompt text.

    Raises:
        ChatTemplateError: the template does not compile, fails while rendering, or calls
            ``raise_exception`` (e.g. for a role it does not support).
        ValueError: an empty conversation, or ``continue_final_message`` without a final
            message to continue or together with ``add_generation_prompt``.
        TypeError: a message, tool or document that is not a dict (a tool given as a Python
            function: pass its JSON schema).
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise TypeError(
            f"render_chat_template: messages must be a list of dicts, got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise ValueError("render_chat_template: the conversation is empty (no messages)")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "render_chat_template: continue_final_message and add_generation_prompt cannot be "
            "combined (one continues the last message, the other starts a new assistant turn)"
        )
    chat = _conversation(messages)
    tool_schemas = _checked_dicts(tools, "tools")
    docs = _checked_dicts(documents, "documents")
    compiled = _compile(template)
    field: str | None = None
    final: str | None = None
    if continue_final_message:
        field, final = _mark_final_message(chat, template, continue_final_message)
    context = {
        **_plain(variables),
        "messages": chat,
        "tools": tool_schemas,
        "documents": docs,
        "add_generation_prompt": bool(add_generation_prompt),
    }
    try:
        rendered: str = compiled.render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(
            f"chat template failed while rendering ({type(exc).__name__}: {exc})"
        ) from exc
    if field is not None and final is not None:
        rendered = _cut_at_final_message(rendered, final)
    return rendered


def _conversation(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The messages as fresh plain dicts: keys with None values dropped, reasoning aliased."""
    chat = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise TypeError(
                f"render_chat_template: message {i} must be a dict with 'role' and 'content', "
                f"got {type(messages[i]).__name__}"
            )
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _checked_dicts(items: Sequence[Any] | None, what: str) -> list[Any] | None:
    if items is None:
        return None
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
        raise TypeError(f"render_chat_template: {what} must be a list of dicts, got {items!r}")
    for item in items:
        if not isinstance(item, Mapping):
            hint = " (pass a tool's JSON schema, not the function)" if callable(item) else ""
            raise TypeError(f"render_chat_template: {what} must be dicts, got {item!r}{hint}")
    plain: list[Any] = _plain(list(items))
    return plain


def _mark_final_message(
    chat: list[dict[str, Any]], template: str, continue_final_message: bool | str
) -> tuple[str, str]:
    """Append the continue marker to the final message's field; the field and its text."""
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    last = chat[-1]
    final = last.get(field)
    if final is None:
        raise ValueError(
            f"render_chat_template: continue_final_message is set but the final message has no "
            f"{field!r} to continue"
        )
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(
            f"render_chat_template: continue_final_message={field!r}, but the chat template "
            f"never reads that field"
        )
    if isinstance(final, list):
        for block in reversed(final):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text: str = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return field, text
        raise ValueError(
            "render_chat_template: continue_final_message is set but the final message has no "
            "text block to continue"
        )
    if not isinstance(final, str):
        raise TypeError(
            f"render_chat_template: the final message's {field!r} must be a string or a list of "
            f"content blocks to continue it, got {type(final).__name__}"
        )
    for f in fields:
        last[f] = last[f] + _CONTINUE_TAG
    return field, final


def _cut_at_final_message(rendered: str, final: str) -> str:
    """The rendered text up to the continue marker (the final message left open)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "render_chat_template: continue_final_message is set but the final message does not "
            "appear in the rendered chat (the template changes or drops it)"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # the template trimmed the message's trailing space, so trim what precedes the marker too
    return rendered[:at].rstrip()


def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types, so a template cannot reach the methods of rich
    objects (arrays, images, subclasses of str); anything else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":  # NumPy scalars
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic models, e.g. the OpenAI client's messages
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template: builds plain dicts, and exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` in a template, refusing names that start with ``_`` (which could
    reach Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot store {name!r} on a namespace (names starting with '_' "
                f"are refused)"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged (transformers
    records where assistant text starts and ends with it; rendering does not depend on it)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads the class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=1)
def _shared_environment() -> ImmutableSandboxedEnvironment:
    return _environment()


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """``template`` compiled once (templates are long and rendered once per request)."""
    if not isinstance(template, str):
        raise TypeError(
            f"render_chat_template: the template must be a string of Jinja source, got "
            f"{type(template).__name__}"
        )
    try:
        return _shared_environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from exc
