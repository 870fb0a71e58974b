"""OpenAI-compatible request schemas (pydantic), and their translation to SamplingParams.

Fields OpenAI defines that punica does not implement are rejected with a 400 that names
them, never silently ignored; vLLM's extra sampling fields (top_k, min_p, ...) are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from punica.engine.sampling_params import SamplingParams


class ProtocolError(ValueError):
    """A request the server understands but cannot serve; becomes an OpenAI error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    def check_supported(self) -> None:
        if self.logit_bias:
            raise ProtocolError("logit_bias is not supported", param="logit_bias")

    def sampling_params(self, max_tokens: int, logprobs: bool, choice: int) -> SamplingParams:
        """The SamplingParams of choice number `choice` (seeds differ per choice)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        values: dict[str, Any] = {
            "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "seed": None if self.seed is None else self.seed + choice,
        }
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None},
                                  stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  ignore_eos=self.ignore_eos, logprobs=logprobs)
        except ValueError as e:
            raise ProtocolError(str(e)) from e


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ProtocolError("echo is not supported", param="echo")
        if self.suffix:
            raise ProtocolError("suffix is not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise ProtocolError("best_of other than n is not supported", param="best_of")
        if self.logprobs not in (None, 0, 1):
            raise ProtocolError("only the chosen token's logprob is returned: logprobs must be 0 or 1",
                                param="logprobs")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ProtocolError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ProtocolError(f"message content of type {part.get('type')!r} is not supported (text only)",
                                    param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ProtocolError("tools are not supported", param="tools")
        if self.top_logprobs:
            raise ProtocolError("top_logprobs is not supported (only the chosen token's logprob)",
                                param="top_logprobs")
        if self.response_format and self.response_format.get("type") != "text":
            raise ProtocolError("response_format other than text is not supported", param="response_format")


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
