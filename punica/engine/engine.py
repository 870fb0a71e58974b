"""Engine: the step loop, schedule -> run -> postprocess.

`add_request` validates one request (a ValueError names what is wrong with it and nothing
else is disturbed), `step` runs one fused prefill+decode batch and returns what requests
produced, `abort` drops a request and frees its pages.

Steps overlap: step t+1 is scheduled and launched before step t's sampled tokens reach the
host. Its decode rows read those tokens on the device (ModelRunner's `fed` rows), and the host
reads step t's tokens while the device runs step t+1. So `step` returns the outputs of the step
launched before it, and a request that stops (EOS, stop token or string) has run one more row,
which is dropped. An engine does not run ahead when step t+1 depends on step t's values on the
host: a request with penalties (they read the output tokens), a request certain to finish by
length (it must leave the batch), or a preemption (the victim is recomputed from its tokens).
"""

from __future__ import annotations

import itertools
from functools import partial
import time
from operator import attrgetter
from dataclasses import dataclass, field

import torch

from punica.config import EngineConfig, ceil_div
from punica.engine.detokenizer import IncrementalDetokenizer
from punica.engine.kv_cache import PageAllocator
from punica.engine.request import PENDING, Request
from punica.engine.runner import ModelRunner, kv_bytes_per_token
from punica.engine.sampler import sample
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import ScheduledBatch, Scheduler
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool
from punica.models.llama import LlamaForCausalLM

CPU_KV_CACHE_BYTES = 1 << 30
by_slot = attrgetter("slot")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    new_text: str = ""                 # since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: str | None = None           # why the request failed (finish_reason "error")
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    num_preemptions: int = 0


