"""Chat templates of real model families, for the tiny tokenizers of `rl2.testing.tiny`.

Each family is a Jinja chat template written for rl2 (not a copy of the vendor's text) that renders a
conversation the way the family's real template does — tools, tool calls, tool results, reasoning —
plus the atomic tokens, end-of-sequence token and BOS behaviour its real tokenizer has. Tests of rl2's
token-exact multi-turn logic run against these instead of a template that is kinder than real ones.
Messages use the OpenAI / transformers shapes: `tools=[{"type": "function", "function": {...}}]`,
assistant `tool_calls=[{"id", "type": "function", "function": {"name", "arguments": dict}}]`, and
`{"role": "tool", "tool_call_id", "name", "content"}`.

Families (what is reproduced; where it was read):

- `chatml`: the tiny tokenizer's historical template, unchanged: `<|im_start|>role\\ncontent<|im_end|>\\n`
  per message, no system prompt of its own; tools and tool calls are not rendered. Every prefix of a
  conversation renders as a prefix of the whole.
- `qwen2.5` (Qwen2.5-Instruct; read from copies of its tokenizer_config.json template in public code):
  the default system prompt "You are Qwen, created by Alibaba Cloud. ..." when the conversation has
  none; with tools, the system turn gets the `# Tools` section, each schema as JSON on its own line in
  `<tools></tools>`, and the hermes `<tool_call>` instructions; assistant tool calls as
  `\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` after the content (arguments always
  through `tojson`, so a JSON-string argument is encoded twice, as in the real one); consecutive tool
  messages grouped into one `<|im_start|>user` turn, one `<tool_response>` block each. Tokens:
  `<tool_call>`, `</tool_call>` are atomic but not special (they survive `skip_special_tokens`), as in
  the real tokenizer; `<tool_response>` is plain text there, and here.
- `qwen3` (Qwen3; read from copies of its template): tools as qwen2.5 but no default system prompt;
  assistant reasoning (`reasoning_content`, or `<think>...</think>` at the head of the content) is kept
  as `<think>\\n...\\n</think>\\n\\n` only for assistant turns after the last user query (a user message
  that is not a `<tool_response>` wrapper) and dropped before it; the last message, when it is an
  assistant turn after that query, always gets a think block, empty if it has no reasoning;
  `arguments` given as a string are inserted as is; `enable_thinking=False` adds an empty think block
  to the generation prompt. Tokens: `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>`, `<think>`, `</think>` atomic, not special.
- `llama3.1` (Llama 3.1 Instruct; read from copies of Meta-Llama-3.1-8B-Instruct's template and vLLM's
  examples/tool_chat_template_llama3.1_json.jinja): `<|begin_of_text|>`, header tokens, a system turn
  always present with "Cutting Knowledge Date: December 2023" / "Today Date: 26 Jul 2024" (`date_string`
  overrides) and "Environment: ipython" when tools (or `builtin_tools`) are given; custom tools go into
  the first user message by default (`tools_in_user_message=False` puts them in the system turn), each
  as `tojson(indent=4)` after the real instructions; message contents are trimmed; a tool call renders
  as `{"name": ..., "parameters": ...}<|eot_id|>` and the call's text content is dropped; more (or
  fewer) than one call in a message raises, as in the real one (`tool_calls=None` counts as no call
  here, the real one fails on it); tool results are an `ipython` turn
  whose content goes through `tojson` (so a string result appears quoted); `builtin_tools` calls render
  as `<|python_tag|>name.call(k="v")<|eom_id|>`. The tokenizer prepends `<|begin_of_text|>` when asked
  for special tokens, as the real one does; eos is `<|eot_id|>`.
- `mistral` (Mistral-7B-Instruct-v0.3; read from its Hugging Face template as copied in vLLM's
  examples/tool_chat_template_mistral_official.jinja, checked against mistral-common's
  InstructTokenizerV3 in src/mistral_common/tokens/tokenizers/instruct.py): `<s>[INST] user[/INST]`,
  assistant text as ` text</s>` (trimmed); no generation prompt (the model writes right after `[/INST]`
  or `[/TOOL_RESULTS]`); `[AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]` placed before the LAST user message
  only; the system prompt is glued (`system\\n\\nuser`) to the last user message and only while that
  message is the last of the conversation (the Hugging Face template's behaviour; mistral-common keeps
  it on the last user message whatever follows); `[TOOL_CALLS] [{"name", "arguments", "id"}]</s>` with
  the message's text content dropped; `[TOOL_RESULTS] {"content": <content as is, not quoted>,
  "call_id": ...}[/TOOL_RESULTS]`; user/assistant turns must alternate (tool calls and results aside)
  and other roles raise. Tool call ids (in calls and results) that are not 9 alphanumeric characters
  raise: the HF template checks the length only, mistral-common the characters too, and so do we. The
  real template finds "the last user message" by equality, so it also puts the tools before an earlier
  user message with the same content; we use the position. The tokenizer prepends `<s>`.
- `gpt-oss` (harmony; read from a verbatim copy of gpt-oss's chat_template.jinja embedded in public code,
  and TRL's expected renderings in its tests): a system message with the model identity
  (`model_identity`), "Knowledge cutoff: 2024-06", "Current date: " from `strftime_now` (today), the
  reasoning effort (`reasoning_effort`, default medium), the valid channels, and the `functions` line
  when tools are given; a developer message with `# Instructions` (the system/developer message) and
  `# Tools` as `namespace functions { ... }` with each schema written as a TypeScript-like type, the real
  macro's line breaks in nested objects and unions included; `thinking` rendered on the analysis
  channel; a tool call as `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS
  <|call|>` (first call of the message only, as in the real one), its analysis kept only until a final
  answer (an assistant message without calls) follows; tool results as `<|start|>functions.NAME
  to=assistant<|channel|>commentary<|message|>"json string"<|end|>` (raises with no call before); the
  final answer as `<|start|>assistant<|channel|>final<|message|>...<|end|>`, except the conversation's
  last message without a generation prompt (training), which ends `<|return|>` after its analysis. The
  generation prompt is `<|start|>assistant`. Eos is `<|return|>` (the real generation config also stops
  on `<|call|>`). `builtin_tools` (browser, python) are left out.

Rendering a longer conversation rewrites earlier turns in three families: `qwen3` (reasoning of turns
before the new last user query is dropped; the empty think block of a last assistant turn goes once
anything follows it), `mistral` (the tools move in front of the new last user message; the system
prompt leaves once its user message is no longer last) and `gpt-oss` (analysis before a call goes once
a final answer follows; a last final answer's analysis and `<|return|>` become a plain `<|end|>` turn
once anything follows, or with a generation prompt). `chatml`, `qwen2.5` and `llama3.1` only append.

Each template was checked while it was written by rendering thousands of random conversations with it
and with the real template's text: the same output, or both raising, except where noted above.

Left out everywhere: multimodal content (lists of parts) and Qwen's vision/FIM tokens. The tiny
tokenizer keeps its byte-level BPE for every family, so the way text next to special tokens splits
(e.g. Mistral's SentencePiece word-initial spaces) is not reproduced, and the trained `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` stay in every family's vocabulary.
"""

