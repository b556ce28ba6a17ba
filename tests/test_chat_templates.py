"""The tiny tokenizers' chat-template families render conversations as the real families' templates do.

Expected texts below were written by reading the real templates (Qwen2.5-Instruct, Qwen3, Llama 3.1
Instruct, Mistral-7B-Instruct-v0.3), not by running ours.
"""

import hashlib
import json
import sys
import time

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoConfig, AutoTokenizer

from rl2.testing import tiny
from rl2.testing.chat_templates import FAMILIES, chat_family
from rl2.testing.tiny import build_tiny_tokenizer, save_tiny

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}},
            "required": ["city"],
        },
    },
}
WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}}, '
    '"required": ["city"]}}}'
)
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + WEATHER_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

# The default tokenizer as it was before chat-template families existed (sha256 of its sorted vocabulary).
CHATML_VOCAB_SHA256 = "526de5b818be95b907f69f02a562d9ae18986820085196fba83c72f10df3c8fb"
ORIGINAL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def call(city: str = "Paris", call_id: str = "call00001") -> dict:
    """One get_weather tool call, OpenAI style with dict arguments."""
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


def result(content: str, call_id: str = "call00001") -> dict:
    """A tool message answering `call`."""
    return {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": content}


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    """One tiny tokenizer per family."""
    return {name: build_tiny_tokenizer(template=name) for name in FAMILIES}


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- the default tokenizer ---------------------------------------------------------------------------------

def test_default_tokenizer_is_unchanged(tokenizers):
    default = build_tiny_tokenizer()
    vocab = default.get_vocab()
    assert hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest() == CHATML_VOCAB_SHA256
    assert vocab == tokenizers["chatml"].get_vocab() and len(default) == 1024
    assert default.chat_template == tiny.CHAT_TEMPLATE == ORIGINAL_CHAT_TEMPLATE == chat_family("chatml").chat_template
    assert [default.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS] == [0, 1, 2]
    assert (default.bos_token, default.eos_token, default.pad_token, default.unk_token) == (
        None, "<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    assert default("hi", add_special_tokens=True)["input_ids"] == default("hi", add_special_tokens=False)["input_ids"]
    model = tiny.build_tiny_model(default)
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (0, 2, 0)


def test_unknown_family_is_an_error_that_lists_the_known_ones():
    with pytest.raises(ValueError, match="qwen2.5, qwen3, llama3.1, mistral"):
        build_tiny_tokenizer(template="qwen4")


# --- tokens ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tokens_are_atomic_and_added_on_top_of_the_same_vocabulary(tokenizers, name):
    tokenizer, family, base = tokenizers[name], chat_family(name), tokenizers["chatml"].get_vocab()
    vocab = tokenizer.get_vocab()
    assert {t: i for t, i in vocab.items() if i < len(base)} == base
    added = family.special_tokens + family.plain_tokens
    assert sorted(vocab[t] for t in added) == list(range(len(base), len(base) + len(added)))
    for token in added + (family.eos_token,):
        token_id = vocab[token]
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
        ids = tokenizer("say" + token + "done", add_special_tokens=False)["input_ids"]
        assert token_id in ids and tokenizer.decode(ids) == "say" + token + "done"
        # special tokens are dropped by skip_special_tokens, Qwen's <tool_call>/<think> are not (as in Qwen)
        kept = tokenizer.decode(ids, skip_special_tokens=True)
        assert (token in kept) == (token in family.plain_tokens)
    assert tokenizer.eos_token == family.eos_token


def test_qwen_tokens_are_the_real_ones(tokenizers):
    assert chat_family("qwen2.5").plain_tokens == ("<tool_call>", "</tool_call>")  # <tool_response> is text there
    qwen3 = set(chat_family("qwen3").plain_tokens)
    assert qwen3 == {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    assert len(tokenizers["qwen2.5"]("<tool_response>", add_special_tokens=False)["input_ids"]) > 1


@pytest.mark.parametrize("name,bos,prepended", [
    ("chatml", None, False), ("qwen2.5", None, False), ("qwen3", None, False),
    ("llama3.1", "<|begin_of_text|>", True), ("mistral", "<s>", True), ("gpt-oss", "<|startoftext|>", False),
])
def test_llama_and_mistral_tokenizers_prepend_bos_as_the_real_ones(tokenizers, name, bos, prepended):
    tokenizer = tokenizers[name]
    plain = tokenizer("hi", add_special_tokens=False)["input_ids"]
    with_specials = tokenizer("hi", add_special_tokens=True)["input_ids"]
    assert with_specials == ([tokenizer.convert_tokens_to_ids(bos)] if prepended else []) + plain
    assert tokenizer.bos_token == bos


# --- qwen2.5 -----------------------------------------------------------------------------------------------

def test_qwen25_renders_one_tool_conversation_as_the_real_template(tokenizers):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call()]},
        result("sunny"),
        {"role": "assistant", "content": "It is sunny."},
    ]
    expected = (
        "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "\n\n" + HERMES_TOOLS
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        + "<|im_start|>assistant\n<tool_call>\n" + CALL_JSON + "\n</tool_call><|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
    )
    assert render(tokenizers["qwen2.5"], messages, tools=[WEATHER]) == expected
    prompt = render(tokenizers["qwen2.5"], messages[:3], tools=[WEATHER], add_generation_prompt=True)
    assert prompt == expected[: expected.rindex("<|im_start|>assistant\n")] + "<|im_start|>assistant\n"


