"""Tool-call parsers on the turns real models write: Qwen2.5/Qwen3/Hermes, Qwen3-Coder, Llama 3.x, Mistral."""

import json
import random
import time

import pytest

from rl2.chat.tool_parsers import (
    MAX_DEPTH,
    TOOL_PARSERS,
    FunctionToolParser,
    ParsedCall,
    ParsedTurn,
    get_tool_parser,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
RUN_CODE = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": "Run Python code.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "timeout": {"type": "integer"},
                "memory_gb": {"type": "number"},
                "scale": {"type": "number"},
                "network": {"type": "boolean"},
                "env": {"type": "object"},
                "args": {"type": "array"},
                "seed": {"type": ["integer", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER, RUN_CODE]


def test_registry_and_unknown_name():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "mistral"}
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'.*hermes, qwen3_coder, llama3_json, mistral"):
        get_tool_parser("qwen")


def test_call_ids():
    for name in ("hermes", "qwen3_coder", "llama3_json"):
        assert [get_tool_parser(name).call_id(i) for i in (0, 1, 12)] == ["call_0", "call_1", "call_12"]
    ids = [get_tool_parser("mistral").call_id(i) for i in (0, 7, 123)]
    assert ids == ["000000000", "000000007", "000000123"]
    assert all(len(i) == 9 and i.isalnum() for i in ids)


# hermes: Qwen2.5 / Qwen3 / Hermes


def test_hermes_qwen25_single_call():
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    turn = get_tool_parser("hermes").parse(block, TOOLS)
    assert turn == ParsedTurn("", [ParsedCall("get_weather", {"city": "Paris", "unit": "c"}, block)])


def test_hermes_qwen3_thinking_then_parallel_calls():
    text = (
        "<think>\nThe user asks about two cities, so I call the tool twice.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    )
    turn = get_tool_parser("hermes").parse(text, TOOLS)
    assert turn.content == "<think>\nThe user asks about two cities, so I call the tool twice.\n</think>"
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("get_weather", {"city": "Paris"}, None),
        ("get_weather", {"city": "Zürich"}, None),
    ]
    assert turn.calls[1].raw == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def test_hermes_text_between_and_after_calls():
    text = (
        "First the weather.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        "Then some code.\n"
        '<tool_call>\n{"name": "run_code", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
        "Done."
    )
    turn = get_tool_parser("hermes").parse(text)
    assert turn.content == "First the weather.\n\nThen some code.\n\nDone."
    assert [c.name for c in turn.calls] == ["get_weather", "run_code"]
    assert all(c.error is None for c in turn.calls)


def test_hermes_no_call_is_content():
    assert get_tool_parser("hermes").parse("  The answer is 42.\n") == ParsedTurn("The answer is 42.", [])


def test_hermes_malformed_json_keeps_the_other_calls():
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run_code", "arguments": {"code": "1+1"}}\n</tool_call>'
    )
    bad, good = get_tool_parser("hermes").parse(text, TOOLS).calls
    assert bad.name == "get_weather" and bad.arguments is None
    assert bad.error.startswith('the call to "get_weather" is not valid JSON: Expecting property name')
    assert "\n" not in bad.error
    assert good == ParsedCall("run_code", {"code": "1+1"}, good.raw)


def test_hermes_unclosed_last_call_generation_cut():
    text = (
        'Let me run it.\n<tool_call>\n{"name": "run_code", "arguments": {"code": "x = 1"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run_code", "arguments": {"code": "for i in range('
    )
    turn = get_tool_parser("hermes").parse(text, TOOLS)
    assert turn.content == "Let me run it."
    first, cut = turn.calls
    assert first.error is None
    assert cut.name == "run_code" and cut.arguments is None
    assert cut.error.startswith('the call to "run_code" is not closed with </tool_call>; ')
    assert "not valid JSON" in cut.error
    assert cut.raw.startswith("<tool_call>\n") and cut.raw.endswith("range(")


def test_hermes_complete_json_without_closing_tag_is_still_an_error():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    (call,) = get_tool_parser("hermes").parse(text).calls
    assert (call.name, call.arguments) == ("get_weather", {"city": "Rome"})
    assert call.error == 'the call to "get_weather" is not closed with </tool_call>'