from dataclasses import dataclass
from types import MappingProxyType

# ChatML, as Qwen2.5 renders it, minus the default system prompt: every prefix of a conversation
# renders as a prefix of the whole, which the data pipeline relies on for per-turn loss masks.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The hermes-style tool section both Qwen families write into the system turn (`tools` defined).
_QWEN_TOOLS = r"""
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
"""

# Consecutive tool messages share one user turn, a <tool_response> block each (`content` set).
_QWEN_TOOL_RESULT = r"""
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
"""

QWEN25_TEMPLATE = (
    r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system_prompt = messages[0].content %}
{%- else %}
    {%- set system_prompt = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- endif %}
{{- '<|im_start|>system\n' + system_prompt }}
{%- if tools %}
    {{- '\n\n' }}"""
    + _QWEN_TOOLS
    + r"""
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' and not message.tool_calls %}
        {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if content %}
            {{- '\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + fn.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}"""
    + _QWEN_TOOL_RESULT
    + r"""
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
)

QWEN3_TEMPLATE = (
    r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}"""
    + _QWEN_TOOLS
    + r"""
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{#- The last user query: the last user message that is not a wrapped tool response. #}
{%- set query = namespace(index=messages | length - 1, found=false) %}
{%- for message in messages | reverse %}
    {%- if not query.found and message.role == 'user' and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set query.found = true %}
        {%- set query.index = messages | length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > query.index and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set fn = call.function if call.function else call %}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else fn.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}"""
    + _QWEN_TOOL_RESULT
    + r"""
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
)

LLAMA31_TEMPLATE = r"""
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if tools is not defined %}
    {%- set tools = none %}
{%- endif %}
{%- set tools_in_user = tools_in_user_message if tools_in_user_message is defined else true %}
{%- set today = date_string if date_string is defined else '26 Jul 2024' %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system_prompt = messages[0].content | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_prompt = '' %}
{%- endif %}
{%- set call_format = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n' %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if builtin_tools is defined or tools is not none %}
    {{- 'Environment: ipython\n' }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- 'Tools: ' + builtin_tools | reject('equalto', 'code_interpreter') | join(', ') + '\n\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + today + '\n\n' }}
{%- if tools is not none and not tools_in_user %}
    {{- 'You have access to the following functions. To call a function, please respond with JSON for a function call.' }}
    {{- call_format }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
{%- endif %}
{{- system_prompt + '<|eot_id|>' }}
{%- if tools is not none and tools_in_user %}
    {%- if not messages %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- 'Given the following functions, please respond with a JSON for a function call ' }}
    {{- 'with its proper arguments that best answers the given prompt.\n\n' + call_format }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\n\n' }}
    {%- endfor %}
    {{- messages[0].content | trim + '<|eot_id|>' }}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {%- if message.tool_calls is defined and message.tool_calls is not none %}
        {%- if message.tool_calls | length != 1 %}
            {{- raise_exception('This model only supports single tool-calls at once!') }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- if builtin_tools is defined and call.name in builtin_tools %}
            {{- '<|python_tag|>' + call.name + '.call(' }}
            {%- for key, value in call.arguments | items %}
                {{- key + '="' + value + '"' }}
                {%- if not loop.last %}
                    {{- ', ' }}
                {%- endif %}
            {%- endfor %}
            {{- ')' }}
        {%- else %}
            {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}' }}
        {%- endif %}
        {{- '<|eom_id|>' if builtin_tools is defined else '<|eot_id|>' }}
    {%- elif message.role == 'tool' or message.role == 'ipython' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system_prompt = messages[0].content %}
    {%- set chat = messages[1:] %}
{%- else %}
    {%- set system_prompt = none %}
    {%- set chat = messages %}
{%- endif %}
{%- set bad_id = 'Tool call IDs should be alphanumeric strings with length 9!' %}
{#- User and assistant turns alternate, tool calls and tool results aside; note the last user message. #}
{%- set turns = namespace(count=0, last_user=-1) %}
{%- for message in chat %}
    {%- if message.role == 'user' %}
        {%- set turns.last_user = loop.index0 %}
    {%- endif %}
    {%- if not (message.role == 'tool' or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message.role == 'user') != (turns.count % 2 == 0) %}
            {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
        {%- endif %}
        {%- set turns.count = turns.count + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in chat %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.index0 == turns.last_user %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for tool in tools %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, value in tool.function.items() if key != 'return' %}
                    {{- '"' + key + '": ' + ('"' + value + '"' if value is string else value | tojson) }}
                    {%- if not loop.last %}
                        {{- ', ' }}
                    {%- endif %}
                {%- endfor %}
                {{- '}}' + (', ' if not loop.last else ']') }}
            {%- endfor %}
            {{- '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if loop.last and system_prompt is not none %}
            {{- '[INST] ' + system_prompt + '\n\n' + message.content + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message.content + '[/INST]' }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not string or call.id | length != 9 or not call.id.isalnum() %}
                {{- raise_exception(bad_id) }}
            {%- endif %}
            {{- (call.function | tojson)[:-1] + ', "id": "' + call.id + '"}' }}
            {{- ', ' if not loop.last else ']' + eos_token }}
        {%- endfor %}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message.content | trim + eos_token }}
    {%- elif message.role == 'tool' %}
        {%- if message.tool_call_id is not string or message.tool_call_id | length != 9 or not message.tool_call_id.isalnum() %}
            {{- raise_exception(bad_id) }}
        {%- endif %}
        {%- set result = message.content.content if message.content.content is defined else message.content %}
        {{- '[TOOL_RESULTS] {"content": ' + result | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# gpt-oss (harmony). `ts_type` writes a JSON schema as the TypeScript-like type the real template gives
# (the odd line breaks inside nested objects and unions included).
GPT_OSS_TEMPLATE = r"""
{%- macro ts_type(spec) -%}
    {%- if spec.type == 'array' -%}
        {%- set item = spec['items'] -%}
        {%- if not item -%}
            {{- 'any[]' -}}
        {%- elif item.type in ('string', 'boolean') -%}
            {{- item.type + '[]' -}}
        {%- elif item.type in ('number', 'integer') -%}
            {{- 'number[]' -}}
        {%- else -%}
            {%- set inner = ts_type(item) -%}
            {{- 'any[]' if inner == 'object | object' or inner | length > 50 else inner + '[]' -}}
        {%- endif -%}
        {{- ' | null' if spec.nullable else '' -}}
    {%- elif spec.type is defined and spec.type is iterable and spec.type is not string and spec.type is not mapping and spec.type[0] is defined -%}
        {{- spec.type | join(' | ') -}}
    {%- elif spec.oneOf -%}
        {#- The real one means to write `any` for unions of objects, but its flag is set inside a loop. #}
        {%- for variant in spec.oneOf -%}
            {{- ts_type(variant) + ('// ' + variant.description if variant.description else '') -}}
            {{- '                    // default: ' + variant.default | tojson if variant.default is defined else '' -}}
            {{- ' | \n' if not loop.last else '' -}}
        {%- endfor -%}
    {%- elif spec.type == 'string' and spec.enum -%}
        {{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- elif spec.type == 'string' -%}
        {{- 'string' + (' | null' if spec.nullable else '') -}}
    {%- elif spec.type in ('number', 'integer') -%}
        {{- 'number' -}}
    {%- elif spec.type == 'boolean' -%}
        {{- 'boolean' -}}
    {%- elif spec.type == 'object' and spec.properties -%}
        {{- '{\n' -}}
        {%- for name, prop in spec.properties.items() -%}
            {{- name + ('' if name in (spec.required or []) else '?') + ': \n                ' + ts_type(prop) -}}
            {{- ', ' if not loop.last else '' -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif spec.type == 'object' -%}
        {{- 'object' -}}
    {%- else -%}
        {{- 'any' -}}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role in ('system', 'developer') %}
    {%- set instructions = messages[0].content %}
    {%- set chat = messages[1:] %}
{%- else %}
    {%- set instructions = '' %}
    {%- set chat = messages %}
{%- endif %}
{{- '<|start|>system<|message|>' }}
{{- (model_identity if model_identity is defined else 'You are ChatGPT, a large language model trained by OpenAI.') + '\n' }}
{{- 'Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\n' }}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- if instructions or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if instructions %}
        {{- '# Instructions\n\n' + instructions + '\n\n' }}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
        {%- for tool in tools %}
            {%- set fn = tool.function %}
            {{- '// ' + fn.description + '\ntype ' + fn.name + ' = ' }}
            {%- if fn.parameters and fn.parameters.properties %}
                {{- '(_: {\n' }}
                {%- for name, spec in fn.parameters.properties.items() %}
                    {{- '// ' + spec.description + '\n' if spec.description else '' }}
                    {{- name + ('' if name in (fn.parameters.required or []) else '?') + ': ' + ts_type(spec) }}
                    {%- if spec.default is defined and spec.enum %}
                        {{- ', // default: ' + spec.default }}
                    {%- elif spec.default is defined and spec.oneOf %}
                        {{- '// default: ' + spec.default }}
                    {%- elif spec.default is defined %}
                        {{- ', // default: ' + spec.default | tojson }}
                    {%- endif %}
                    {{- ',\n' }}
                {%- endfor %}
                {{- '}) => any;\n\n' }}
            {%- else %}
                {{- '() => any;\n\n' }}
            {%- endif %}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in chat %}
    {%- if message.role == 'assistant' %}
        {%- for field in ('content', 'thinking') if message[field] is string %}
            {%- if '<|channel|>analysis<|message|>' in message[field] or '<|channel|>final<|message|>' in message[field] %}
                {{- raise_exception('Pass the analysis text in `thinking` and the final text in `content`, without <|channel|> tags (field ' + field + ').') }}
            {%- endif %}
        {%- endfor %}
        {%- if message.tool_calls %}
            {#- Analysis before a call is kept until a final answer (an assistant message without calls) follows. #}
            {%- set answered = chat[loop.index:] | selectattr('role', 'equalto', 'assistant') | rejectattr('tool_calls') | list %}
            {%- set call = message.tool_calls[0].function if message.tool_calls[0].function else message.tool_calls[0] %}
            {%- if message.content and message.thinking %}
                {{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.') }}
            {%- elif (message.content or message.thinking) and not answered %}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + (message.content or message.thinking) + '<|end|>' }}
            {%- endif %}
            {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary ' }}
            {{- (call.content_type if call.content_type is defined else 'json') + '<|message|>' + call.arguments | tojson + '<|call|>' }}
            {%- set last_call.name = call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {#- Only while training on the last turn: its analysis, and <|return|> where history has <|end|>. #}
            {%- if message.thinking is defined %}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
            {%- endif %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
            {%- set last_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if last_call.name is none %}
            {{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}
        {%- endif %}
        {{- '<|start|>functions.' + last_call.name + ' to=assistant<|channel|>commentary<|message|>' + message.content | tojson + '<|end|>' }}
    {%- elif message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""


@dataclass(frozen=True)
class ChatFamily:
    """A model family's chat template and the tokens its tokenizer has on top of the trained vocabulary.

    `special_tokens` and `plain_tokens` are added as atomic tokens (never split), in that order after the
    trained vocabulary; special ones are dropped by `decode(..., skip_special_tokens=True)`, plain ones
    are kept. `add_bos`: encoding with `add_special_tokens=True` prepends `bos_token`.
    """

    name: str
    chat_template: str
    eos_token: str
    special_tokens: tuple[str, ...] = ()
    plain_tokens: tuple[str, ...] = ()
    bos_token: str | None = None
    pad_token: str | None = "<|endoftext|>"
    unk_token: str | None = "<|endoftext|>"
    add_bos: bool = False


_QWEN3_PLAIN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_LLAMA_SPECIAL = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
)
_GPT_OSS_SPECIAL = (
    "<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>",
)
_MISTRAL_SPECIAL = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
)

# A compact ChatML with tools, for the CPU demo of native function calling (not a real family): each tool
# as `name(parameter: type, ...)` in a short system turn (a tiny model learns little across the
# hundreds of tokens of a real template's tool section), hermes-style calls, tool results as `tool` turns.
CHATML_TOOLS_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\nTools:' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {{- ' ' + fn.name + '(' }}
        {%- for name, spec in (fn.parameters.properties if fn.parameters is defined else {}).items() %}
            {{- (', ' if not loop.first else '') + name + ': ' + spec.type }}
        {%- endfor %}
        {{- ')' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') }}
    {%- for call in message.tool_calls or [] %}
        {{- ('\n' if message.content or not loop.first else '') + '<tool_call>\n{"name": "' + call.function.name }}
        {{- '", "arguments": ' + call.function.arguments | tojson + '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# The `<|endoftext|>` pad/unk defaults are the trained vocabulary's first token (byte-level BPE never
# produces an unknown token); Llama and Mistral have no pad token of their own, the tiny ones get a
# reserved token so that a folder read back by transformers keeps the same special tokens.
FAMILIES = MappingProxyType({
    "chatml": ChatFamily("chatml", CHAT_TEMPLATE, eos_token="<|im_end|>"),
    "chatml-tools": ChatFamily("chatml-tools", CHATML_TOOLS_TEMPLATE, eos_token="<|im_end|>",
                               plain_tokens=("<tool_call>", "</tool_call>")),
    "qwen2.5": ChatFamily(
        "qwen2.5", QWEN25_TEMPLATE, eos_token="<|im_end|>", plain_tokens=("<tool_call>", "</tool_call>"),
    ),
    "qwen3": ChatFamily("qwen3", QWEN3_TEMPLATE, eos_token="<|im_end|>", plain_tokens=_QWEN3_PLAIN),
    "llama3.1": ChatFamily(
        "llama3.1", LLAMA31_TEMPLATE, eos_token="<|eot_id|>", special_tokens=_LLAMA_SPECIAL,
        bos_token="<|begin_of_text|>", pad_token="<|finetune_right_pad_id|>", add_bos=True,
    ),
    "mistral": ChatFamily(
        "mistral", MISTRAL_TEMPLATE, eos_token="</s>", special_tokens=_MISTRAL_SPECIAL,
        bos_token="<s>", pad_token="<unk>", unk_token="<unk>", add_bos=True,
    ),
    "gpt-oss": ChatFamily(
        "gpt-oss", GPT_OSS_TEMPLATE, eos_token="<|return|>", special_tokens=_GPT_OSS_SPECIAL,
        bos_token="<|startoftext|>",
    ),
})


def chat_family(name: str) -> ChatFamily:
    """The family called `name`; an unknown name is an error that lists the known ones."""
    if name not in FAMILIES:
        raise ValueError(f"unknown chat template family {name!r}; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
