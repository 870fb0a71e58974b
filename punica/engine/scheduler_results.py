"""A launched step's results into its requests, and the requests' ends: the half of the Scheduler
(punica.engine.scheduler) that follows a step once planned.

`launched` records that the step ran on the device (its tokens count as cached; each request that
reached its last token holds a PENDING output token); `update_from_output` puts the sampled values
once they are on the host, ends requests at a stop token, their grammar's end or their length, and
frees them. Steps overlap (the engine plans step t+1 before step t's tokens reach the host), so
several outputs can be launched and not yet updated: each is matched to the requests it planned,
whatever became of them since.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from punica.engine.kv_cache import PageAllocator
from punica.engine.request import PENDING, Request, Status
from punica.engine.scheduler_output import RequestUpdate, SampledTokens, SchedulerOutput
from punica.engine.waiting import WaitingQueue

NON_FINITE = ("the model's output for this request is not finite (NaN or inf): its activations overflowed, "
              "e.g. through its adapter's weights")
GRAMMAR_REJECTED = "the sampled token does not match this request's structured_outputs constraint"


class SchedulerResults:
    """What a launched step did to its requests, and where a request ends, over the Scheduler's state."""

    allocator: PageAllocator
    release: Callable[[Request], None]
    waiting: WaitingQueue
    eos_token_ids: frozenset[int]
    max_model_len: int | None
    requests: dict[str, Request]
    running: list[Request]
    _planned: dict[int, tuple[Request, ...]]

    def requests_of(self, output: SchedulerOutput) -> tuple[Request, ...]:
        """The requests of an output's rows (not yet updated), whatever became of them since."""
        return self._planned.get(output.step, ())

    def launched(self, output: SchedulerOutput) -> None:
        """The step of `output` runs on the device: the tokens of its rows count as cached, and each
        row that samples gives its request an output token, PENDING until `update_from_output` puts
        its value. A request that ended since it was planned is left as it is."""
        rows = self.requests_of(output)
        for request, num_scheduled in zip(rows, output.num_scheduled):
            if not request.finished:
                request.num_prompt_logprobs += request.prompt_rows(num_scheduled)[1]
                request.num_cached += num_scheduled
        for request in (rows[row] for row in output.sampling_rows):
            if not request.finished:
                request.output_token_ids.append(PENDING)
                request.num_pending += 1

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[RequestUpdate]:
        """Put the values of a launched step's sampled tokens, each into its request's oldest PENDING
        token, and end the requests that stop there: at a stop token or EOS, at their grammar's end
        ("stop"), at max_tokens or the context ("length"), or at a row that could not be sampled or
        that their grammar rejects (finish_reason "error"). A request that ended while its row ran
        gets nothing (its id may name a new request by now). One update per prompt logprobs computed
        and per token, in that order."""
        rows = self._planned.pop(output.step, ())
        updates = [RequestUpdate(rows[row], prompt_logprobs=part)
                   for row, part in sampled.prompt_logprobs.items() if not rows[row].finished]
        now = time.monotonic()
        for row, token, ok, logprob, top in zip(output.sampling_rows, sampled.token_ids, sampled.ok,
                                                sampled.logprobs, sampled.top_logprobs):
            request = rows[row]
            if request.finished:
                continue
            if not ok:
                updates.append(self._fail(request, NON_FINITE, now))
            elif request.matcher is not None and not request.matcher.accept_token(token):
                updates.append(self._fail(request, GRAMMAR_REJECTED, now))
            else:
                self._append(request, token, now)
                updates.append(RequestUpdate(request, token, logprob, top))
        return updates

    def _append(self, request: Request, token: int, now: float) -> None:
        num_out = len(request.output_token_ids) - request.num_pending + 1
        request.output_token_ids[num_out - 1] = token
        request.num_pending -= 1
        if request.first_token_time is None:
            request.first_token_time = now
        p = request.params
        if ((request.matcher is not None and request.matcher.is_terminated()) or token in p.stop_token_ids
                or (token in self.eos_token_ids and not p.ignore_eos)):
            self.finish(request, "stop", now)
        elif self.ends_by_length(request, num_out):
            self.finish(request, "length", now)

    def ends_by_length(self, request: Request, num_out: int) -> bool:
        """Whether the request is done once it has `num_out` output tokens (max_tokens or the context)."""
        return (num_out >= request.params.max_tokens
                or (self.max_model_len is not None and len(request.prompt_token_ids) + num_out >= self.max_model_len))

    def fail(self, output: SchedulerOutput, error: str) -> list[RequestUpdate]:
        """End the requests of a step that failed to run, or whose tokens could not be read, with
        finish_reason "error"."""
        now = time.monotonic()
        rows = self._planned.pop(output.step, ())
        return [self._fail(request, error, now) for request in rows if not request.finished]

    def _fail(self, request: Request, error: str, now: float) -> RequestUpdate:
        self.finish(request, "error", now)
        return RequestUpdate(request, error=error)

    def stop(self, request: Request) -> None:
        """End a request at its last token whose value is known: its text reached a stop string (the
        output processor's finding). finish_reason "stop", also when that token ended it by length."""
        if request.finished:
            request.finish_reason = "stop"
        else:
            self.finish(request, "stop", time.monotonic())

    def finish(self, request: Request, reason: str, finish_time: float | None = None) -> None:
        """End a request wherever it is (aborted, stopped, failed): drop its output tokens still
        PENDING (rows run past its end) and release its pages and adapter slot; the KV of a request
        that failed stays out of the prefix cache."""
        if request in self.running:
            self.running.remove(request)
            self.release(request)
            self.waiting.left_batch(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        del request.output_token_ids[len(request.output_token_ids) - request.num_pending:]
        request.num_pending = 0
        self.allocator.free(request, cache=reason != "error")
        request.status = Status.FINISHED
        request.finish_reason, request.finish_time = reason, finish_time
        del self.requests[request.request_id]
