"""Engine: the step loop, schedule -> run -> postprocess, over one executor.

`add_request` validates one request (a ValueError names what is wrong with it and nothing
else is disturbed), `step` runs one fused prefill+decode batch and returns what requests
produced, `abort` drops a request and frees its pages, `steps` runs until no request is left.
`set_tenants` gives tenants their weights and caps (punica.engine.tenancy); `scheduling` picks
the waiting queue: fair share across tenants (punica.engine.fair_share) or first come, first served.

Steps overlap: step t+1 is scheduled and launched before step t's sampled tokens reach the
host. Its decode rows read those tokens on the device (the StepInput's fed rows), and the host
reads step t's tokens while the device runs step t+1. So `step` returns the outputs of the step
launched before it, and a request that stops (EOS, stop token or string) has run one more row,
which is dropped. An engine does not run ahead when step t+1 depends on step t's values on the
host: a request with penalties (they read the output tokens), a request certain to finish by
length (it must leave the batch), or a preemption (the victim is recomputed from its tokens).

A request under a grammar (structured outputs, punica.engine.structured) samples with a mask that
depends on every token before it. When step t+1 holds one, its forward pass is launched first,
then step t's tokens are read (advancing the matchers) and the masks built on the host while the
device runs that forward pass; only then is step t+1 sampled. So no request samples with a
matcher behind its tokens, and the mask building hides behind the forward pass.

Requests can also move between engines (the cluster's migration): `add_request` with
`output_token_ids` resumes a request that generated them elsewhere, and `take_preempted` hands
back the requests this engine preempted instead of recomputing them here.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from operator import attrgetter

import torch
import xgrammar as xgr

from punica.config import EngineConfig
from punica.engine import prompt_logprobs
from punica.engine.admission import acquire_adapter, adapter_error, check_lora_scale, checked_prompt, release_adapter
from punica.engine.constraint import GrammarLimits
from punica.engine.detokenizer import IncrementalDetokenizer
from punica.engine.executor import Executor
from punica.engine.fair_share import FairQueue
from punica.engine.kv_cache import PageAllocator
from punica.engine.launched import LaunchedStep, to_host
from punica.engine.outputs import RequestOutput, request_output
from punica.engine.request import PENDING, Request
from punica.engine.sampler import Sampled, sample
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import ScheduledBatch, Scheduler
from punica.engine.stats import EngineStats, StepShape
from punica.engine.step_input import StepInput
from punica.engine.structured import GrammarCompiler
from punica.engine.tenancy import TenantShare, checked_shares, tenant_key
from punica.engine.waiting import FcfsQueue
from punica.engine.worker import context_limit
from punica.lora.manager import AdapterManager
from punica.ops.transfer import to_device

log = logging.getLogger(__name__)
NON_FINITE = ("the model's output for this request is not finite (NaN or inf): its activations overflowed, "
              "e.g. through its adapter's weights")
GRAMMAR_REJECTED = "the sampled token does not match this request's structured_outputs constraint"
STALLED_WAIT_S = 0.001  # a step that can run nothing (every queued request waits for an adapter) sleeps this long
by_slot = attrgetter("slot")


class Engine:
    def __init__(self, executor: Executor, tokenizer, config: EngineConfig = EngineConfig(),
                 adapters: dict[str, str] | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.executor, self.tokenizer, self.config = executor, tokenizer, config
        model_config = executor.model_config
        self.vocab_size = model_config.vocab_size
        self.allocator = PageAllocator(executor.num_pages, config.page_size, config.prefix_caching)
        self.max_model_len = context_limit(model_config, config, executor.num_pages)
        self.eos_token_ids = set(eos_token_ids) | set(model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.overlaps_steps = config.overlap_steps and executor.can_feed_sampled
        self.adapters = AdapterManager(model_config, executor.adapter_slots, config.lora_host_bytes,
                                       adapter_dirs=config.adapter_dirs)
        for name, path in (adapters or {}).items():
            self.adapters.register(name, path)
        # bound to the manager, not to self: no reference cycle keeps a dropped engine's KV
        # cache alive until the garbage collector runs
        self.scheduler = Scheduler(self.allocator, config.max_batch_size, config.max_num_batched_tokens,
                                   config.chunked_prefill,
                                   acquire=partial(acquire_adapter, self.adapters),
                                   release=partial(release_adapter, self.adapters),
                                   waiting=FairQueue() if config.scheduling == "fair" else FcfsQueue())
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._launched: LaunchedStep | None = None
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._num_constrained = 0
        self.last_step: StepShape | None = None  # of the last `step` call, None if it launched nothing
        self._errors_seen, self._preemptions_seen, self._queued_unloadable = 0, 0, False  # see _fail_unloadable

    # adapters ------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Register an adapter at run time; it is read and copied to the GPU when first used."""
        self.adapters.register(name, path, pinned=pinned)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter. Requests already in the batch finish with it; queued requests
        for it fail with finish_reason "error"; its GPU slot is freed when the last one leaves, and
        the prefix cache drops its KV."""
        registration = self.adapters.current.get(name)
        self.adapters.unregister(name)
        self.allocator.drop(registration)

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters.registry

    def adapter_paths(self) -> dict[str, str]:
        """Every registered adapter: name -> directory."""
        return {name: str(path) for name, path in self.adapters.registry.items()}

    # tenants -------------------------------------------------------------------------------
    def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """Give each named tenant (punica.engine.tenancy.tenant_key) its weight and caps, replacing
        the shares given before; the others get the default share. Requests already queued or
        running stay: a lower max_concurrent_requests refuses new ones only."""
        self.scheduler.waiting.set_shares(checked_shares(shares))

    # requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None,
                    output_token_ids: list[int] = (), *, tenant: str | None = None,
                    cache_salt: str | None = None, grammar: xgr.CompiledGrammar | None = None) -> str:
        """Queue a request. `output_token_ids`: tokens it already generated elsewhere (a migrated
        request resumes after them; their text is not returned again). `tenant`: who sent it;
        `cache_salt`: it shares prefix-cache pages only with requests of the same salt (and tenant).
        `grammar`: its structured_outputs compiled (`grammars.pool`); without it, it is compiled here,
        on the caller's thread (the offline API's way; a server compiles before it calls).
        punica.engine.tenancy.TenantLimitError (a ValueError) when its tenant has its
        max_concurrent_requests queued or running."""
        params = params or SamplingParams()
        text, token_ids = checked_prompt(prompt, self.tokenizer, self.max_model_len, self.vocab_size)
        if adapter is not None and adapter not in self.adapters.registry:
            raise ValueError(f"unknown adapter {adapter!r} ({len(self.adapters.registry)} adapters are registered)")
        check_lora_scale(params, adapter, self.adapters)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if any(token >= self.vocab_size for token, _ in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids below {self.vocab_size}")
        for name, value in (("tenant", tenant), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string or None, got {type(value).__name__}")
        self.scheduler.waiting.check_room(tenant_key(tenant, adapter))
        matcher = None
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            matcher = self.grammars.matcher(spec, grammar or self.grammars.pool.compile(spec), list(output_token_ids))
            self._num_constrained += 1
        request = Request(request_id, token_ids, params, adapter=adapter, tenant=tenant, cache_salt=cache_salt,
                          prompt=text, output_token_ids=list(output_token_ids),
                          registration=self.adapters.current.get(adapter),
                          queued_residency=self.adapters.residency(adapter), matcher=matcher)
        prompt_logprobs.start(request)
        if adapter_error(self.adapters, request):
            self._queued_unloadable = True  # it fails at the next step, as if queued earlier
        self.requests[request_id] = request
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop,
                                                 params.include_stop_str_in_output)
            for token in output_token_ids:
                detokenizer.add_token(token)
            detokenizer.take_new_text(finished=False)  # streamed where it ran before
            self._detokenizers[request_id] = detokenizer
        self.scheduler.add(request)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars; ValueError for an engine without a tokenizer."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, and this engine has none")
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                             GrammarLimits.of(self.config))
        return self._grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return self._output(request)

    def take_preempted(self) -> list[tuple[str, list[int]]]:
        """Remove every request this engine preempted (it ran out of KV cache) and return
        (request_id, output_token_ids) of each, newest first, to be placed again elsewhere."""
        preempted = [r for r in self.scheduler.waiting if r.num_preemptions]
        taken = [(r.request_id, r.resolved_output_token_ids) for r in preempted]
        for request in preempted:
            self.abort(request.request_id)
        return taken

    def close(self) -> None:
        """Stop what the executor started (tensor-parallel processes) and the grammar compiles not
        started; idempotent."""
        self.executor.close()
        if self._grammars is not None:
            self._grammars.pool.close()

    def running_request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    @property
    def has_step_in_flight(self) -> bool:
        """A step has been launched whose outputs the next `step` returns."""
        return self._launched is not None

    def requests_in_flight(self) -> list[Request]:
        """The requests of the step in flight, in the order of its rows (the rows whose sampled
        tokens a next step's decodes read on the device); empty when no step is in flight. The
        list is a copy: changing it changes nothing in the engine."""
        return list(self._launched.requests) if self._launched is not None else []

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_pages=self.allocator.num_pages, num_kv_pages_used=self.allocator.num_used,
            num_adapter_slots=self.adapters.pool.max_loras, num_adapter_slots_used=len(self.adapters.resident),
            num_adapter_slots_held=len(self.adapters.refs),
            num_preemptions=self.scheduler.num_preemptions, num_constrained_requests=self._num_constrained,
            grammar_compile_seconds=self._grammars.pool.compile_seconds if self._grammars is not None else 0.0,
            num_kv_pages_cached=self.allocator.num_cached, num_chunked_steps=self.scheduler.num_chunked_steps,
            prefix_cache={name: replace(counts) for name, counts in self.scheduler.prefix_cache.items()},
            tenants=self.scheduler.tenant_stats())

    # the step loop ---------------------------------------------------------------------------
    def steps(self) -> Iterator[list[RequestOutput]]:
        """Step until no request is left, yielding each step's outputs."""
        while self.has_unfinished():
            yield self.step()

    def step(self) -> list[RequestOutput]:
        """One step. When it can run nothing (every queued request waits for its adapter), it
        sleeps briefly, so that a caller stepping in a tight loop leaves the adapter readers time.
        If running a step raises, that step's requests fail (finish_reason "error") and the engine
        goes on with the others."""
        self.last_step = None
        outputs = self._fail_unloadable()
        self.adapters.poll([r.adapter for r in self.scheduler.waiting if r.adapter is not None])
        if self._launched is not None and not self._may_run_ahead(self._launched):
            outputs += self._resolve(self._launched)
            self._launched = None
        batch = self.scheduler.schedule()
        previous, self._launched = self._launched, None
        if batch:
            try:
                requests, logits = self._run(batch, previous)
                if previous is not None and any(r.matcher is not None for r in requests):
                    outputs += self._resolve(previous)  # while the device runs the forward pass
                    previous = None
                if requests:
                    self._launched = self._sample(requests, logits)
            except Exception as e:  # noqa: BLE001 - this step's requests fail; the engine serves on
                log.exception("running a step failed")
                outputs += [self._fail(r, f"internal error while running this request: {e}") for r in batch.requests]
        if previous is not None:
            outputs += self._resolve(previous)
        if self._launched is not None and not self.overlaps_steps:
            outputs += self._resolve(self._launched)
            self._launched = None
        if not outputs and self._launched is None and self.scheduler.has_unfinished():
            time.sleep(STALLED_WAIT_S)
        return outputs

    def _may_run_ahead(self, launched: LaunchedStep) -> bool:
        """Whether the next step can be scheduled before `launched`'s tokens are on the host."""
        for request in launched.requests:
            if request.finished:
                continue
            if request.params.uses_penalties or self._ends_by_length(request, len(request.output_token_ids)):
                return False
        return self.scheduler.can_grow_running()

    def _ends_by_length(self, request: Request, num_out: int) -> bool:
        """Whether the request is done once it has `num_out` output tokens (max_tokens or the context)."""
        return num_out >= request.params.max_tokens or len(request.prompt_token_ids) + num_out >= self.max_model_len

    def _run(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> tuple[list[Request], torch.Tensor]:
        """Launch the batch's forward pass; the requests that reached the end of their tokens (a
        prompt chunk short of its prompt's end samples nothing), and the logits of their rows."""
        # requests of one adapter side by side form one LoRA segment
        prefills, decodes = sorted(batch.prefills, key=by_slot), sorted(batch.decodes, key=by_slot)
        fed = None
        if previous is not None:
            row_of = {request: row for row, request in enumerate(previous.requests)}
            fed = [row_of[r] if r.num_pending else -1 for r in decodes]
        step = StepInput.from_requests(prefills, decodes, self.config.page_size, fed)
        self.last_step = StepShape(step.num_requests, int(step.context_lens.sum()), step.num_prefill_tokens)
        logits = self.executor.run(step)
        requests = prefills + decodes
        if not step.only_last_logits:
            prompt_logprobs.launch(logits, requests, step.num_logits.tolist())
        for request in requests:
            request.num_cached += request.num_scheduled
        last_rows = step.num_logits.cumsum() - 1  # each request's last row of logits
        rows = [int(last_rows[i]) for i, r in enumerate(requests) if r.num_cached == r.num_tokens]
        if len(rows) < len(logits):
            requests = [r for r in requests if r.num_cached == r.num_tokens]
            logits = logits[to_device(torch.tensor(rows, dtype=torch.int64), logits.device)]  # no wait on the step
        return requests, logits

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> LaunchedStep:
        """Sample the rows on the device, under the grammar masks of constrained requests; each
        request gets a PENDING output token."""
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
        for request in requests:
            request.output_token_ids.append(PENDING)
            request.num_pending += 1
        return LaunchedStep(requests, sampled, logprobs, copied)

    def _masks(self, requests: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, allowed-token bitmask) on `device` of the constrained requests still running, built
        on the host from matchers that have taken every token before this step."""
        rows = [row for row, r in enumerate(requests) if r.matcher is not None and not r.finished]
        if not rows:
            return None
        bitmask = self.grammars.fill_bitmasks([requests[row].matcher for row in rows], pin=device.type == "cuda")
        return to_device(torch.tensor(rows), device), to_device(bitmask, device)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to its requests that are still running;
        a request whose row could not be sampled fails alone, and all of them if reading fails."""
        try:
            tokens, ok, logprobs, tops = launched.read()
        except Exception as e:  # noqa: BLE001 - the step failed on the device: its requests fail
            log.exception("reading a step's tokens failed")
            return [self._fail(r, f"internal error while running this request: {e}") for r in launched.requests
                    if not r.finished]
        now = time.monotonic()
        outputs = []
        for request, token, sampled, logprob, top in zip(launched.requests, tokens, ok, logprobs, tops):
            if request.finished:
                continue
            if not sampled:
                outputs.append(self._fail(request, NON_FINITE))
                continue
            if request.matcher is not None and not request.matcher.accept_token(token):
                outputs.append(self._fail(request, GRAMMAR_REJECTED))
                continue
            outputs.append(self._append(request, token, logprob, top, now))
        return outputs

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """Finish a request with finish_reason "error", dropping its tokens still in flight."""
        del request.output_token_ids[len(request.output_token_ids) - request.num_pending:]
        request.num_pending = 0
        request.finish_time = time.monotonic()
        self.scheduler.finish(request, "error")
        return self._output(request, error=error)

    def _fail_unloadable(self) -> list[RequestOutput]:
        """Finish queued requests whose adapter failed to load or was unloaded: a scan of the
        queue after a new failure or unload, a preemption (its victim may have been running on an
        adapter unloaded since), or after such a request was queued."""
        preemptions = self.scheduler.num_preemptions
        if (self.adapters.num_errors == self._errors_seen and preemptions == self._preemptions_seen
                and not self._queued_unloadable):
            return []
        self._errors_seen, self._preemptions_seen = self.adapters.num_errors, preemptions
        self._queued_unloadable = False
        outputs = []
        for request in list(self.scheduler.waiting):
            error = adapter_error(self.adapters, request)
            if error:
                self.scheduler.finish(request, "error")
                outputs.append(self._output(request, error=error))
        return outputs

    def _append(self, request: Request, token: int, logprob: float | None, top: list[tuple[int, float]],
                now: float) -> RequestOutput:
        """Put the value of the request's oldest pending token, then stop it if it should."""
        num_out = len(request.output_token_ids) - request.num_pending + 1
        request.output_token_ids[num_out - 1] = token
        request.num_pending -= 1
        p = request.params
        prompt_logprobs.take(request)
        if p.wants_logprobs:
            request.output_logprobs.append(logprob)
        if p.top_logprobs:
            request.output_top_logprobs.append(top[:p.top_logprobs])
        if request.first_token_time is None:
            request.first_token_time = now
        detok = self._detokenizers.get(request.request_id)
        stopped_by_string = detok.add_token(token) if detok is not None else False
        reason = None
        completed = request.matcher is not None and request.matcher.is_terminated()
        if (stopped_by_string or completed or token in p.stop_token_ids
                or (token in self.eos_token_ids and not p.ignore_eos)):
            reason = "stop"
        elif self._ends_by_length(request, num_out):
            reason = "length"
        if reason is not None:
            del request.output_token_ids[num_out:]  # a row run past the stop
            request.num_pending = 0
            request.finish_time = now
            self.scheduler.finish(request, reason)
        return self._output(request, [token])

    def _output(self, request: Request, new_token_ids: list[int] = (), error: str | None = None) -> RequestOutput:
        detokenizer = self._detokenizers.get(request.request_id)
        if request.finished:
            self.requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
        return request_output(request, detokenizer, new_token_ids, error)