def test_qwen25_system_prompt_content_before_calls_and_grouped_tool_results(tokenizers):
    tokenizer = tokenizers["qwen2.5"]
    assert render(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "<|im_start|>system\n" + QWEN_DEFAULT_SYSTEM + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [call(), call("Rome", "call00002")]},
        result("sunny"),
        result("rainy", "call00002"),
    ]
    assert render(tokenizer, messages, tools=[WEATHER], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.\n\n" + HERMES_TOOLS
        + "<|im_start|>user\nParis and Rome?<|im_end|>\n"
        + "<|im_start|>assistant\nChecking both.\n<tool_call>\n" + CALL_JSON + "\n</tool_call>\n<tool_call>\n"
        + '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        + "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    # Qwen2.5 passes arguments through tojson whatever they are: a JSON string is encoded twice
    as_string = {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    text = render(tokenizer, [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "", "tool_calls": [as_string]}])
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"}' in text


# --- qwen3 -------------------------------------------------------------------------------------------------

def test_qwen3_renders_tools_and_reasoning_as_the_real_template(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [call()]},
        result("sunny"),
        {"role": "assistant", "content": "<think>\nIt is sunny.\n</think>\n\nSunny in Paris."},
    ]
    head = "<|im_start|>system\nBe brief.\n\n" + HERMES_TOOLS + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    tool_turn = "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
    assert render(tokenizer, messages, tools=[WEATHER]) == (
        head
        + "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n" + CALL_JSON + "\n</tool_call><|im_end|>\n"
        + tool_turn
        + "<|im_start|>assistant\n<think>\nIt is sunny.\n</think>\n\nSunny in Paris.<|im_end|>\n"
    )
    # a new user query: the reasoning of every earlier assistant turn is dropped, so history changes
    later = render(tokenizer, messages + [{"role": "user", "content": "And Rome?"}], tools=[WEATHER], add_generation_prompt=True)
    assert later == (
        head
        + "<|im_start|>assistant\n<tool_call>\n" + CALL_JSON + "\n</tool_call><|im_end|>\n"
        + tool_turn
        + "<|im_start|>assistant\nSunny in Paris.<|im_end|>\n"
        + "<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_qwen3_has_no_default_system_prompt_and_enable_thinking_false_closes_the_think_block(tokenizers):
    tokenizer = tokenizers["qwen3"]
    user = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, user, add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, user, add_generation_prompt=True, enable_thinking=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tokenizer, user, tools=[WEATHER]).startswith("<|im_start|>system\n# Tools\n\n")


def test_qwen3_last_assistant_turn_gets_an_empty_think_block_that_a_tool_result_removes(tokenizers):
    tokenizer = tokenizers["qwen3"]
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call()]}]
    assert render(tokenizer, messages).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n" + CALL_JSON + "\n</tool_call><|im_end|>\n")
    assert render(tokenizer, messages + [result("sunny")]).endswith(
        "<|im_start|>assistant\n<tool_call>\n" + CALL_JSON + "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n")


