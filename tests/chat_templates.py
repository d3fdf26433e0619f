"""Chat templates of the kinds checkpoints carry, for the chat template and tokenizer tests."""

from __future__ import annotations

#: Llama 3 Instruct's template: BOS first, one header per turn, ``trim`` on the content
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

#: a ChatML template in Qwen 2.5's layout: a default system prompt, tools as JSON lines,
#: assistant tool calls and tool responses
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: Llama 2 / Mistral style: roles must alternate, and anything but user/assistant is refused
#: through ``raise_exception``
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
ALTERNATE_MESSAGE = "Conversation roles must alternate user/assistant/user/assistant/..."

#: loop controls: system turns are skipped with ``continue``, a ``STOP`` turn ends the loop
#: with ``break``; block tags on their own lines exercise trim_blocks and lstrip_blocks
LOOP_CONTROLS = """{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['content'] == 'STOP' %}
        {% break %}
    {% endif %}
<{{ message['role'] }}>{{ message['content'] }}</{{ message['role'] }}>
{% endfor %}
{% if add_generation_prompt %}
<assistant>
{% endif %}
"""

#: a namespace counter, the ``{% generation %}`` block and ``dict`` in one template
NAMESPACE_GENERATION = """{%- set ns = namespace(count=0, last='') -%}
{%- for m in messages -%}
{%- set ns.count = ns.count + 1 -%}
{%- set ns.last = m.role -%}
{%- if m.role == 'assistant' -%}
{% generation %}{{ m.content }}{% endgeneration %}
{%- else -%}
{{ m.role }}: {{ m.content }}
{% endif -%}
{%- endfor -%}
{%- set info = dict(turns=ns.count, last=ns.last) -%}
[{{ info | tojson }}]{% if add_generation_prompt %} assistant:{% endif %}"""

ALL = {
    "llama3": LLAMA3,
    "chatml": CHATML,
    "alternating": ALTERNATING,
    "loop_controls": LOOP_CONTROLS,
    "namespace_generation": NAMESPACE_GENERATION,
}

#: conversations every template accepts (user and assistant turns alternate, user first)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And 3+3?  \n"},
    ],
    [
        {"role": "user", "content": "Traduis: 你好，世界！ 🎉"},
        {"role": "assistant", "content": "Bonjour, le monde ! 👍🏽\n\nÇa va ?"},
        {"role": "user", "content": "STOP"},
        {"role": "assistant", "content": "日本語 テキスト\t tab"},
    ],
]
#: with a system turn first (not for ALTERNATING)
SYSTEM_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]
