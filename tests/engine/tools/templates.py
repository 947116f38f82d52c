"""Chat templates that know tools, written for the tests after the published ones' shape.

Each renders the tools from the ``tools`` variable, an assistant's calls from its
``tool_calls`` and each result from a ``tool`` message, in its family's syntax, as Qwen2.5's
(Hermes' ``<tool_call>``), Llama 3.1's (JSON with ``"parameters"``, results from the
``ipython`` role) and Mistral's (``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]``, ``[TOOL_RESULTS]``,
ids of 9 characters) do. Transformers renders them with ``trim_blocks`` and
``lstrip_blocks``, as twostroke's saved tokenizer does.
"""

from __future__ import annotations

QWEN_LIKE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

Functions you may call, between <tools></tools>:
<tools>
{%- for tool in tools %}

{{ tool | tojson }}
{%- endfor %}

</tools>

Write each call as:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
{%- if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_LIKE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = '' %}{%- set rest = messages %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ system }}<|eot_id|>
{%- for message in rest %}
{%- if message.role == 'user' and loop.first and tools %}\
<|start_header_id|>user<|end_header_id|>

Given the following functions, answer with a JSON function call in the format \
{"name": function name, "parameters": dictionary of argument name and its value}.

{% for tool in tools %}{{ tool | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{ raise_exception('one tool call at a time') }}\
{% endif %}
{%- set call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_LIKE = """\
{{- bos_token }}
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and message is sameas users[-1] %}[AVAILABLE_TOOLS] [
{%- for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}\
][/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('a tool call id must be 9 characters') }}\
{% endif %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}\
{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""
