"""/v1/completions and /v1/chat/completions: requests in, OpenAI responses and SSE chunks out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from punica.engine.admission import ids_in_vocabulary
from punica.engine.constraint import GrammarError
from punica.engine.engine import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import TenantLimitError
from punica.server.interrupts import DISCONNECT, Interrupt
from punica.server.limits import PromptBound
from punica.server.openai_objects import Logprobs, error_body, usage
from punica.server.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, SamplingFields
from punica.server.structured_fields import Constraint
from punica.server.tenants import Caller
from punica.server.tools import Tools, ToolStream, parse_tools, render_without_template_tools, template_supports_tools

CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tools: Tools | None = None         # chat: the output may hold tool calls (tool_choice other than "none")
    echo: str = ""                     # completions: the prompt's text, before the completion's


class OpenAIHandlers:
    def __init__(self, state):
        self.state = state  # punica.server.app.ServerState
        self.prompt_bound = PromptBound(state.tokenizer) if state.tokenizer is not None else None
        self.logprobs = Logprobs(state.tokenizer)
        self._aborts: set[asyncio.Task] = set()  # the loop holds tasks weakly

    # entry points --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request, caller: Caller):
        body.check_supported()
        adapter = await self.state.resolve_model(body.model, caller)
        self.state.check_tenant_room(caller.tenant, adapter)
        prompts = await asyncio.to_thread(self._tokenize, body.prompts())  # off the event loop: it can take seconds
        max_tokens = body.max_tokens_or_default()
        constraint = body.constraint()
        choices = self._choices("cmpl", body, prompts, lambda ids: max_tokens, body.logprobs is not None,
                                body.logprobs or 0, constraint, body.logprobs if body.echo else None)
        if body.echo:
            texts = [self._echo_text(p, ids) for p, ids in zip(body.prompts(), prompts)]
            choices = [dataclasses.replace(c, echo=texts[c.index // body.num_choices]) for c in choices]
        return await self._respond("text_completion", body, adapter, choices, request, constraint, caller.tenant)

    async def chat(self, body: ChatCompletionRequest, request: Request, caller: Caller):
        body.check_supported()
        adapter = await self.state.resolve_model(body.model, caller)
        self.state.check_tenant_room(caller.tenant, adapter)
        messages = [m.template_message(f"messages.{i}") for i, m in enumerate(body.messages)]
        if self.state.tokenizer is None or not self.state.tokenizer.chat_template:
            raise ProtocolError("this model has no chat template: use /v1/completions")
        tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        constraint = body.constraint()
        if tools is not None and tools.constraint() is not None:
            if constraint is not None:
                raise ProtocolError(f'tool_choice "{tools.choice}" constrains the output, and so does '
                                    "response_format (or structured_outputs): set one of them", param="tool_choice")
            constraint = Constraint(tools.constraint(), "tools")
        prompt_ids = await asyncio.to_thread(self._chat_prompt_ids, messages, tools)
        limit = body.completion_limit()
        max_model_len = self.state.max_model_len
        choices = self._choices("chatcmpl", body, [prompt_ids],
                                lambda ids: limit if limit is not None else max(1, max_model_len - len(ids)),
                                bool(body.logprobs), body.top_logprobs or 0, constraint)
        if tools is not None and tools.choice != "none":
            choices = [dataclasses.replace(c, tools=tools) for c in choices]
        return await self._respond("chat.completion", body, adapter, choices, request, constraint, caller.tenant)

    # shared ------------------------------------------------------------------------------
    def _tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        vocab_size = self.state.backend.vocab_size
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.prompt_bound is None:
                    raise ProtocolError("this model has no tokenizer: send the prompt as token ids", param="prompt")
                self.prompt_bound.check(len(prompt.encode()), self.state.max_model_len, "prompt")
            elif not ids_in_vocabulary(prompt, vocab_size):
                # checked here, not only by the engine: a later prompt of the request goes in after
                # the response has started
                raise ProtocolError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
        return [self.state.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    def _echo_text(self, prompt: str | list[int], ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.state.tokenizer.decode(ids) if self.state.tokenizer else ""

    def _chat_prompt_ids(self, messages: list[dict], tools: Tools | None) -> list[int]:
        # the template only adds text: contents that cannot fit are refused before templating
        self.prompt_bound.check(sum(len(m["content"].encode()) for m in messages), self.state.max_model_len,
                                "messages")
        tok = self.state.tokenizer
        if template_supports_tools(tok):
            kwargs = {"tools": tools.tools} if tools is not None else {}
        else:
            messages, kwargs = render_without_template_tools(messages, tools), {}
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return tok.encode(text, add_special_tokens=False)

    def _choices(self, prefix: str, body: SamplingFields, prompts: list[list[int]], max_tokens_of,
                 logprobs: bool, top_logprobs: int, constraint: Constraint | None,
                 prompt_logprobs: int | None = None) -> list[Choice]:
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
                params = body.sampling_params(max_tokens, logprobs, j, top_logprobs,
                                              constraint.spec if constraint is not None else None, prompt_logprobs)
                choices.append(Choice(index, f"{base}-{index}", ids, params))
        return choices

    async def _respond(self, kind: str, body: SamplingFields, adapter: str | None, choices: list[Choice],
                       request: Request, constraint: Constraint | None, tenant: str | None):
        self.state.check_queue(len(choices))
        first = choices[0]
        interrupt = Interrupt(request.receive, self.state.in_flight)
        interrupt.on_fire(lambda reason: self._abort(choices))
        gens = [self.state.backend.generate(c.prompt_ids, c.params, adapter, c.request_id, tenant=tenant,
                                            cache_salt=body.cache_salt) for c in choices]
        try:
            # the first choice goes in before the response starts, so a rejected request is a clean 400
            head = await _unless_interrupted(anext(gens[0]), interrupt)
        except GrammarError as e:  # only a constrained request meets it; named by the field that constrained it
            interrupt.close()
            raise ProtocolError(f"{constraint.field} {e.problem}", param=constraint.field) from e
        except TenantLimitError as e:
            interrupt.close()
            raise ProtocolError(str(e), status=429, kind="requests", code="rate_limit_exceeded") from e
        except ValueError as e:  # a SamplingParamsError (lora_scale on the base model) names its field
            interrupt.close()
            raise ProtocolError(str(e), param=getattr(e, "field", None)) from e
        except BaseException:
            interrupt.close()
            raise
        if interrupt.client_gone:
            interrupt.close()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        meta = {"id": first.request_id.rsplit("-", 1)[0], "created": int(time.time()), "model": body.model}
        if body.stream:
            events = self._stream(kind, meta, choices, gens, head, body.usage_wanted, interrupt)
            return StreamingResponse(_sse(events, interrupt), media_type="text/event-stream")
        try:
            finals = await self._collect(choices, gens, head, interrupt)
        finally:
            interrupt.close()
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self._final_response(kind, meta, choices, finals))

    def _abort(self, choices: list[Choice]) -> None:
        """Abort every choice of an interrupted request (those already finished are no-ops), each in
        its own task, so that no cancellation of the request's own tasks can stop it."""
        for c in choices:
            task = asyncio.ensure_future(self.state.backend.abort(c.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)

    async def _collect(self, choices: list[Choice], gens, head: RequestOutput | None,
                       interrupt: Interrupt) -> list[RequestOutput] | None:
        """Every choice's final output; None if the client went away. At a shutdown, the unfinished
        choices end with what they have, finish_reason "abort"."""
        latest: list[RequestOutput | None] = [head] + [None] * (len(choices) - 1)

        async def follow(i: int, gen) -> None:
            if latest[i] is None or not latest[i].finished:
                async for out in gen:
                    latest[i] = out

        pending = set() if interrupt.fired else {asyncio.ensure_future(follow(i, g)) for i, g in enumerate(gens)}
        try:
            while pending and not interrupt.fired:
                done, pending = await asyncio.wait(pending | {interrupt.reason}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(interrupt.reason)
                for task in done - {interrupt.reason}:
                    task.result()  # a failed step's error
        finally:
            for task in pending:
                task.cancel()
        if interrupt.client_gone:
            return None
        return [out if out is not None and out.finished else _aborted(out, c) for out, c in zip(latest, choices)]

    def _final_response(self, kind: str, meta: dict, choices: list[Choice], finals: list[RequestOutput]) -> dict:
        for out in finals:
            _raise_if_failed(out)
        items = []
        for c, out in zip(choices, finals):
            if kind == "chat.completion":
                message: dict[str, Any] = {"role": "assistant", "content": out.text}
                reason = out.finish_reason
                if c.tools is not None:
                    message["content"], calls = c.tools.parse(out.text)
                    if calls:
                        message["tool_calls"] = calls
                        reason = "tool_calls" if reason == "stop" else reason
                items.append({"index": c.index, "message": message, "finish_reason": reason,
                              "logprobs": self.logprobs.chat(out.token_ids, out.logprobs, out.top_logprobs)})
            else:
                items.append({"index": c.index, "text": c.echo + out.text, "finish_reason": out.finish_reason,
                              "logprobs": self.logprobs.completion(out.token_ids, out.logprobs, out.top_logprobs,
                                                                   out)})
        return {**meta, "object": kind, "choices": items, "usage": usage([c.prompt_ids for c in choices], finals)}

    async def _stream(self, kind: str, meta: dict, choices: list[Choice], gens, head: RequestOutput | None,
                      usage_wanted: bool, interrupt: Interrupt) -> AsyncIterator[dict]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()
        if head is not None:
            merged.put_nowait((0, head))
        interrupt.on_fire(lambda reason: merged.put_nowait((None, reason)))

        async def pump(i: int, gen) -> None:
            try:
                if i == 0 and head.finished:
                    return
                async for out in gen:
                    await merged.put((i, out))
            except Exception as e:  # noqa: BLE001 - reported to the client as an error event
                await merged.put((i, e))

        tasks = [] if interrupt.fired else [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        latest: list[RequestOutput | None] = [None] * len(choices)
        finals: list[RequestOutput | None] = [None] * len(choices)
        deltas = [_Deltas(c) for c in choices]
        try:
            if kind == "chat.completion":
                for c in choices:
                    yield {**meta, "object": chunk_kind, "choices": [
                        {"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            while any(f is None for f in finals):
                i, out = await merged.get()
                if i is None:  # interrupted
                    if out == DISCONNECT:
                        return
                    for j, c in enumerate(choices):  # a shutdown: the unfinished choices end here
                        if finals[j] is None:
                            finals[j] = _aborted(latest[j], c)
                            yield {**meta, "object": chunk_kind,
                                   "choices": [self._chunk_choice(kind, deltas[j], finals[j])]}
                    break
                if isinstance(out, Exception):
                    yield {"error": error_body(f"internal error: {out}", "server_error")}
                    return
                latest[i] = out
                if out.finished:
                    finals[i] = out
                    if out.finish_reason == "error":
                        yield {"error": error_body(out.error or "request failed", "server_error")}
                        return
                yield {**meta, "object": chunk_kind, "choices": [self._chunk_choice(kind, deltas[i], out)]}
            if usage_wanted:
                yield {**meta, "object": chunk_kind, "choices": [],
                       "usage": usage([c.prompt_ids for c in choices], finals)}
        finally:
            for t in tasks:
                t.cancel()

    def _chunk_choice(self, kind: str, deltas: _Deltas, out: RequestOutput) -> dict:
        c = deltas.choice
        reason = out.finish_reason if out.finished else None
        n = len(out.new_token_ids)
        new_logprobs = out.logprobs[-n:] if out.logprobs and n else None
        new_tops = out.top_logprobs[-n:] if out.top_logprobs and n else None
        if kind == "chat.completion":
            if deltas.tools is None:
                delta = {"content": out.new_text} if out.new_text else {}
            else:
                delta = deltas.tools.delta(out.text, out.finished)
                if deltas.tools.calls and reason == "stop":
                    reason = "tool_calls"
            return {"index": c.index, "delta": delta, "finish_reason": reason,
                    "logprobs": self.logprobs.chat(out.new_token_ids, new_logprobs, new_tops)}
        echo, deltas.echo = deltas.echo, ""
        first, deltas.first = deltas.first, False
        logprobs = self.logprobs.completion(out.new_token_ids, new_logprobs, new_tops, out if first else None,
                                            deltas.text_offset)
        if logprobs is not None and logprobs["tokens"]:
            deltas.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        return {"index": c.index, "text": echo + out.new_text, "finish_reason": reason, "logprobs": logprobs}


class _Deltas:
    """What a streamed choice has still to send: its echoed prompt (and its logprobs), and its tool calls' state."""

    def __init__(self, choice: Choice):
        self.choice = choice
        self.echo = choice.echo
        self.first = True        # the first chunk: with the echoed prompt's logprobs
        self.text_offset = 0     # of the next token's text, in the choice's text so far
        self.tools = ToolStream(choice.tools) if choice.tools is not None else None


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise ProtocolError(out.error or "request failed", status=500, kind="server_error")


async def _unless_interrupted(awaitable, interrupt: Interrupt):
    """The awaitable's result, or None (the awaitable cancelled) if the request is interrupted first."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait([task, interrupt.reason], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def _aborted(out: RequestOutput | None, choice: Choice) -> RequestOutput:
    """The final output of a choice ended by a shutdown: its text so far, nothing new, "abort"."""
    if out is None:
        return RequestOutput(choice.request_id, None, choice.prompt_ids, None, finished=True, finish_reason="abort",
                             logprobs=[] if choice.params.logprobs else None)
    return dataclasses.replace(out, new_text="", new_token_ids=[], finished=True, finish_reason="abort")


async def _sse(events: AsyncIterator[dict], interrupt: Interrupt) -> AsyncIterator[str]:
    """Server-sent events, ending with [DONE] unless the client went away."""
    try:
        async with aclosing(events):
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        if not interrupt.client_gone:
            yield "data: [DONE]\n\n"
    finally:
        interrupt.close()
