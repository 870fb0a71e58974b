"""Parsing and streaming tool calls (punica.server.tools), without a model."""

import json

import pytest

from punica.server.protocol_errors import ProtocolError
from punica.server.tools import ToolStream, parse_tools

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def test_hermes_and_llama_calls_are_parsed():
    tools = parse_tools(TOOLS, "auto", None)
    content, calls = tools.parse('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
                                 '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Sure.\n\n" and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                       for c in calls] == [("f", {"x": 1}), ("g", {})]
    _, calls = tools.parse('<|python_tag|>{"name": "f", "parameters": {"y": [2]}}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"y": [2]}
    assert tools.parse('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []
    assert tools.parse("just text") == ("just text", [])


@pytest.mark.parametrize("text", ['Let me check. <tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call> ok',
                                  '{"name": "g", "parameters": {}}', "no call at all, only <tool_ words"])
def test_streamed_deltas_put_together_are_the_parsed_message(text):
    tools = parse_tools(TOOLS, "auto", None)
    stream, content, calls = ToolStream(tools), "", []
    for end in range(1, len(text) + 1):
        delta = stream.delta(text[:end], finished=end == len(text))
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    expected_content, expected_calls = tools.parse(text)
    assert (content or None) == expected_content
    assert [c["function"] for c in calls] == [c["function"] for c in expected_calls]


@pytest.mark.parametrize("tools, choice, fragment", [
    (None, "required", "needs tools"), ([{"type": "function", "function": {"name": "bad name"}}], "auto", "name"),
    (TOOLS, {"type": "function", "function": {"name": "h"}}, "not among"), (TOOLS, "sometimes", "tool_choice"),
    (TOOLS + TOOLS[:1], "auto", "two tools"),
])
def test_malformed_tools_are_400s(tools, choice, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        parse_tools(tools, choice, None)


def test_required_and_named_choices_are_grammars():
    required = json.loads(parse_tools(TOOLS, "required", None).constraint().json)
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"] for c in required["items"]["anyOf"]] == [{"const": "f"}, {"const": "g"}]
    assert json.loads(parse_tools(TOOLS, "required", False).constraint().json)["maxItems"] == 1
    named = parse_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None)
    assert json.loads(named.constraint().json) == {"type": "object"}
    assert parse_tools(TOOLS, "auto", None).constraint() is None and parse_tools(TOOLS, "none", None).parse("x") == (
        "x", [])
    content, calls = parse_tools(TOOLS, "required", None).parse('[{"name": "g", "arguments": {"k": 1}}]')
    assert content is None and calls[0]["function"] == {"name": "g", "arguments": '{"k": 1}'}


def test_a_named_function_streams_its_arguments_as_they_come():
    stream = ToolStream(parse_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None))
    first = stream.delta('{"a"', finished=False)["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["function"] == {"name": "f",
                                                                                               "arguments": '{"a"'}
    assert stream.delta('{"a": 1}', finished=True) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
