"""/v1/completions and /v1/chat/completions: requests in, OpenAI responses and SSE chunks out."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from punica.engine.engine import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, SamplingFields

DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class OpenAIHandlers:
    def __init__(self, state):
        self.state = state  # punica.server.app.ServerState

    # entry points --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request):
        body.check_supported()
        adapter = await self.state.resolve_model(body.model)
        prompts = [self._tokenize(p) for p in body.prompts()]
        max_tokens = body.max_tokens_or_default()
        choices = self._choices("cmpl", body, prompts, lambda ids: max_tokens, body.logprobs is not None)
        return await self._respond("text_completion", body, adapter, choices, request)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        body.check_supported()
        adapter = await self.state.resolve_model(body.model)
        messages = [m.template_message(f"messages.{i}") for i, m in enumerate(body.messages)]
        tok = self.state.tokenizer
        if not tok.chat_template:
            raise ProtocolError("this model has no chat template: use /v1/completions")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        limit = body.completion_limit()
        max_model_len = self.state.max_model_len
        choices = self._choices("chatcmpl", body, [prompt_ids],
                                lambda ids: limit if limit is not None else max(1, max_model_len - len(ids)),
                                bool(body.logprobs))
        return await self._respond("chat.completion", body, adapter, choices, request)

    # shared ------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.state.tokenizer.encode(prompt)
        vocab_size = self.state.backend.vocab_size
        if not all(0 <= t < vocab_size for t in prompt):
            # checked here, not only by the engine: a later prompt of the request goes in after
            # the response has started
            raise ProtocolError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
        return list(prompt)

    def _choices(self, prefix: str, body: SamplingFields, prompts: list[list[int]], max_tokens_of,
                 logprobs: bool) -> list[Choice]:
        base = f"{prefix}-{uuid.uuid4().hex}"
        choices = []
        for p, ids in enumerate(prompts):
            max_tokens = max_tokens_of(ids)
            if not ids:
                raise ProtocolError("the prompt is empty", param="prompt")
            if len(ids) + max_tokens > self.state.max_model_len:
                raise ProtocolError(
                    f"This model's maximum context length is {self.state.max_model_len} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                    f"completion). Please reduce the prompt or max_tokens.", param="max_tokens")
            for j in range(body.num_choices):
                index = p * body.num_choices + j
                choices.append(Choice(index, f"{base}-{index}", ids, body.sampling_params(max_tokens, logprobs, j)))
        return choices

    async def _respond(self, kind: str, body: SamplingFields, adapter: str | None, choices: list[Choice],
                       request: Request):
        self.state.check_queue(len(choices))
        first = choices[0]
        # the first choice goes in before the response starts, so a rejected request is a clean 400
        gens = [self.state.backend.generate(c.prompt_ids, c.params, adapter, c.request_id) for c in choices]
        try:
            head = await anext(gens[0])
        except ValueError as e:
            raise ProtocolError(str(e)) from e
        meta = {"id": first.request_id.rsplit("-", 1)[0], "created": int(time.time()), "model": body.model}
        if body.stream:
            events = self._stream(kind, meta, choices, gens, head, body.usage_wanted)
            return StreamingResponse(_sse(events, [c.request_id for c in choices], self.state.backend),
                                     media_type="text/event-stream")
        finals = await self._collect(choices, gens, head, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self._final_response(kind, meta, choices, finals))

    async def _collect(self, choices: list[Choice], gens, head: RequestOutput,
                       request: Request) -> list[RequestOutput] | None:
        async def last(i: int, gen) -> RequestOutput:
            out = head if i == 0 else None
            if out is None or not out.finished:
                async for out in gen:
                    pass
            return out

        tasks = [asyncio.ensure_future(last(i, g)) for i, g in enumerate(gens)]
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done = asyncio.ensure_future(asyncio.gather(*tasks))
            await asyncio.wait([done, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():  # the client went away: abort every choice, free their pages
                done.cancel()
                for c in choices:
                    await self.state.backend.abort(c.request_id)
                return None
            return done.result()
        finally:
            watcher.cancel()

    def _final_response(self, kind: str, meta: dict, choices: list[Choice], finals: list[RequestOutput]) -> dict:
        for out in finals:
            _raise_if_failed(out)
        items = []
        for c, out in zip(choices, finals):
            if kind == "chat.completion":
                items.append({"index": c.index, "message": {"role": "assistant", "content": out.text},
                              "logprobs": self._chat_logprobs(out, out.token_ids, out.logprobs),
                              "finish_reason": out.finish_reason})
            else:
                items.append({"index": c.index, "text": out.text, "finish_reason": out.finish_reason,
                              "logprobs": self._completion_logprobs(out.token_ids, out.logprobs)})
        return {**meta, "object": kind, "choices": items, "usage": _usage(choices, finals)}

    async def _stream(self, kind: str, meta: dict, choices: list[Choice], gens, head: RequestOutput,
                      usage_wanted: bool) -> AsyncIterator[dict]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                if i == 0:
                    await merged.put((0, head))
                    if head.finished:
                        return
                async for out in gen:
                    await merged.put((i, out))
            except Exception as e:  # noqa: BLE001 - reported to the client as an error event
                await merged.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        finals: list[RequestOutput | None] = [None] * len(choices)
        try:
            if kind == "chat.completion":
                for c in choices:
                    yield {**meta, "object": chunk_kind, "choices": [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            while any(f is None for f in finals):
                i, out = await merged.get()
                if isinstance(out, Exception):
                    yield {"error": error_body(f"internal error: {out}", "server_error")}
                    return
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        yield {"error": error_body(out.error or "request failed", "server_error")}
                        return
                yield {**meta, "object": chunk_kind, "choices": [self._chunk_choice(kind, choices[i].index, out)]}
            if usage_wanted:
                yield {**meta, "object": chunk_kind, "choices": [], "usage": _usage(choices, finals)}
        finally:
            for t in tasks:
                t.cancel()

    def _chunk_choice(self, kind: str, index: int, out: RequestOutput) -> dict:
        reason = out.finish_reason if out.finished else None
        new_logprobs = out.logprobs[-len(out.new_token_ids):] if out.logprobs and out.new_token_ids else None
        if kind == "chat.completion":
            return {"index": index, "delta": {"content": out.new_text} if out.new_text else {},
                    "logprobs": self._chat_logprobs(out, out.new_token_ids, new_logprobs), "finish_reason": reason}
        return {"index": index, "text": out.new_text, "finish_reason": reason,
                "logprobs": self._completion_logprobs(out.new_token_ids, new_logprobs)}

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[float] | None) -> dict | None:
        if logprobs is None:
            return None
        tokens = [self.state.tokenizer.decode([t]) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

    def _chat_logprobs(self, out: RequestOutput, token_ids: list[int], logprobs: list[float] | None) -> dict | None:
        if logprobs is None:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs):
            text = self.state.tokenizer.decode([t])
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return {"content": content}


def _usage(choices: list[Choice], finals: list[RequestOutput]) -> dict[str, int]:
    seen, prompt = set(), 0
    for c in choices:
        if id(c.prompt_ids) not in seen:
            seen.add(id(c.prompt_ids))
            prompt += len(c.prompt_ids)
    completion = sum(len(f.token_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise ProtocolError(out.error or "request failed", status=500, kind="server_error")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `kind` is its `type` ("invalid_request_error" for a client's error,
    "server_error" for ours), `param` the request field at fault, `code` a string or None."""
    return {"message": message, "type": kind, "param": param, "code": code}


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _sse(events: AsyncIterator[dict], request_ids: list[str], backend) -> AsyncIterator[str]:
    """Server-sent events; if the client goes away mid-stream, every choice is aborted."""
    finished = False
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            for request_id in request_ids:
                await backend.abort(request_id)