def test_qwen3_wrapped_tool_response_user_message_is_not_a_query_and_string_arguments_stay(tokenizers):
    tokenizer = tokenizers["qwen3"]
    string_call = {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "<think>plan</think>", "tool_calls": [string_call]},
        {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
    ]
    text = render(tokenizer, messages, add_generation_prompt=True)
    assert "<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>\n" + CALL_JSON + "\n</tool_call>" in text


# --- llama3.1 ----------------------------------------------------------------------------------------------

def test_llama31_renders_one_tool_conversation_as_the_real_template(tokenizers):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call()]},
        result("sunny"),
    ]
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        "Do not use variables.\n\n"
        + json.dumps(WEATHER, indent=4) + "\n\n"
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(tokenizers["llama3.1"], messages, tools=[WEATHER], add_generation_prompt=True) == expected


def test_llama31_without_tools_tools_in_system_and_builtin_tools(tokenizers):
    tokenizer = tokenizers["llama3.1"]
    chat = [{"role": "user", "content": "  hi \n"}, {"role": "assistant", "content": " yo "}]
    assert render(tokenizer, chat, date_string="01 Jan 2025") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 01 Jan 2025\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nyo<|eot_id|>"
    )
    in_system = render(tokenizer, chat[:1], tools=[WEATHER], tools_in_user_message=False)
    assert in_system.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You have access to the following functions. To call a function, please respond with JSON for a function call."
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.')
    assert in_system.endswith(
        json.dumps(WEATHER, indent=4) + "\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
    python = {"id": "p", "type": "function", "function": {"name": "brave_search", "arguments": {"query": "paris"}}}
    builtin = render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [python]}],
                     builtin_tools=["brave_search", "code_interpreter"])
    assert "Environment: ipython\nTools: brave_search\n\nCutting Knowledge" in builtin
    assert builtin.endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>brave_search.call(query="paris")<|eom_id|>')


def test_llama31_raises_on_two_calls_in_one_message_and_on_tools_without_a_user_message(tokenizers):
    tokenizer = tokenizers["llama3.1"]
    two = [{"role": "user", "content": "Paris and Rome?"},
           {"role": "assistant", "content": "", "tool_calls": [call(), call("Rome", "call00002")]}]
    with pytest.raises(TemplateError, match="single tool-calls"):
        render(tokenizer, two, tools=[WEATHER])
    with pytest.raises(TemplateError, match="no first user message"):
        render(tokenizer, [{"role": "system", "content": "s"}], tools=[WEATHER])


# --- mistral -----------------------------------------------------------------------------------------------

MISTRAL_TOOLS = "[AVAILABLE_TOOLS] [" + WEATHER_JSON + "][/AVAILABLE_TOOLS]"