def test_hermes_missing_name_and_bad_arguments():
    text = (
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Lima\\"}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{city: Lima}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "list_files"}\n</tool_call>\n'
        "<tool_call>\n[1, 2]\n</tool_call>"
    )
    calls = get_tool_parser("hermes").parse(text).calls
    assert calls[0].name is None and calls[0].error == 'the tool call has no "name" (the function to call)'
    assert calls[1].arguments is None
    assert calls[1].error == 'the arguments of the call to "get_weather" are not a JSON object'
    assert calls[2] == ParsedCall("get_weather", {"city": "Lima"}, calls[2].raw)  # a JSON string holding an object
    assert calls[3].error == (
        'the arguments of the call to "get_weather" are not valid JSON: '
        "Expecting property name enclosed in double quotes at character 1"
    )
    assert calls[4] == ParsedCall("list_files", {}, calls[4].raw)  # no arguments: an empty object
    assert calls[5].name is None and "not a JSON object" in calls[5].error


def test_hermes_unknown_tool_when_tools_are_given():
    text = '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>'
    (call,) = get_tool_parser("hermes").parse(text, TOOLS).calls
    assert call.arguments == {"city": "Paris"}
    assert call.error == 'there is no tool named "get_wether"; the tools are: "get_weather", "run_code"'
    assert get_tool_parser("hermes").parse(text).calls[0].error is None  # no tools given: no check


def test_hermes_error_position_counts_from_the_json():
    (call,) = get_tool_parser("hermes").parse('<tool_call>{"name": "search", "arguments": }</tool_call>').calls
    assert call.error == 'the call to "search" is not valid JSON: Expecting value at character 32'


# qwen3_coder: Qwen3-Coder


def test_qwen3_coder_converts_values_by_schema():
    text = (
        "I'll run the script.\n\n"
        "<tool_call>\n<function=run_code>\n"
        "<parameter=code>\nimport math\n\nprint(math.pi)\n\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n"
        "<parameter=memory_gb>\n1.5\n</parameter>\n"
        "<parameter=scale>\n2\n</parameter>\n"
        "<parameter=network>\nFalse\n</parameter>\n"
        '<parameter=env>\n{"PYTHONHASHSEED": "0"}\n</parameter>\n'
        '<parameter=args>\n["-v", 2]\n</parameter>\n'
        "<parameter=seed>\nnull\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    turn = get_tool_parser("qwen3_coder").parse(text, TOOLS)
    assert turn.content == "I'll run the script."
    (call,) = turn.calls
    assert call.error is None and call.name == "run_code" and call.raw == text[len("I'll run the script.\n\n") :]
    assert call.arguments == {
        "code": "import math\n\nprint(math.pi)\n",  # one newline stripped on each side, the rest kept
        "timeout": 30,
        "memory_gb": 1.5,
        "scale": 2,
        "network": False,
        "env": {"PYTHONHASHSEED": "0"},
        "args": ["-v", 2],
        "seed": None,
    }
    assert type(call.arguments["scale"]) is int


def test_qwen3_coder_values_that_do_not_convert_follow_the_real_parsers():
    text = (
        "<tool_call>\n<function=run_code>\n"
        "<parameter=timeout>\nthirty\n</parameter>\n"  # not an integer: kept as text
        "<parameter=memory_gb>\n2.0\n</parameter>\n"  # written as a float: stays a float
        "<parameter=network>\nyes\n</parameter>\n"  # not true/false: False, as vLLM and SGLang do
        "<parameter=env>\n{'A': 1}\n</parameter>\n"  # not JSON: ast.literal_eval
        "<parameter=args>\n[unclosed\n</parameter>\n"  # neither: text
        "<parameter=verbose>\ntrue\n</parameter>\n"  # not in the schema: text
        "</function>\n</tool_call>"
    )
    (call,) = get_tool_parser("qwen3_coder").parse(text, TOOLS).calls
    assert call.error is None
    assert call.arguments == {
        "timeout": "thirty",
        "memory_gb": 2.0,
        "network": False,
        "env": {"A": 1},
        "args": "[unclosed",
        "verbose": "true",
    }
    untyped = get_tool_parser("qwen3_coder").parse(text).calls[0]  # no tools: every value stays text
    assert untyped.arguments["timeout"] == "thirty" and untyped.arguments["memory_gb"] == "2.0"


def test_qwen3_coder_several_calls():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
    )
    turn = get_tool_parser("qwen3_coder").parse(text, TOOLS)
    assert turn.content == ""
    assert [c.arguments for c in turn.calls] == [{"city": "Paris"}, {"city": "São Paulo", "unit": "c"}]


