"""Engine: the offline and server API over an EngineCore (schedule -> execute -> update, over one
executor) and an OutputProcessor (detokenizing, stop strings, logprobs, RequestOutputs).

`add_request` validates one request (a ValueError names what is wrong with it and nothing
else is disturbed), `step` runs one fused prefill+decode batch and returns what requests
produced, `abort` drops a request and frees its pages, `steps` runs until no request is left.
`set_tenants` gives tenants their weights and caps (punica.engine.tenancy); `scheduling` picks
the waiting queue: fair share across tenants (punica.engine.fair_share) or first come, first served.

Steps overlap (punica.engine.core): `step` returns the outputs of the step launched before it.

Requests can also move between engines (the cluster's migration): `add_request` with
`output_token_ids` resumes a request that generated them elsewhere, and `take_preempted` hands
back the requests this engine preempted instead of recomputing them here.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import xgrammar as xgr

from punica.config import EngineConfig, ModelConfig
from punica.engine.admission import acquire_adapter, adapter_ready, check_lora_scale, checked_prompt, release_adapter
from punica.engine.calibration import calibrate, shapes
from punica.engine.core import EngineCore
from punica.engine.executor import Executor
from punica.engine.fair_share import FairQueue
from punica.engine.kv_cache import PageAllocator
from punica.engine.output_processor import OutputProcessor
from punica.engine.outputs import RequestOutput
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import RequestUpdate
from punica.engine.stats import EngineStats, StepShape
from punica.engine.step_cost import LatencyBudget
from punica.engine.structured import GrammarCompiler
from punica.engine.tenancy import TenantShare, checked_shares, tenant_key
from punica.engine.waiting import FcfsQueue, WaitingQueue
from punica.engine.worker import context_limit
from punica.lora.manager import AdapterManager


def waiting_queue(config: EngineConfig) -> WaitingQueue:
    """The scheduler's queue for `config.scheduling`; the fair share's margin is one step's tokens."""
    if config.scheduling == "fair":
        return FairQueue(margin=config.max_num_batched_tokens)
    return FcfsQueue()


class Engine:
    def __init__(self, executor: Executor, tokenizer, config: EngineConfig = EngineConfig(),
                 adapters: dict[str, str] | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.executor, self.tokenizer, self.config = executor, tokenizer, config
        model_config = executor.model_config
        self.vocab_size = model_config.vocab_size
        self.allocator = PageAllocator(executor.num_pages, config.page_size, config.prefix_caching)
        self.max_model_len = context_limit(model_config, config, executor.num_pages)
        eos = set(eos_token_ids) | set(model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
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
                                   ready=partial(adapter_ready, self.adapters),
                                   waiting=waiting_queue(config),
                                   eos_token_ids=frozenset(eos), max_model_len=self.max_model_len,
                                   latency=(LatencyBudget.of_executor(config.max_itl_ratio, executor)
                                            if config.max_itl_ratio else None))
        if self.scheduler.latency is not None and config.chunked_prefill:
            calibrate(executor, self.scheduler.latency,
                      shapes(config.max_batch_size, config.max_num_batched_tokens, self.scheduler.latency.min_chunk,
                             executor.num_pages, config.page_size, self.max_model_len), config.page_size)
        self.core = EngineCore(executor, self.scheduler, self.adapters, config, tokenizer, frozenset(eos))
        self.outputs = OutputProcessor(tokenizer, self.scheduler.stop)
        self._ids = itertools.count()
        self._num_constrained = 0

    @property
    def model_config(self) -> ModelConfig:
        """The whole model's (under tensor parallelism too): what an adapter must fit."""
        return self.executor.model_config

    @property
    def overlaps_steps(self) -> bool:
        return self.core.overlaps_steps

    @property
    def on_cpu(self) -> bool:
        """Whether the model runs on the CPU (where its adapters' pool is)."""
        return self.adapters.device.type == "cpu"

    @property
    def last_step(self) -> StepShape | None:
        """What the last `step` call launched; None if nothing."""
        return self.core.last_step

    @property
    def requests(self) -> dict[str, Request]:
        """Every request not finished, by id."""
        return self.scheduler.requests

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

    def adapter_snapshot(self) -> dict:
        """Where the adapters are (GPU, host, disk) and their load counters (AdapterManager.snapshot)."""
        return self.adapters.snapshot()

    def held_adapters(self) -> list[str]:
        """The adapters held on the GPU or loading (AdapterManager.held)."""
        return self.adapters.held()

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
                          queued_residency=self.adapters.residency(adapter), matcher=matcher,
                          num_prompt_logprobs=int(params.prompt_logprobs is not None))
        self.outputs.add(request)
        self.core.add(request)
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars; ValueError for an engine without a tokenizer."""
        return self.core.grammars

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return self.outputs.process([RequestUpdate(request)])[0]

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
        if self.core.has_grammars:
            self.grammars.pool.close()

    def running_request_ids(self) -> list[str]:
        return [r.request_id for r in self.scheduler.running]

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    @property
    def has_step_in_flight(self) -> bool:
        """A step has been launched whose outputs the next `step` returns."""
        return self.core.in_flight is not None

    def requests_in_flight(self) -> list[Request]:
        """The requests of the step in flight, in the order of its sampling rows (the rows whose
        sampled tokens a next step's decodes read on the device); empty when no step is in flight.
        The list is a copy: changing it changes nothing in the engine."""
        return list(self.core.in_flight.requests) if self.core.in_flight is not None else []

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_pages=self.allocator.num_pages, num_kv_pages_used=self.allocator.num_used,
            num_adapter_slots=self.adapters.pool.max_loras, num_adapter_slots_used=len(self.adapters.resident),
            num_adapter_slots_held=len(self.adapters.refs),
            num_preemptions=self.scheduler.num_preemptions, num_constrained_requests=self._num_constrained,
            grammar_compile_seconds=self.grammars.pool.compile_seconds if self.core.has_grammars else 0.0,
            num_kv_pages_cached=self.allocator.num_cached, num_chunked_steps=self.scheduler.num_chunked_steps,
            prefix_cache={name: replace(counts) for name, counts in self.scheduler.prefix_cache.items()},
            tenants=self.scheduler.tenant_stats())

    # the step loop ---------------------------------------------------------------------------
    def steps(self) -> Iterator[list[RequestOutput]]:
        """Step until no request is left, yielding each step's outputs."""
        while self.has_unfinished():
            yield self.step()

    def step(self) -> list[RequestOutput]:
        """One step of the core (punica.engine.core.EngineCore.step), its updates made outputs."""
        return self.outputs.process(self.core.step())