def test_mistral_renders_tools_before_the_last_user_message_and_moves_them(tokenizers):
    tokenizer = tokenizers["mistral"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! "},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    assert render(tokenizer, messages, tools=[WEATHER], add_generation_prompt=True) == (
        "<s>[INST] Hi[/INST] Hello!</s>" + MISTRAL_TOOLS + "[INST] Be brief.\n\nWeather in Paris?[/INST]")
    # after the call and its result the system prompt is gone (it only joins a user message that is last)
    messages += [{"role": "assistant", "content": "", "tool_calls": [call()]}, result("sunny")]
    tool_part = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
        '[TOOL_RESULTS] {"content": sunny, "call_id": "call00001"}[/TOOL_RESULTS]'
    )
    assert render(tokenizer, messages, tools=[WEATHER]) == (
        "<s>[INST] Hi[/INST] Hello!</s>" + MISTRAL_TOOLS + "[INST] Weather in Paris?[/INST]" + tool_part)
    # a new user message: the tools move in front of it, rewriting the earlier turns
    messages += [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"}]
    assert render(tokenizer, messages, tools=[WEATHER]) == (
        "<s>[INST] Hi[/INST] Hello!</s>[INST] Weather in Paris?[/INST]" + tool_part
        + " Sunny.</s>" + MISTRAL_TOOLS + "[INST] Be brief.\n\nAnd Rome?[/INST]")


@pytest.mark.parametrize("bad_id", ["abc", "call-0001", "call000001", None])
def test_mistral_raises_on_tool_call_ids_that_are_not_nine_alphanumerics(tokenizers, bad_id):
    tokenizer = tokenizers["mistral"]
    user = {"role": "user", "content": "Weather in Paris?"}
    bad_call = {"role": "assistant", "content": "", "tool_calls": [dict(call(), id=bad_id)]}
    with pytest.raises(TemplateError, match="alphanumeric strings with length 9"):
        render(tokenizer, [user, bad_call], tools=[WEATHER])
    good_call = {"role": "assistant", "content": "", "tool_calls": [call()]}
    with pytest.raises(TemplateError, match="alphanumeric strings with length 9"):
        render(tokenizer, [user, good_call, dict(result("sunny"), tool_call_id=bad_id)], tools=[WEATHER])


def test_mistral_requires_alternating_turns(tokenizers):
    with pytest.raises(TemplateError, match="must alternate"):
        render(tokenizers["mistral"], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TemplateError, match="Only user and assistant roles"):
        render(tokenizers["mistral"], [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}])


# --- gpt-oss -----------------------------------------------------------------------------------------------

def harmony_head(today: str, tools: bool = True) -> str:
    """The system and developer messages gpt-oss's template writes for a "Be brief." system prompt."""
    system = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    )
    if not tools:
        return system + "<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
    return (
        system + "\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Get the weather in a city.\ntype get_weather = (_: {\n// The city.\ncity: string,\n}) => any;\n\n"
        "} // namespace functions<|end|>"
    )


def today() -> str:
    """The date gpt-oss's template stamps into its system message."""
    return time.strftime("%Y-%m-%d")


def test_gpt_oss_renders_a_tool_loop_as_the_real_template(tokenizers):
    tokenizer = tokenizers["gpt-oss"]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "Need the tool.", "tool_calls": [call()]},
        result("sunny"),
    ]
    user = "<|start|>user<|message|>Weather in Paris?<|end|>"
    call_turns = (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
    )
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
    text = render(tokenizer, messages, tools=[WEATHER], add_generation_prompt=True)
    assert text == harmony_head(today()) + user + analysis + call_turns + "<|start|>assistant"
    # the final answer: the call's analysis is dropped, the last turn (training) keeps its own and ends <|return|>
    messages.append({"role": "assistant", "thinking": "It is sunny.", "content": "Sunny."})
    assert render(tokenizer, messages, tools=[WEATHER]) == (
        harmony_head(today()) + user + call_turns + "<|start|>assistant<|channel|>analysis<|message|>It is sunny.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    # one more user message: that answer becomes an <|end|> turn without analysis
    messages.append({"role": "user", "content": "And Rome?"})
    assert render(tokenizer, messages, tools=[WEATHER], add_generation_prompt=True) == (
        harmony_head(today()) + user + call_turns + "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
        "<|start|>user<|message|>And Rome?<|end|><|start|>assistant")


def test_gpt_oss_without_tools_schema_types_and_errors(tokenizers):
    tokenizer = tokenizers["gpt-oss"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render(tokenizer, chat, add_generation_prompt=True) == (
        harmony_head(today(), tools=False) + "<|start|>user<|message|>hi<|end|><|start|>assistant")
    schema = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "required": ["q"], "properties": {
            "q": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            "n": {"type": "integer", "default": 3}, "tags": {"type": "array", "items": {"type": "string"}},
            "opt": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}}}}}
    assert render(tokenizer, chat[1:], tools=[schema]).endswith(
        "type f = (_: {\nq: string,\nunit?: \"c\" | \"f\", // default: c,\nn?: number, // default: 3,\n"
        "tags?: string[],\nopt?: {\nx: \n                boolean},\n}) => any;\n\n} // namespace functions<|end|>"
        "<|start|>user<|message|>hi<|end|>")
    with pytest.raises(TemplateError, match="no previous assistant message with a tool call"):
        render(tokenizer, [{"role": "user", "content": "q"}, result("sunny")])
    with pytest.raises(TemplateError, match="both content and thinking"):
        render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "b",
                                                            "tool_calls": [call()]}])