def test_qwen3_coder_malformed_calls():
    parser = get_tool_parser("qwen3_coder")
    no_function_end = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    assert parser.parse(no_function_end).calls[0].error == (
        'the call to "get_weather" is not of the form <function=NAME>...</function>'
    )
    no_parameter_end = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    call = parser.parse(no_parameter_end).calls[0]
    assert call.name == "get_weather" and call.arguments is None
    assert call.error == 'a parameter of the call to "get_weather" is not closed with </parameter>'
    no_function = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert parser.parse(no_function).calls[0] == ParsedCall(
        None, None, no_function, "the tool call does not start with <function=NAME>"
    )
    no_name = "<tool_call>\n<function=>\n</function>\n</tool_call>"
    assert parser.parse(no_name).calls[0].name is None
    two = "<tool_call>\n<function=a>\n</function>\n<function=b>\n</function>\n</tool_call>"
    assert "one <function=NAME>" in parser.parse(two).calls[0].error


def test_qwen3_coder_cut_generation():
    text = "Checking.\n<tool_call>\n<function=run_code>\n<parameter=code>\nwhile True:\n    pa"
    turn = get_tool_parser("qwen3_coder").parse(text, TOOLS)
    assert turn.content == "Checking."
    (call,) = turn.calls
    assert call.name == "run_code" and call.arguments is None
    assert call.error.startswith('the call to "run_code" is not closed with </tool_call>; ')


# llama3_json: Llama 3.1 / 3.2 / 3.3


def test_llama3_python_tag_call():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "f"}}'
    turn = get_tool_parser("llama3_json").parse(text, TOOLS)
    raw = text[len("<|python_tag|>") :]
    assert turn == ParsedTurn("", [ParsedCall("get_weather", {"city": "San Francisco", "unit": "f"}, raw)])


def test_llama3_bare_json_and_arguments_key():
    text = '{"name": "get_weather", "arguments": {"city": "Berlin"}}'
    assert get_tool_parser("llama3_json").parse(text).calls == [ParsedCall("get_weather", {"city": "Berlin"}, text)]


def test_llama3_several_calls_separated_by_semicolons():
    text = (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Madrid"}}; '
        '{"name": "run_code", "parameters": {"code": "print(1)"}}'
    )
    turn = get_tool_parser("llama3_json").parse(text, TOOLS)
    assert turn.content == ""
    assert [(c.name, c.arguments) for c in turn.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Madrid"}),
        ("run_code", {"code": "print(1)"}),
    ]
    assert turn.calls[1].raw == '{"name": "get_weather", "parameters": {"city": "Madrid"}}'


def test_llama3_text_and_other_json_are_content():
    parser = get_tool_parser("llama3_json")
    assert parser.parse("It is sunny in Paris today.") == ParsedTurn("It is sunny in Paris today.", [])
    assert parser.parse('{"answer": 42}') == ParsedTurn('{"answer": 42}', [])
    call_then_text = '{"name": "get_weather", "parameters": {"city": "Paris"}} Let me know if you need more.'
    assert parser.parse(call_then_text) == ParsedTurn(call_then_text, [])
    cut = '{"name": "get_weather", "parameters": {"city":'
    assert parser.parse(cut) == ParsedTurn(cut, [])  # no <|python_tag|>: not a call


def test_llama3_malformed_after_python_tag_is_a_call_error():
    parser = get_tool_parser("llama3_json")
    turn = parser.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"')
    (call,) = turn.calls
    assert call.name == "get_weather" and call.arguments is None
    assert call.error.startswith('the call to "get_weather" is not valid JSON: Expecting')
    (nameless,) = parser.parse('<|python_tag|>{"parameters": {"city": "Paris"}}').calls
    assert nameless.name is None and "no \"name\"" in nameless.error
    turn = parser.parse('Sure.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert turn.content == "Sure." and turn.calls[0].error is None


# mistral: v3/v7 JSON array, v11 [CALL_ID], v13+ [ARGS]


def test_mistral_v3_json_array():
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich"}, "id": "abcDEF123"}, '
        '{"name": "get_weather", "arguments": {"city": "Bern"}, "id": "xyzXYZ789"}]'
    )
    turn = get_tool_parser("mistral").parse(text, TOOLS)
    assert turn.content == ""
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("get_weather", {"city": "Zürich"}, None),
        ("get_weather", {"city": "Bern"}, None),
    ]
    assert turn.calls[1].raw == '{"name": "get_weather", "arguments": {"city": "Bern"}, "id": "xyzXYZ789"}'


def test_mistral_tekken_array_with_text_before():
    text = 'Let me check.[TOOL_CALLS][{"name": "run_code", "arguments": {"code": "print(2 ** 10)"}}]'
    turn = get_tool_parser("mistral").parse(text)
    assert turn == ParsedTurn("Let me check.", [ParsedCall("run_code", {"code": "print(2 ** 10)"}, turn.calls[0].raw)])


