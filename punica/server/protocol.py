"""OpenAI-compatible request schemas (pydantic), and their translation to SamplingParams.

Every field of OpenAI's /v1/completions and /v1/chat/completions request schemas is one of:
implemented; accepted and ignored, because it cannot change the output (`user`, `metadata`,
`store`, ...); or a 400 naming it when set to anything but its no-op value (`audio`,
`functions`, ...). vLLM's extra sampling and structured-output fields that punica implements
(`top_k`, `min_p`, `structured_outputs`, `guided_json`, ...) and its `cache_salt` are accepted.
A field neither OpenAI nor punica defines is a 400 naming every such field. Values keep their
JSON types (no "1" for 1, no true for 1), and a string that is not valid Unicode (a
lone surrogate, which a JSON "\\ud800" escape can write) is a 400 naming where it is.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from punica.engine.sampling_params import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputs,
    offset_seed,
)
from punica.server.protocol_errors import ProtocolError, unsupported
from punica.server.structured_fields import Constraint, constraint_spec

STRICT = ConfigDict(extra="forbid", strict=True)
MAX_ADAPTER_NAME_CHARS = 128  # the engine checks which characters a name may have
MAX_ADAPTER_PATH_CHARS = 4096
MAX_CACHE_SALT_CHARS = 256


def _valid_unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_at(value: Any) -> str | None:
    """The dotted path (pydantic's style: "messages.0.content") of a string, or object key, in a
    parsed JSON value that holds a lone surrogate; None when there is none."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _valid_unicode(item):
                return ".".join(map(str, path)) or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _valid_unicode(key):
                    return ".".join(map(str, path + (ascii(key),)))
                stack.append((child, path + (key,)))
        elif isinstance(item, list):
            stack.extend((child, path + (i,)) for i, child in enumerate(item) if isinstance(child, (str, dict, list)))
    return None


class RequestBody(BaseModel):
    """A request body: strict JSON types, no unknown fields, valid Unicode throughout."""
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise PydanticCustomError("lone_surrogate", "{param} is not valid Unicode (it holds a lone surrogate)",
                                      {"param": where})
        return data


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding against length side channels; ignored


def _cache_salt(value: str | None) -> str | None:
    if value is not None and not 1 <= len(value) <= MAX_CACHE_SALT_CHARS:
        raise PydanticCustomError("cache_salt", "cache_salt must be a non-empty string of at most {max} characters, "
                                  "got {num} characters", {"max": MAX_CACHE_SALT_CHARS, "num": len(value)})
    return value


def _stop(value: Any) -> Any:
    if value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return value
    raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")


class SamplingFields(RequestBody):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = Field(None, ge=1, le=16)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Annotated[Any, AfterValidator(_stop)] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None  # ignored
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # punica's: the strength of the model's adapter for this request (0 = the base model, 1 = as trained)
    lora_scale: float | None = None
    # vLLM's structured-output fields (punica.server.structured_fields)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the request shares prefix-cache pages only with requests of the same salt (and tenant)
    cache_salt: Annotated[str | None, AfterValidator(_cache_salt)] = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def usage_wanted(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def check_supported(self) -> None:
        self.constraint()

    def constraint(self) -> Constraint | None:
        """What the output must match, and the field that says so (a 400 naming the field for a malformed one)."""
        return constraint_spec(self)

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids; a 400 for a key that is not one."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ProtocolError(f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                                    param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(self, max_tokens: int, logprobs: bool, choice: int, top_logprobs: int = 0,
                        constraint: StructuredOutputs | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The SamplingParams of choice number `choice` (seeds differ per choice); a 400 naming the
        field for a value out of range."""
        values: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty, "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "seed": None if self.seed is None else offset_seed(self.seed, choice),
            "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "include_stop_str_in_output": self.include_stop_str_in_output, "ignore_eos": self.ignore_eos,
            "lora_scale": self.lora_scale,
        }
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs,
                                  prompt_logprobs=prompt_logprobs, logit_bias=self.token_bias(),
                                  structured_outputs=constraint,
                                  **{k: v for k, v in values.items() if v is not None})
        except SamplingParamsError as e:
            raise ProtocolError(str(e), param=e.field) from e


def completion_limit(value: int | None, field: str, default: int | None) -> int | None:
    """A max_tokens-like field: `default` when absent; a 400 naming it when below 1."""
    if value is None:
        return default
    if value < 1:
        raise ProtocolError(f"{field} must be at least 1, got {value}", param=field)
    return value


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(value: Any) -> Any:
    if isinstance(value, str) or _is_token_ids(value):
        return value
    if isinstance(value, list) and (all(isinstance(x, str) for x in value) or all(map(_is_token_ids, value))):
        return value
    raise PydanticCustomError("prompt_type", "prompt must be a string, a list of strings, a list of token ids "
                                             "or a list of lists of token ids")


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, AfterValidator(_prompt)]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise unsupported("suffix")
        if self.best_of not in (None, 1, self.num_choices):
            raise unsupported("best_of", "other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", param="logprobs")

    def max_tokens_or_default(self) -> int:
        return completion_limit(self.max_tokens, "max_tokens", 16)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ProtocolError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


TEXT_PART_KEYS = {"type", "text", "prompt_cache_breakpoint"}  # a cache breakpoint cannot change the output


def _content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(part, dict) for part in value):
        return value
    raise PydanticCustomError("content_type", "content must be a string, null or a list of content parts")


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


class ChatMessage(BaseModel):
    """One message, with OpenAI's message fields: used (tool_calls of an assistant message,
    tool_call_id of a tool message: punica.server.tools), without effect here (refusal), or a
    400 when set (function_call, audio)."""
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[Any, AfterValidator(_content)] = None
    name: str | None = None            # passed to the chat template (most templates ignore it)
    tool_call_id: str | None = None    # of a "tool" message, whose content the template gets
    refusal: str | None = None         # of an assistant message: no-op
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def check_supported(self, where: str) -> None:
        if self.tool_calls and self.role != "assistant":
            raise unsupported(f"{where}.tool_calls", "are for assistant messages only")
        for i, call in enumerate(self.tool_calls or ()):
            function = call.get("function")
            if (call.get("type", "function") != "function" or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
                raise ProtocolError(f'{where}.tool_calls.{i} must be {{"id": ..., "type": "function", "function": '
                                    '{"name": <string>, "arguments": <JSON text>}}', param=f"{where}.tool_calls.{i}")
        for name in ("function_call", "audio"):
            if getattr(self, name) is not None:
                raise unsupported(f"{where}.{name}")

    def template_message(self, where: str) -> dict[str, Any]:
        """The message as the chat template gets it (a tool call's arguments parsed, as templates
        expect); a 400 for a content part that is not text."""
        message: dict[str, Any] = {"role": self.role, "content": self.text(where)}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.get("id"), "type": "function", "function": {
                "name": call["function"]["name"], "arguments": _parsed(call["function"]["arguments"])}}
                for call in self.tool_calls]
        return message

    def text(self, where: str) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for i, part in enumerate(self.content):
            at = f"{where}.content.{i}"
            if part.get("type") != "text":
                raise ProtocolError(f"{at}.type {part.get('type')!r} is not supported (text only)",
                                    param=f"{at}.type")
            if not isinstance(part.get("text"), str) or not set(part) <= TEXT_PART_KEYS:
                raise ProtocolError(f"{at}: a text content part has a string `text` and no fields but "
                                    f"{', '.join(sorted(TEXT_PART_KEYS))}", param=at)
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None   # punica.server.tools
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None     # false: tool_choice "required" makes exactly one call
    # other outputs than text: a 400 unless set to what means "none"
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None  # only makes the same output faster: ignored
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # bookkeeping, caching and billing: cannot change the output, ignored
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for i, message in enumerate(self.messages):
            message.check_supported(f"messages.{i}")
        if self.functions:
            raise unsupported("functions", "are not supported")
        if self.function_call not in (None, "none"):
            raise unsupported("function_call", 'is not supported other than "none" (no functions)')
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", 'is not supported other than ["text"]')
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ProtocolError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                                    param="top_logprobs")
            if self.top_logprobs and not self.logprobs:
                raise ProtocolError("top_logprobs needs logprobs: true", param="top_logprobs")
        for name in ("audio", "reasoning_effort", "verbosity", "web_search_options", "moderation"):
            if getattr(self, name) is not None:
                raise unsupported(name)

    def completion_limit(self) -> int | None:
        """max_completion_tokens, else max_tokens; None when neither is given (up to the context)."""
        limit = completion_limit(self.max_completion_tokens, "max_completion_tokens", None)
        legacy = completion_limit(self.max_tokens, "max_tokens", None)
        return limit if limit is not None else legacy


class LoadLoraRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, path: str) -> str:
        if "\0" in path:
            raise PydanticCustomError("nul_byte", "lora_path holds a NUL byte")
        return path


class UnloadLoraRequest(RequestBody):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)