# --- history across turns ----------------------------------------------------------------------------------

# Which appended message makes the rendering of the conversation so far stop being a prefix of the new
# rendering (a tool loop of one user query with no reasoning, then a second user query)? qwen3: the empty
# think block of a last assistant turn goes once something follows it; mistral: the system prompt only
# joins a user message that is last, and the tools sit before the last user message; gpt-oss: the last
# final answer ends with <|return|>, which becomes <|end|> once something follows.
REWRITES = {"chatml": (), "chatml-tools": (), "qwen2.5": (), "llama3.1": (), "qwen3": ("tool result", "new user message"),
            "mistral": ("tool call", "new user message"), "gpt-oss": ("new user message",)}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_which_families_rewrite_earlier_turns(tokenizers, name):
    tokenizer = tokenizers[name]
    steps = [
        ("prompt", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]),
        ("tool call", [{"role": "assistant", "content": "", "tool_calls": [call()]}]),
        ("tool result", [result("sunny")]),
        ("answer", [{"role": "assistant", "content": "Sunny."}]),
        ("new user message", [{"role": "user", "content": "And Rome?"}]),
    ]
    messages, previous, rewrites = [], None, []
    for label, new in steps:
        messages = messages + new
        text = render(tokenizer, messages, tools=[WEATHER])
        if previous is not None and not text.startswith(previous):
            rewrites.append(label)
        previous = text
    assert tuple(rewrites) == REWRITES[name]


# --- saved folders -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_saved_folder_reads_back_with_the_same_template_and_ids(tmp_path, tokenizers, name):
    folder = save_tiny(str(tmp_path / name), template=name, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    loaded, built = AutoTokenizer.from_pretrained(folder), tokenizers[name]
    assert loaded.chat_template == built.chat_template == chat_family(name).chat_template
    assert loaded.get_vocab() == built.get_vocab()
    assert {i: (t.content, t.special) for i, t in loaded.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in built.added_tokens_decoder.items()}
    for attribute in ("bos_token", "eos_token", "pad_token", "unk_token", "eos_token_id"):
        assert getattr(loaded, attribute) == getattr(built, attribute), attribute
    messages = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call()]},
                result("sunny")]
    text = render(loaded, messages, tools=[WEATHER], add_generation_prompt=True)
    assert text == render(built, messages, tools=[WEATHER], add_generation_prompt=True)
    for add_special_tokens in (False, True):
        assert loaded(text, add_special_tokens=add_special_tokens)["input_ids"] == built(
            text, add_special_tokens=add_special_tokens)["input_ids"]
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == len(built) and config.eos_token_id == built.eos_token_id
    assert config.bos_token_id == (built.bos_token_id if built.bos_token_id is not None else built.pad_token_id)


def test_cli_template_option(tmp_path, monkeypatch):
    folder = str(tmp_path / "model")
    monkeypatch.setattr(sys, "argv", ["tiny", folder, "--template", "mistral", "--hidden-size", "16", "--layers", "1",
                                      "--heads", "2", "--kv-heads", "1"])
    tiny.main()
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded.chat_template == chat_family("mistral").chat_template and loaded.eos_token == "</s>"


def test_chatml_tools_is_compact_and_renders_calls():
    """The CPU demo's template: tools as one short system line, hermes calls, tool turns."""
    tokenizer = build_tiny_tokenizer(template="chatml-tools")
    schema = {"type": "function", "function": {"name": "lookup", "description": "Read a code.", "parameters": {
        "type": "object", "properties": {"box": {"type": "integer", "description": "its number"}}, "required": ["box"]}}}
    messages = [{"role": "user", "content": "Code of box 3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": {"box": 3}}}]},
                {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": "code 5"}]
    assert tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nTools: lookup(box: integer)<|im_end|>\n<|im_start|>user\nCode of box 3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"box": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\ncode 5<|im_end|>\n<|im_start|>assistant\n")
