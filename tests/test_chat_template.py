"""Chat templates render exactly as transformers renders them (``apply_chat_template(...,
tokenize=False)``): the same sandboxed jinja2 environment, filters, globals and variables."""

from __future__ import annotations

import datetime
import re
from typing import Any

import numpy as np
import pytest
from chat_templates import (
    ALL,
    ALTERNATE_MESSAGE,
    ALTERNATING,
    CHATML,
    CONVERSATIONS,
    LLAMA3,
    LOOP_CONTROLS,
    NAMESPACE_GENERATION,
    SYSTEM_CONVERSATION,
)
from hf_versions import skip_before_verified_transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_helpers import byte_level_tokenizer

from mila_py.interop.chat_template import (
    ChatTemplateError,
    render_chat_template,
    select_chat_template,
)

SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city — «today».",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "e.g. Zürich, 東京"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in 東京?"},
    {
        "role": "assistant",
        "content": None,  # dropped before rendering, as the OpenAI API sends it
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}
        ],
    },
    {"role": "tool", "content": '{"temp": 21, "sky": "☀"}'},
    {"role": "tool", "content": "second <b>result</b> & more"},
]


@pytest.fixture(scope="module")
def hf() -> Any:
    """transformers' fast tokenizer whose special tokens are exactly ``SPECIALS``."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is the reference these renderings are compared to"
    )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), **SPECIALS)
    assert tok.special_tokens_map == SPECIALS
    return tok


def reference(hf: Any, template: str, messages: Any, **kwargs: Any) -> str:
    text: str = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    return text


def render(template: str, messages: Any, **kwargs: Any) -> str:
    return render_chat_template(template, messages, **SPECIALS, **kwargs)


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_as_transformers(
    hf: Any, name: str, conversation: int, add_generation_prompt: bool
) -> None:
    template, messages = ALL[name], CONVERSATIONS[conversation]
    expected = reference(hf, template, messages, add_generation_prompt=add_generation_prompt)
    got = render(template, messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got  # every template writes something for these conversations


@pytest.mark.parametrize("template", [LLAMA3, CHATML, LOOP_CONTROLS, NAMESPACE_GENERATION])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_system_turns(hf: Any, template: str, add_generation_prompt: bool) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt}
    assert render(template, SYSTEM_CONVERSATION, **kwargs) == reference(
        hf, template, SYSTEM_CONVERSATION, **kwargs
    )


def test_generation_prompt_is_a_suffix(hf: Any) -> None:
    """The generation prompt only appends the assistant header (what a chat server relies on)."""
    for template in (LLAMA3, CHATML):
        messages = CONVERSATIONS[1]
        plain, prompted = (
            render(template, messages),
            render(template, messages, add_generation_prompt=True),
        )
        assert prompted.startswith(plain) and len(prompted) > len(plain)
        assert prompted == reference(hf, template, messages, add_generation_prompt=True)


def test_loop_controls_skip_and_stop(hf: Any) -> None:
    """``continue`` drops the system turn and ``break`` stops at STOP: later turns are absent."""
    messages = [{"role": "system", "content": "sys"}, *CONVERSATIONS[2]]
    got = render(LOOP_CONTROLS, messages)
    assert got == reference(hf, LOOP_CONTROLS, messages)
    assert "sys" not in got and "日本語" not in got and "你好" in got


def test_tools_and_tool_calls_render_as_transformers(hf: Any) -> None:
    """Tools go through the HTML-safe ``tojson`` (non-ASCII kept, ``<``/``&`` not escaped);
    a ``content`` of None is dropped so the template sees no content."""
    for add_generation_prompt in (False, True):
        kwargs = {"tools": TOOLS, "add_generation_prompt": add_generation_prompt}
        got = render(CHATML, TOOL_CONVERSATION, **kwargs)
        assert got == reference(hf, CHATML, TOOL_CONVERSATION, **kwargs)
    assert '"description": "e.g. Zürich, 東京"' in got
    assert "<b>result</b> & more" in got
    assert "None" not in got


def test_tojson_options_as_transformers(hf: Any) -> None:
    template = (
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=True) }}|"
        "{{ messages[0] | tojson(separators=(',', ':'), ensure_ascii=True) }}"
    )
    messages = [
        {"role": "user", "content": "<a href='x'>&</a> é 🎉", "z": 1, "a": [1.5, True, None]}
    ]
    assert render(template, messages) == reference(hf, template, messages)


def test_raise_exception_is_a_value_error_with_the_templates_message(hf: Any) -> None:
    jinja2 = pytest.importorskip("jinja2")
    wrong_order = [{"role": "assistant", "content": "first"}]
    wrong_role = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    for messages, message in (
        (wrong_order, ALTERNATE_MESSAGE),
        (wrong_role, "Only user and assistant roles are supported!"),
    ):
        with pytest.raises(ChatTemplateError) as caught:
            render(ALTERNATING, messages)
        assert isinstance(caught.value, ValueError)
        assert str(caught.value) == caught.value.message == message
        with pytest.raises(jinja2.TemplateError, match=re.escape(message)):
            reference(hf, ALTERNATING, messages)
    ok = CONVERSATIONS[1]
    assert render(ALTERNATING, ok) == reference(hf, ALTERNATING, ok)


def test_extra_variables_reach_the_template_and_override_special_tokens(hf: Any) -> None:
    template = "{{ bos_token }}|{{ eos_token }}|{{ enable_thinking }}|{{ messages[0].content }}"
    messages = [{"role": "user", "content": "x"}]
    kwargs = {"enable_thinking": False, "bos_token": "<BOS>"}
    got = render_chat_template(template, messages, **{**SPECIALS, **kwargs})
    assert got == "<BOS>|<|eot_id|>|False|x" == reference(hf, template, messages, **kwargs)


def test_documents_and_reasoning_fields_as_transformers(hf: Any) -> None:
    template = (
        "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}={{ m.content }}"
        "{% if m.reasoning_content is defined %}({{ m.reasoning_content }}/{{ m.thinking }}){% endif %};"
        "{% endfor %}"
    )
    documents = [{"title": "Doc", "text": "Text 📄"}, {"title": "Two", "text": "…"}]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "because"},
    ]
    got = render(template, messages, documents=documents)
    assert "(because/because)" in got
    skip_before_verified_transformers("reasoning fields aliased", since=(5, 24))
    assert got == reference(hf, template, messages, documents=documents)


def test_continue_final_message_as_transformers(hf: Any) -> None:
    messages = [
        {"role": "user", "content": "Write a haiku"},
        {"role": "assistant", "content": "Autumn moonlight—"},
    ]
    for template in (CHATML, LLAMA3):
        got = render(template, messages, continue_final_message=True)
        assert got == reference(hf, template, messages, continue_final_message=True)
        assert got.endswith("Autumn moonlight—")
    with pytest.raises(ValueError, match="cannot be combined"):
        render(CHATML, messages, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ValueError, match="no 'reasoning_content'"):
        render(CHATML, messages, continue_final_message="reasoning_content")


def test_template_data_is_plain(hf: Any) -> None:
    """Rich objects reach the template as plain values or a placeholder naming their type."""

    class Opaque:
        def secret(self) -> str:
            return "leaked"

    template = (
        "{% for m in messages %}{{ m.content }}|{{ m.n }}|{{ m.flag }}|{{ m.obj }};{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "a", "n": np.int64(7), "flag": np.bool_(False), "obj": Opaque()}
    ]
    got = render(template, messages)
    assert got == "a|7|False|<Opaque>;"
    skip_before_verified_transformers("rich objects as placeholders", since=(5, 24))
    assert got == reference(hf, template, messages)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
        "{% set ns = namespace(_private=1) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_unsafe_templates(hf: Any, template: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="chat template failed while rendering"):
        render(template, messages)
    skip_before_verified_transformers("its sandbox's refusals", since=(5, 24))
    with pytest.raises(Exception):  # noqa: B017 (transformers raises jinja2's own errors)
        reference(hf, template, messages)


def test_strftime_now_is_the_local_time() -> None:
    before = datetime.datetime.now().strftime("%Y-%m-%d")
    got = render("{{ strftime_now('%Y-%m-%d') }}", [{"role": "user", "content": ""}])
    after = datetime.datetime.now().strftime("%Y-%m-%d")
    assert got in {before, after}


def test_syntax_errors_and_bad_input() -> None:
    with pytest.raises(ChatTemplateError, match=r"does not compile: .* \(line 1\)"):
        render("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        render(LLAMA3, [])
    with pytest.raises(TypeError, match="message 1 must be a dict"):
        render(LLAMA3, [{"role": "user", "content": "x"}, "hello"])
    with pytest.raises(TypeError, match="list of dicts"):
        render(LLAMA3, "hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="JSON schema, not the function"):
        render(CHATML, CONVERSATIONS[0], tools=[len])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="documents must be dicts"):
        render(CHATML, CONVERSATIONS[0], documents=["text"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        render("{{ messages[0].missing.deeper }}", [{"role": "user", "content": "x"}])


def test_inputs_are_left_unchanged() -> None:
    messages = [{"role": "user", "content": "hi", "name": None}]
    before = repr(messages)
    render(CHATML, messages, continue_final_message=True)
    assert repr(messages) == before


def test_select_chat_template() -> None:
    named = {"default": "D", "tool_use": "T", "rag": "R"}
    assert select_chat_template(named) == "D"
    assert select_chat_template(named, tools=[{}]) == "T"
    assert select_chat_template(named, "rag") == "R"
    assert select_chat_template(named, "{{ x }}") == "{{ x }}"
    assert select_chat_template("S") == "S"
    assert select_chat_template("S", "{{ y }}") == "{{ y }}"
    with pytest.raises(ValueError, match=r"none named 'default'"):
        select_chat_template({"a": "A", "b": "B"})
    with pytest.raises(ValueError, match="no chat template"):
        select_chat_template(None)


CONTENT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    contents=st.lists(CONTENT, min_size=1, max_size=5),
    name=st.sampled_from(sorted(ALL)),
    add_generation_prompt=st.booleans(),
)
def test_random_conversations_render_as_transformers(
    hf: Any, contents: list[str], name: str, add_generation_prompt: bool
) -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": c}
        for i, c in enumerate(contents)
    ]
    kwargs = {"add_generation_prompt": add_generation_prompt}
    assert render(ALL[name], messages, **kwargs) == reference(hf, ALL[name], messages, **kwargs)