def test_mistral_v13_name_args_repeated():
    text = (
        "[THINK]I should call the tools.[/THINK]"
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "c"}'
        '[TOOL_CALLS]run_code[ARGS]{"code": "print(\\"hi\\")", "env": {"tags": ["a", "b"]}}'
    )
    turn = get_tool_parser("mistral").parse(text, TOOLS)
    assert turn.content == "[THINK]I should call the tools.[/THINK]"
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("get_weather", {"city": "Zürich", "unit": "c"}, None),
        ("run_code", {"code": 'print("hi")', "env": {"tags": ["a", "b"]}}, None),
    ]
    assert turn.calls[0].raw == '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "c"}'


def test_mistral_v11_call_id_and_trailing_text():
    text = '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Bern"} I will wait.'
    turn = get_tool_parser("mistral").parse(text, TOOLS)
    assert turn.calls == [ParsedCall("get_weather", {"city": "Bern"}, text[: -len(" I will wait.")])]
    assert turn.content == "I will wait."


def test_mistral_malformed():
    parser = get_tool_parser("mistral")
    (cut,) = parser.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Be').calls
    assert cut.name == "get_weather" and cut.arguments is None
    assert cut.error.startswith('the arguments of the call to "get_weather" are not valid JSON: Unterminated string')
    (no_args,) = parser.parse('[TOOL_CALLS]get_weather{"city": "Bern"}').calls
    assert no_args.name == "get_weather"
    assert no_args.error == 'the call to "get_weather" has no [ARGS] before its arguments'
    (bad_array,) = parser.parse('[TOOL_CALLS][{"name": "run_code", "arguments": {"code": 1}').calls
    assert bad_array.name == "run_code" and "is not valid JSON" in bad_array.error
    (nameless,) = parser.parse('[TOOL_CALLS][{"arguments": {"city": "Bern"}}]').calls
    assert nameless.name is None and nameless.error
    (no_name,) = parser.parse('[TOOL_CALLS][ARGS]{"city": "Bern"}').calls
    assert no_name.name is None and no_name.error
    assert parser.parse("Plain answer.") == ParsedTurn("Plain answer.", [])


# FunctionToolParser: a user's parse_tool_calls from an env file


def test_function_parser_good_function():
    def parse_tool_calls(text):
        name, _, query = text.partition(":")
        return f"  thinking about {query}  ", [
            {"name": name, "arguments": {"q": query}},
            {"name": name, "arguments": '{"q": "again"}', "raw": text},
            {"name": None, "arguments": None, "raw": "<<bad>>", "error": "the call has no name"},
        ]

    parser = FunctionToolParser(parse_tool_calls)
    assert parser.name == "parse_tool_calls" and parser.call_id(3) == "call_3"
    turn = parser.parse("search:cats")
    assert turn == ParsedTurn(
        "thinking about cats",
        [
            ParsedCall("search", {"q": "cats"}, ""),
            ParsedCall("search", {"q": "again"}, "search:cats"),
            ParsedCall(None, None, "<<bad>>", "the call has no name"),
        ],
    )
    assert FunctionToolParser(lambda text: (None, [])).parse("x") == ParsedTurn("", [])


@pytest.mark.parametrize(
    "returned, error, match",
    [
        ("just text", TypeError, "must return a pair"),
        (("a", [], "extra"), TypeError, "must return a pair"),
        ((3, []), TypeError, "content of type int"),
        (("a", {"name": "f"}), TypeError, "calls of type dict"),
        (("a", ["f"]), TypeError, "returned call 0 as a str"),
        (("a", [{"arguments": {}}]), ValueError, 'call 0 without a "name"'),
        (("a", [{"name": "f", "args": {}}]), ValueError, r"unknown keys \['args'\]"),
        (("a", [{"name": "f", "arguments": "{not json"}]), ValueError, '"arguments" string is not valid JSON'),
        (("a", [{"name": "f", "arguments": ["x"]}]), TypeError, '"arguments" is a list'),
        (("a", [{"name": "f", "arguments": {}, "error": 1}]), TypeError, '"raw" or "error" is not a str'),
    ],
)
def test_function_parser_rejects_bad_returns(returned, error, match):
    parser = FunctionToolParser(lambda text: returned, name="envs/my_env.py:parse_tool_calls")
    with pytest.raises(error, match=match) as caught:
        parser.parse("hello")
    assert "envs/my_env.py:parse_tool_calls" in str(caught.value)


