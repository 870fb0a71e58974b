"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` checked, rendered into the prompt,
enforced by a grammar where the model must call one, and the model's output parsed into `tool_calls`.

Rendering: a chat template that knows tools gets them (`apply_chat_template(tools=...)`); for one
that does not, the tools go into a system message in the Hermes format (the one Qwen2.5/3's
templates write), assistant tool calls into `<tool_call>` blocks and tool results into
`<tool_response>` blocks of a user message.

tool_choice:
    "none"      the tools are in the prompt; the output is text
    "auto"      the output is text, parsed for calls: Hermes `<tool_call>{"name": ..., "arguments": ...}
                </tool_call>` blocks, or a whole output that is Llama 3.1's JSON call ({"name": ...,
                "parameters": ...}, after an optional <|python_tag|>)
    "required"  a grammar: a JSON array of one or more {"name": <a tool>, "arguments": <its parameters>}
                (one only when parallel_tool_calls is false)
    a function  a grammar: the output is that function's arguments (its parameters schema)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from punica.engine.sampling_params import StructuredOutputs
from punica.server.protocol_errors import ProtocolError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass(frozen=True)
class Tools:
    tools: list[dict[str, Any]]        # as the request gave them
    parameters: dict[str, dict]        # function name -> its parameters schema
    choice: str                        # "none", "auto", "required" or "function"
    function: str | None = None        # the function tool_choice names
    parallel: bool = True

    def constraint(self) -> StructuredOutputs | None:
        """The grammar of a call that must happen (None: the output is free text)."""
        if self.choice == "function":
            return StructuredOutputs(json=self.parameters[self.function])
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=array)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished output."""
        if self.choice == "none":
            return text, []
        if self.choice == "function":
            return None, [tool_call(self.function, text)]
        if self.choice == "required":
            try:  # the grammar's array of calls; not one when max_tokens cut it short
                return None, [tool_call(item["name"], _arguments(item["arguments"])) for item in json.loads(text)]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
        calls, outside = [], []
        end = 0
        for match in HERMES_CALL.finditer(text):
            call = self._known_call(match.group(1), "arguments")
            if call is not None:
                outside.append(text[end:match.start()])
                end = match.end()
                calls.append(call)
        outside.append(text[end:])
        content = "".join(outside)
        if not calls:
            stripped = text.strip()
            call = self._known_call(stripped.removeprefix(PYTHON_TAG), "parameters")
            if call is not None:
                return None, [call]
        return (content if content.strip() else None), calls

    def _known_call(self, text: str, arguments_key: str) -> dict | None:
        """The call a JSON object of a known function's name and its arguments writes, or None."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.parameters:
            return None
        arguments = value.get("arguments", value.get(arguments_key))
        if not isinstance(arguments, dict) or not set(value) <= {"name", "arguments", arguments_key}:
            return None
        return tool_call(value["name"], _arguments(arguments))

    def may_hold_call(self, text: str) -> int:
        """Where, in streamed text, a tool call may begin (len(text) if nowhere): content before it
        can be sent on, the rest waits for the output to finish."""
        if self.choice != "auto":
            return len(text) if self.choice == "none" else 0
        if text.lstrip().startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(text.lstrip()):
            return 0
        at = text.find(CALL_OPEN)
        if at >= 0:
            return at
        for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if CALL_OPEN.startswith(text[-n:]):
                return len(text) - n
        return len(text)


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> Tools | None:
    """The request's tools and tool_choice; a 400 naming what is malformed."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", param="tool_choice")
        return None
    parameters: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or not set(tool) <= {"type", "function"}:
            raise ProtocolError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ProtocolError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                                param=f"{where}.function.name")
        if name in parameters:
            raise ProtocolError(f"{where}.function.name {name!r} is used by two tools", param=f"{where}.function.name")
        schema = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict):
            raise ProtocolError(f"{where}.function.parameters must be a JSON schema object",
                                param=f"{where}.function.parameters")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ProtocolError(f"{where}.function has unknown fields: {', '.join(sorted(unknown))}",
                                param=f"{where}.function")
        parameters[name] = schema
    parallel = parallel_tool_calls is not False
    if tool_choice in (None, "auto", "none", "required"):
        return Tools(tools, parameters, tool_choice or "auto", parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if not isinstance(name, str) or name not in parameters:
            raise ProtocolError(f"tool_choice names function {name!r}, which is not among the tools",
                                param="tool_choice")
        return Tools(tools, parameters, "function", name, parallel)
    raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', param="tool_choice")


def _call_block(call: dict) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def template_supports_tools(tokenizer) -> bool:
    return "tools" in (tokenizer.chat_template or "")


def render_without_template_tools(messages: list[dict], tools: Tools | None) -> list[dict]:
    """Messages for a chat template that knows no tools: the Hermes system prompt of the tools, calls
    as <tool_call> blocks, tool results as <tool_response> blocks of a user message."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [message["content"], *blocks]))})
        elif message["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({k: v for k, v in message.items() if k != "tool_call_id"})
    if tools is not None:
        system = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


class ToolStream:
    """The deltas of one streamed choice whose output may hold tool calls: content as long as no call
    can have begun; then, when the output finishes, the rest of the content and each call (id, name
    and arguments). A named function's arguments are the output itself, streamed as they come.
    The deltas put together are the non-streamed message."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.num_sent = 0          # characters of the output sent on as content (or as arguments)
        self.calls: list[dict] = []

    def delta(self, text: str, finished: bool) -> dict:
        """The delta for the output `text` so far."""
        if self.tools.choice == "function":
            new, self.num_sent = text[self.num_sent:], len(text)
            if not self.calls:
                self.calls = [tool_call(self.tools.function, "")]
                return {"tool_calls": [{"index": 0, **self.calls[0], "function": {"name": self.tools.function,
                                                                                   "arguments": new}}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": new}}]} if new else {}
        if not finished:
            safe = self.tools.may_hold_call(text)
            if safe <= self.num_sent or not text[:safe].strip():
                return {}
            new, self.num_sent = text[self.num_sent:safe], safe
            return {"content": new}
        content, self.calls = self.tools.parse(text)
        delta: dict = {}
        rest = (content or "")[self.num_sent:]
        if rest:
            delta["content"] = rest
        if self.calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self.calls)]
        return delta
