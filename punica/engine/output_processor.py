"""OutputProcessor: RequestOutputs from what steps did to requests (punica.engine.scheduler_output's
RequestUpdates). It keeps each request's output state: its incremental detokenizer, which finds stop
strings (a request whose text reaches one is ended through `stop`, the scheduler's), its logprobs,
and its prompt logprobs (read from the host when its first token is, punica.engine.prompt_logprobs).
A request's finished output is made once, and then its state is dropped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from punica.engine import prompt_logprobs
from punica.engine.detokenizer import IncrementalDetokenizer, skipped_ids
from punica.engine.outputs import RequestOutput
from punica.engine.request import Request
from punica.engine.scheduler_output import RequestUpdate


@dataclass
class OutputState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # (token, logprob), best first
    # per prompt token, from its first (None); the parts of steps whose copy to the host may still be
    # under way wait in prompt_parts
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_parts: list[tuple] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer, stop: Callable[[Request], None]):
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer) if tokenizer is not None else frozenset()
        self.stop = stop  # ends a request at its last token (Scheduler.stop)
        self._states: dict[Request, OutputState] = {}

    def add(self, request: Request) -> None:
        """Start a request's output. Output tokens it generated elsewhere (a migrated request resumes
        after them) go through its detokenizer, their text not returned again; its prompt logprobs
        are computed again (it recomputes its prompt anyway)."""
        detokenizer = None
        if self.tokenizer is not None:
            p = request.params
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.stop,
                                                 p.include_stop_str_in_output, self.skipped)
            for token in request.output_token_ids:
                detokenizer.add_token(token)
            detokenizer.take_new_text(finished=False)  # streamed where it ran before
        state = OutputState(detokenizer)
        if request.params.prompt_logprobs is not None:
            state.prompt_logprobs, state.prompt_top_logprobs = [None], [None]
        self._states[request] = state

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """One output per update that brings a token, an error or the end of its request; prompt
        logprobs alone are kept for the request's first token."""
        outputs = []
        for update in updates:
            state = self._states[update.request]
            if update.prompt_logprobs is not None:
                state.prompt_parts.append(update.prompt_logprobs)
                if update.token_id is None:
                    continue
            if update.token_id is not None:
                self._add_token(update, state)
            outputs.append(self._output(update, state))
        return outputs

    def _add_token(self, update: RequestUpdate, state: OutputState) -> None:
        request, p = update.request, update.request.params
        if state.prompt_parts:
            logprobs, tops = prompt_logprobs.read(state.prompt_parts, p.prompt_logprobs)
            state.prompt_logprobs += logprobs
            state.prompt_top_logprobs += tops
            state.prompt_parts.clear()
        if p.wants_logprobs:
            state.logprobs.append(update.logprob)
        if p.top_logprobs:
            state.top_logprobs.append(update.top_logprobs[:p.top_logprobs])
        if state.detokenizer is not None and state.detokenizer.add_token(update.token_id):
            self.stop(request)

    def _output(self, update: RequestUpdate, state: OutputState) -> RequestOutput:
        """The request's output now: its resolved tokens, its text so far and what is new since its last output."""
        request, p = update.request, update.request.params
        finished = request.finished
        if finished:
            del self._states[request]
        output_token_ids = request.resolved_output_token_ids
        num_out = len(output_token_ids)
        ttft = tpot = None
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
            if finished and num_out > 1 and request.finish_time is not None:
                tpot = (request.finish_time - request.first_token_time) / (num_out - 1)
        prompt_done = p.prompt_logprobs is not None and len(state.prompt_logprobs) == len(request.prompt_token_ids)
        detokenizer = state.detokenizer
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            adapter=request.adapter, text=detokenizer.text if detokenizer else "", token_ids=output_token_ids,
            logprobs=list(state.logprobs) if p.wants_logprobs else None,
            top_logprobs=list(state.top_logprobs) if p.top_logprobs else None,
            prompt_logprobs=state.prompt_logprobs if prompt_done else None,
            prompt_top_logprobs=state.prompt_top_logprobs if prompt_done else None,
            new_text=detokenizer.take_new_text(finished) if detokenizer else "",
            new_token_ids=[update.token_id] if update.token_id is not None else [],
            finished=finished, finish_reason=request.finish_reason, error=update.error,
            time_to_first_token=ttft, time_per_output_token=tpot, num_preemptions=request.num_preemptions,
            num_cached_tokens=request.num_cached_prompt_tokens, tenant=request.tenant,
        )