def test_function_parser_needs_a_function():
    with pytest.raises(TypeError, match="must be a function"):
        FunctionToolParser("parse_tool_calls")


# ---- any text: calls or tool errors, never an exception -------------------------------------------------

FUZZ_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "object"}, "n": {"type": "integer"}, "r": {"type": "number"}, "b": {"type": "boolean"},
    "a": {"type": "array"}, "y": {"type": "weird"}}}}}]
HUGE_INT, DEEP = "9" * 5000, "[" * 3000 + "]" * 3000


def adversarial_texts() -> list[str]:
    """Calls holding what Python's readers raise on (an integer past the int-string limit, nesting past the
    recursion limit or MAX_DEPTH, literals without a JSON form), in every parser's format."""
    values = [HUGE_INT, DEEP, "[" * 900 + "]" * 900, "{" * 2000, '"' + "\\" * 3000, "1e99999", "NaN", "{1, 2}",
              "0x" + "f" * 5000, "[" * 150 + "]" * 150]
    texts = []
    for value in values:
        obj = f'{{"name": "f", "arguments": {{"x": {value}}}}}'
        texts += [f"<tool_call>{obj}</tool_call>", f"<tool_call>{obj}", f'<tool_call>{{"name": "f", "arguments": {value}}}</tool_call>',
                  f'<tool_call>{{"name": "f", "arguments": "{{\\"x\\": {value}}}"}}</tool_call>',
                  f"[TOOL_CALLS][{obj}]", f"[TOOL_CALLS]f[ARGS]{{\"x\": {value}}}", f"[TOOL_CALLS]f[ARGS]{value}",
                  f"[TOOL_CALLS]{value}", obj, f"<|python_tag|>{obj}; {value}", value,
                  "<tool_call>\n<function=f>\n" + "".join(f"<parameter={p}>\n{value}\n</parameter>\n" for p in "xnrbay")
                  + "</function>\n</tool_call>"]
    return texts


def random_texts(rng: random.Random, count: int) -> list[str]:
    """Random strings of the formats' tags, JSON pieces and noise."""
    pieces = ["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=x>", "</parameter>",
              "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", '{"name": "f", "arguments": ', '"name"', ":",
              "{", "}", "[", "]", ",", ";", '"', "\\", "\\u", "null", "true", "1", "-", "e", ".", "\n", " ", "f",
              HUGE_INT, "[" * 1500, "]" * 1500, "\x00", "\ud800", "é"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_every_parser_reads_any_text_as_calls_or_tool_errors(name):
    """Random and adversarial text (seeded, a few hundred strings a parser, bounded in time): each parser
    returns a turn whose calls either parsed (a name, arguments that are a JSON object of bounded depth) or
    carry a one-line error; nothing raises."""
    parser = get_tool_parser(name)
    started = time.monotonic()
    for text in adversarial_texts() + random_texts(random.Random(65), 300):
        for tools in (None, FUZZ_TOOLS):
            turn = parser.parse(text, tools)
            assert isinstance(turn.content, str)
            for call in turn.calls:
                if call.error is None:
                    assert isinstance(call.name, str) and isinstance(call.arguments, dict)
                    json.dumps(call.arguments)  # the server writes them back
                else:
                    assert isinstance(call.error, str) and call.error
    assert time.monotonic() - started < 20


def test_a_huge_integer_or_deep_nesting_is_a_tool_error():
    """The two cases of issue 65, by name: Python's int-string limit and its recursion limit."""
    for text in (f'<tool_call>{{"name": "f", "arguments": {{"x": {HUGE_INT}}}}}</tool_call>',
                 f'<tool_call>{{"name": "f", "arguments": {{"x": {DEEP}}}}}</tool_call>'):
        (call,) = get_tool_parser("hermes").parse(text, FUZZ_TOOLS).calls
        # past the recursion limit json refuses the text; where a library raised the limit, the depth is refused
        assert call.name == "f" and call.arguments is None
        assert "not valid JSON" in call.error or f"deeper than {MAX_DEPTH}" in call.error
    (call,) = get_tool_parser("mistral").parse(f'[TOOL_CALLS]f[ARGS]{{"x": {HUGE_INT}}}').calls
    assert call.name == "f" and "4300" in call.error
    deep = '{"name": "f", "arguments": {"x": ' + "[" * 500 + "]" * 500 + "}}"
    (call,) = get_tool_parser("hermes").parse(f"<tool_call>{deep}</tool_call>").calls
    assert call.arguments is None and f"deeper than {MAX_DEPTH}" in call.error