def kv_cache_pages(model: LlamaForCausalLM, config: EngineConfig) -> int:
    """Pages from kv_cache_tokens, kv_cache_bytes, or the free-memory fraction (CUDA) / 1 GiB (CPU)."""
    if config.kv_cache_tokens is not None:
        return ceil_div(config.kv_cache_tokens, config.page_size)
    budget = config.kv_cache_bytes
    if budget is None:
        device = model.embed.weight.device
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_cache_memory_fraction)
        else:
            budget = CPU_KV_CACHE_BYTES
    return max(1, budget // (kv_bytes_per_token(model) * config.page_size))


def checked_prompt(prompt: str | list[int], tokenizer, max_model_len: int | None,
                   vocab_size: int | None = None) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt; ValueError if it is empty, too long or out of vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass prompt token ids")
        text, token_ids = prompt, tokenizer.encode(prompt)
    else:
        text, token_ids = None, list(prompt)
    if not token_ids:
        raise ValueError("the prompt is empty")
    if vocab_size is not None and any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if max_model_len is not None and len(token_ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; this model's context is "
                         f"{max_model_len} tokens, including at least one generated token")
    return text, token_ids


def acquire_adapter(adapters: AdapterManager, request: Request) -> bool:
    """Hold the request's adapter slot (True), or False while the adapter is being loaded."""
    if request.adapter is None:
        return True
    slot = adapters.acquire(request.adapter)
    if slot is None:
        return False
    request.slot = slot
    return True


def release_adapter(adapters: AdapterManager, request: Request) -> None:
    """Let go of the slot the request holds (it is that of the registration it was admitted on)."""
    if request.slot >= 0:
        adapters.release(request.slot)
        request.slot = -1


@dataclass
class LaunchedStep:
    """A step whose sampled tokens are on their way to the host."""
    requests: list[Request]
    tokens: torch.Tensor               # [N] int64 on the host once `copied` has completed
    logprobs: torch.Tensor | None      # [N] float32, likewise
    copied: torch.cuda.Event | None    # None when the step ran on the CPU

    def read(self) -> tuple[list[int], list[float | None]]:
        if self.copied is not None:
            self.copied.synchronize()
        logprobs = self.logprobs.tolist() if self.logprobs is not None else [None] * len(self.requests)
        return self.tokens.tolist(), logprobs


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor into pinned host memory, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class Engine:
    overlaps_steps = True  # schedule step t+1 before step t's tokens reach the host (module docstring)

    def __init__(self, model: LlamaForCausalLM, tokenizer, config: EngineConfig = EngineConfig(),
                 adapters: dict[str, str] | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        num_pages = kv_cache_pages(model, config)
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.max_model_len = min(config.max_model_len or model.config.max_position_embeddings,
                                 model.config.max_position_embeddings, num_pages * config.page_size)
        self.eos_token_ids = set(eos_token_ids) | set(model.config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        weight = model.embed.weight
        self.pool = LoraPool(model.config, config.max_loras, config.max_lora_rank, weight.dtype, weight.device)
        model.set_lora(self.pool)  # before the runner captures CUDA graphs that read the pool
        self.runner = ModelRunner(model, num_pages, config.page_size, config.max_batch_size, self.max_model_len,
                                  eager=config.enforce_eager)
        self.adapters = self._adapter_manager()
        for name, path in (adapters or {}).items():
            self.adapters.register(name, path)
        # bound to the manager, not to self: no reference cycle keeps a dropped engine's KV
        # cache alive until the garbage collector runs
        self.scheduler = Scheduler(self.allocator, config.max_batch_size, config.max_prefill_tokens,
                                   acquire=partial(acquire_adapter, self.adapters),
                                   release=partial(release_adapter, self.adapters))
        self.requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self._launched: LaunchedStep | None = None
        self._errors_seen, self._queued_unloadable = 0, False  # see _fail_unloadable

    def _adapter_manager(self) -> AdapterManager:
        """Reads adapters for the model and writes them into self.pool (tensor parallelism overrides it)."""
        return AdapterManager(self.model.config, self.pool, self.config.lora_host_bytes)

    def load_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Register an adapter at run time; it is read and copied to the GPU when first used."""
        self.adapters.register(name, path, pinned=pinned)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter. Requests already in the batch finish with it; queued requests
        for it fail with finish_reason "error"; its GPU slot is freed when the last one leaves."""
        self.adapters.unregister(name)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        text, token_ids = checked_prompt(prompt, self.tokenizer, self.max_model_len, self.model.config.vocab_size)
        if adapter is not None and adapter not in self.adapters.registry:
            raise ValueError(f"unknown adapter {adapter!r} ({len(self.adapters.registry)} adapters are registered)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, adapter=adapter, prompt=text)
        if adapter is not None and self.adapters.error(adapter):
            self._queued_unloadable = True  # it fails at the next step, as if queued earlier
        self.requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, "abort")
        return self._output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    @property
    def has_step_in_flight(self) -> bool:
        """A step has been launched whose outputs the next `step` returns."""
        return self._launched is not None

    def stalled(self, outputs: list[RequestOutput]) -> bool:
        """Whether the `step` that returned `outputs` did nothing (no output, no step in flight):
        every queued request waits for an adapter load, so a loop may sleep before the next step."""
        return not outputs and not self.has_step_in_flight

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def step(self) -> list[RequestOutput]:
        outputs = self._fail_unloadable()
        self.adapters.poll([r.adapter for r in self.scheduler.waiting if r.adapter is not None])
        if self._launched is not None and not self._may_run_ahead(self._launched):
            outputs += self._resolve(self._launched)
            self._launched = None
        batch = self.scheduler.schedule()
        previous = self._launched
        self._launched = self._launch(batch, previous) if batch else None
        if previous is not None:
            outputs += self._resolve(previous)
        if self._launched is not None and not self.overlaps_steps:
            outputs += self._resolve(self._launched)
            self._launched = None
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

    def _launch(self, batch: ScheduledBatch, previous: LaunchedStep | None) -> LaunchedStep:
        """Run the batch and sample on the device; each request gets a PENDING output token."""
        # requests of one adapter side by side form one LoRA segment
        prefills, decodes = sorted(batch.prefills, key=by_slot), sorted(batch.decodes, key=by_slot)
        fed = None
        if previous is not None:
            row_of = {request: row for row, request in enumerate(previous.requests)}
            fed = [row_of[r] if r.num_pending else -1 for r in decodes]
        logits = self.runner.run(prefills, decodes, fed)
        requests = prefills + decodes
        tokens, logprobs = sample(logits, requests)
        if self.overlaps_steps:
            self.runner.keep_sampled(tokens)
        copied = None
        if tokens.is_cuda:
            tokens, logprobs = to_host(tokens), logprobs if logprobs is None else to_host(logprobs)
            copied = torch.cuda.Event()
            copied.record()
        for request in requests:
            request.num_cached = request.num_tokens
            request.output_token_ids.append(PENDING)
            request.num_pending += 1
        return LaunchedStep(requests, tokens, logprobs, copied)

    def _resolve(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and hand them to its requests that are still running."""
        tokens, logprobs = launched.read()
        now = time.monotonic()
        return [self._append(r, t, lp, now) for r, t, lp in zip(launched.requests, tokens, logprobs)
                if not r.finished]

    def _fail_unloadable(self) -> list[RequestOutput]:
        """Finish queued requests whose adapter failed to load or was unloaded: a scan of the
        queue after a new failure or unload, or after such a request was queued."""
        if self.adapters.num_errors == self._errors_seen and not self._queued_unloadable:
            return []
        self._errors_seen, self._queued_unloadable = self.adapters.num_errors, False
        outputs = []
        for request in list(self.scheduler.waiting):
            error = request.adapter is not None and self.adapters.error(request.adapter)
            if error:
                self.scheduler.finish(request, "error")
                outputs.append(self._output(request, error=error))
        return outputs

    def _append(self, request: Request, token: int, logprob: float | None, now: float) -> RequestOutput:
        """Put the value of the request's oldest pending token, then stop it if it should."""
        num_out = len(request.output_token_ids) - request.num_pending + 1
        request.output_token_ids[num_out - 1] = token
        request.num_pending -= 1
        if request.params.logprobs:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        p = request.params
        detok = self._detokenizers.get(request.request_id)
        stopped_by_string = detok.add_token(token) if detok is not None else False
        reason = None
        if stopped_by_string or token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
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
        detok = self._detokenizers.get(request.request_id)
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
        output_token_ids = request.resolved_output_token_ids
        num_out = len(output_token_ids)
        ttft = tpot = None
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
            if finished and num_out > 1 and request.finish_time is not None:
                tpot = (request.finish_time - request.first_token_time) / (num_out - 1)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            adapter=request.adapter, text=detok.text if detok else "", token_ids=output_token_ids,
            logprobs=list(request.output_logprobs) if request.params.logprobs else None,
            new_text=detok.take_new_text(finished) if detok else "", new_token_ids=list(new_token_ids),
            finished=finished, finish_reason=request.finish_reason, error=error,
            time_to_first_token=ttft, time_per_output_token=tpot, num_preemptions=request.num_preemptions,
        )
