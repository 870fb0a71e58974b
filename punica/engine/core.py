"""EngineCore: the step loop, schedule -> execute -> update, over one executor.

    Scheduler.schedule()            -> SchedulerOutput (the plan: rows, chunk sizes and offsets)
    execute: StepInput -> executor.run -> logits -> sample on the device -> LaunchedStep
    Scheduler.launched(output)      (the rows' tokens count as cached; sampled tokens are PENDING)
    LaunchedStep.read()             -> SampledTokens (the values on the host)
    Scheduler.update_from_output()  -> [RequestUpdate], for the output processor

Steps overlap (`overlap_steps`; by default where the model runs on a GPU, which computes a step while
the host plans the next: on the CPU the model runs inside the step, so overlap would only return each
token a step later): step t+1 is scheduled and launched before step t's sampled tokens reach the host.
Its decode rows read those tokens on the device (the StepInput's fed rows), and the host reads step
t's tokens while the device runs step t+1. So `step` returns the updates of the step launched before
it, and a request that stops (EOS, stop token or string) has run one more row, which is dropped. A
step's tokens are read before the next plan when it depends on their values on the host
(Scheduler.may_run_ahead: penalties, a request certain to end by length, a preemption). A stop
string is found by the output processor, once `step` has returned: the request it ends may have run
one more row too.

A request under a grammar (structured outputs, punica.engine.structured) samples with a mask that
depends on every token before it. When step t+1 holds one, its forward pass is launched first, then
step t's tokens are read (advancing the matchers) and the masks built on the host while the device
runs that forward pass; only then is step t+1 sampled. So no request samples with a matcher behind
its tokens, and the mask building hides behind the forward pass.

The core also polls the adapter manager's loads and fails the queued requests whose adapter failed
to load or was unloaded.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from punica.config import EngineConfig
from punica.engine import prompt_logprobs
from punica.engine.admission import adapter_error
from punica.engine.constraint import GrammarLimits
from punica.engine.executor import Executor
from punica.engine.launched import LaunchedStep, to_host
from punica.engine.request import Request
from punica.engine.sampler import Sampled, sample
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import RequestUpdate, SchedulerOutput
from punica.engine.stats import StepShape
from punica.engine.step_input import StepInput
from punica.engine.structured import GrammarCompiler
from punica.lora.manager import AdapterManager
from punica.ops.transfer import to_device

log = logging.getLogger(__name__)
step_clock = time.perf_counter  # times steps for the scheduler's latency budget (tests make it a counter)
STALLED_WAIT_S = 0.001  # a step that can run nothing (every queued request waits for an adapter) sleeps this long


class EngineCore:
    def __init__(self, executor: Executor, scheduler: Scheduler, adapters: AdapterManager, config: EngineConfig,
                 tokenizer, eos_token_ids: frozenset[int]):
        self.executor, self.scheduler, self.adapters = executor, scheduler, adapters
        self.page_size = config.page_size
        self.overlaps_steps = config.overlaps_steps_on(executor.device.type) and executor.can_feed_sampled
        self._tokenizer, self._eos_token_ids, self._grammar_limits = tokenizer, eos_token_ids, GrammarLimits.of(config)
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._in_flight: LaunchedStep | None = None    # launched, its tokens not yet read
        self.last_step: StepShape | None = None  # of the last `step` call, None if it launched nothing
        self._errors_seen, self._preemptions_seen, self._queued_unloadable = 0, 0, False  # see _poll_adapters
        self._last_read = 0.0  # step_clock() when the last step's tokens reached the host

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars; ValueError for an engine without a tokenizer."""
        if self._grammars is None:
            if self._tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            self._grammars = GrammarCompiler(self._tokenizer, self.executor.model_config.vocab_size,
                                             self._eos_token_ids, self._grammar_limits)
        return self._grammars

    @property
    def has_grammars(self) -> bool:
        """Whether `grammars` was made (a constrained request came)."""
        return self._grammars is not None

    def add(self, request: Request) -> None:
        if adapter_error(self.adapters, request):
            self._queued_unloadable = True  # it fails at the next step, as if queued earlier
        self.scheduler.add(request)

    @property
    def in_flight(self) -> LaunchedStep | None:
        """The step launched whose tokens the next `step` reads, if any."""
        return self._in_flight

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestUpdate]:
        """One step: schedule, launch it (its forward pass and sampling, on the device), then read
        the tokens of the step launched before. When it can run nothing (every queued request waits
        for its adapter), it sleeps briefly, so that a caller stepping in a tight loop leaves the
        adapter readers time. If running a step raises, that step's requests fail (finish_reason
        "error") and the engine goes on with the others."""
        self.last_step = None
        updates = self._poll_adapters()
        if self._in_flight is not None and not self.scheduler.may_run_ahead(self._in_flight.output):
            updates += self._update()  # the plan depends on its tokens on the host
        output = self.scheduler.schedule()
        launched = self._execute(output, updates) if output else None
        updates += self._update()  # the step before, read while this one runs on the device
        self._in_flight = launched
        if not self.overlaps_steps:
            updates += self._update()
        if not output and not updates and self.scheduler.has_unfinished():
            time.sleep(STALLED_WAIT_S)
        return updates

    def _execute(self, output: SchedulerOutput, updates: list[RequestUpdate]) -> LaunchedStep | None:
        """Launch the step's forward pass and sample it on the device; None if that raised (the
        step's requests fail). When a constrained request samples in it, the step in flight is
        updated between the two (into `updates`): its matchers must take those tokens first."""
        started = step_clock()
        requests = list(self.scheduler.requests_of(output))
        try:
            logits, prompt = self._forward(output, requests)
            sampling = [requests[row] for row in output.sampling_rows]
            if any(r.matcher is not None for r in sampling):
                updates += self._update()  # while the device runs the forward pass
            launched = dataclasses.replace(self._sample(output, sampling, logits, prompt), started=started)
        except Exception as e:  # noqa: BLE001 - this step's requests fail; the engine serves on
            log.exception("running a step failed")
            updates += self.scheduler.fail(output, f"internal error while running this request: {e}")
            return None
        self.scheduler.launched(output)
        return launched

    def _forward(self, output: SchedulerOutput, requests: list[Request]) -> tuple[torch.Tensor, dict[int, tuple]]:
        """Launch the forward pass of the step's rows: the logits of its sampling rows' last positions,
        and the prompt logprobs launched from the others' (punica.engine.prompt_logprobs)."""
        fed = None
        if self._in_flight is not None:
            row_of = {request: row for row, request in enumerate(self._in_flight.requests)}
            fed = [row_of[r] if r.num_pending else -1 for r in requests[output.num_prefills:]]
        step = StepInput.from_requests(requests, output.num_scheduled, output.num_prefills, self.page_size, fed)
        self.last_step = StepShape(step.num_requests, int(step.context_lens.sum()), step.num_prefill_tokens)
        logits = self.executor.run(step)
        prompt = {}
        # a chunk whose one missing logprob is at its last row (a one-token chunk; after a preemption,
        # rows whose logprobs came before) gets just that row's logits, as a step without any does
        if not step.only_last_logits or any(r.needs_prompt_logprobs for r in requests[:output.num_prefills]):
            prompt = prompt_logprobs.launch(logits, requests, output.num_scheduled, step.num_logits.tolist())
        if len(output.sampling_rows) < len(logits):  # a chunk short of its prompt's end samples nothing
            last_rows = step.num_logits.cumsum() - 1
            rows = [int(last_rows[row]) for row in output.sampling_rows]
            logits = logits[to_device(torch.tensor(rows, dtype=torch.int64), logits.device)]  # no wait on the step
        return logits, prompt

    def _sample(self, output: SchedulerOutput, requests: list[Request], logits: torch.Tensor,
                prompt: dict[int, tuple]) -> LaunchedStep:
        """Sample the rows on the device, under the grammar masks of constrained requests, and queue
        the copy of the tokens to the host."""
        if not requests:
            return LaunchedStep(output, requests, None, None, prompt, None)
        s: Sampled = sample(logits, requests, self._masks(requests, logits.device))
        if self.overlaps_steps:
            self.executor.keep_sampled(s.tokens)
        ints = [s.tokens[None], s.ok.to(torch.int64)[None]] + ([s.top_ids.T] if s.top_ids is not None else [])
        sampled, logprobs = torch.cat(ints), s.logprobs
        copied = None
        if sampled.is_cuda:
            sampled, logprobs = to_host(sampled), logprobs if logprobs is None else to_host(logprobs)
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(output, requests, sampled, logprobs, prompt, copied)

    def _masks(self, requests: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, allowed-token bitmask) on `device` of the constrained requests still running, built
        on the host from matchers that have taken every token before this step."""
        rows = [row for row, r in enumerate(requests) if r.matcher is not None and not r.finished]
        if not rows:
            return None
        bitmask = self.grammars.fill_bitmasks([requests[row].matcher for row in rows], pin=device.type == "cuda")
        return to_device(torch.tensor(rows), device), to_device(bitmask, device)

    def _update(self) -> list[RequestUpdate]:
        """Wait for the tokens of the step in flight, if any, and update its requests with them (they
        all fail if reading fails)."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        try:
            sampled = launched.read()
        except Exception as e:  # noqa: BLE001 - the step failed on the device: its requests fail
            log.exception("reading a step's tokens failed")
            return self.scheduler.fail(launched.output, f"internal error while running this request: {e}")
        # the step ran from its launch, or from the step before it ending if that came later (overlap)
        now = step_clock()
        self.scheduler.observe(launched.output, now - max(launched.started, self._last_read))
        self._last_read = now
        return self.scheduler.update_from_output(launched.output, sampled)

    def _poll_adapters(self) -> list[RequestUpdate]:
        """Let the adapter manager's loads go on, and first fail the queued requests whose adapter
        failed to load or was unloaded: a scan of the queue after a new failure or unload, a
        preemption (its victim may have been running on an adapter unloaded since), or after such a
        request was queued."""
        updates = []
        preemptions = self.scheduler.num_preemptions
        if (self.adapters.num_errors != self._errors_seen or preemptions != self._preemptions_seen
                or self._queued_unloadable):
            self._errors_seen, self._preemptions_seen = self.adapters.num_errors, preemptions
            self._queued_unloadable = False
            for request in list(self.scheduler.waiting):
                error = adapter_error(self.adapters, request)
                if error:
                    self.scheduler.finish(request, "error")
                    updates.append(RequestUpdate(request, error=error))
        self.adapters.poll([r.adapter for r in self.scheduler.waiting if r.adapter is not None])
        return updates
