"""One GPU's (or one tensor-parallel group's) engine, as a cluster worker: it hands preempted
requests back to the cluster scheduler instead of requeueing them locally, and resumes requests
that already have output (Engine.add_request with output_token_ids, Engine.take_preempted).

Resuming recomputes prompt + generated tokens with the same SamplingParams; seeded sampling
is keyed by position and penalties see the same output tokens, so a migrated request produces
exactly the tokens it would have produced where it started.

A request with structured_outputs (its grammar checked and compiled on the driver already, within
the same limits) waits outside the engine while this worker compiles its grammar on the engine's
GrammarPool threads, off the thread that calls `step`; the first step after the compile adds it.
A compiled grammar is not sent from the driver: xgrammar serializes one far slower than it compiles
it (punica.engine.grammar_pool).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from punica.config import EngineArgs, ModelConfig
from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.stats import EngineStats
from punica.engine.tenancy import TenantShare

# a step with nothing to run but requests waiting for their grammars waits this long for one of them
GRAMMAR_WAIT_S = 0.05


@dataclass(frozen=True)
class WorkerInfo:
    kv_tokens: int
    max_batch_size: int
    max_model_len: int
    model_config: ModelConfig   # what an adapter must fit (the driver checks adapters against it)
    max_lora_rank: int          # the rank it must fit
    adapter_dirs: tuple[str, ...]  # an adapter inside one reads only files inside it
    num_adapter_slots: int      # its adapter pool's (--max-loras, or fewer under --max-lora-bytes)


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    evicted: list[tuple[str, list[int]]]   # (request_id, output_token_ids) handed back
    num_unfinished: int
    adapters: list[str]                    # held on the GPU or loading (AdapterManager.held)
    stats: EngineStats                     # after the step (the server's metrics sum the workers' totals)


@dataclass(frozen=True)
class _WaitingForGrammar:
    grammar: concurrent.futures.Future    # the compiled grammar, or the GrammarError
    add: Callable[..., str]               # Engine.add_request of the request, less grammar=
    prompt_token_ids: list[int]
    adapter: str | None
    output_token_ids: list[int]


class EngineWorker:
    """Runs one Engine (one process, or one tensor-parallel group); the Ray backend wraps this class as an actor."""

    def __init__(self, args: EngineArgs, adapters: dict[str, str]):
        import torch

        from punica.factory import build_engine, resolve_device

        if resolve_device(args.device) == "cpu":
            torch.set_num_threads(1)  # workers share the machine's cores
        self.engine = build_engine(dataclasses.replace(args, workers=0), adapters)
        self._grammars = self.engine.grammars.pool if self.engine.tokenizer is not None else None
        # threads that wait for compiles (each wait holds one; the compiles run on the pool's)
        self._grammar_waits = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="punica-grammar-wait")
        self._waiting: dict[str, _WaitingForGrammar] = {}

    def info(self) -> WorkerInfo:
        stats = self.engine.stats()
        config = self.engine.config
        return WorkerInfo(stats.num_kv_pages * config.page_size, config.max_batch_size, self.engine.max_model_len,
                          self.engine.model_config, config.max_lora_rank, config.adapter_dirs,
                          stats.num_adapter_slots)

    def adapters(self) -> dict[str, str]:
        """The adapters this worker serves: name -> directory."""
        return self.engine.adapter_paths()

    def adapter_residency(self) -> dict:
        """Where this worker's adapters are and their load counters (AdapterManager.snapshot)."""
        return self.engine.adapter_snapshot()

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Make the served adapters equal `adapters` (name -> directory): unload the others (as
        Engine.unload_adapter: running requests finish, queued ones fail), register the missing
        ones. Idempotent; the driver sends its whole set on every change and when a worker joins."""
        wanted = {name: Path(path) for name, path in adapters.items()}
        served = self.engine.adapter_paths()
        for name in [n for n, path in served.items() if wanted.get(n) != Path(path)]:
            self.engine.unload_adapter(name)
        for name, path in adapters.items():
            if not self.engine.has_adapter(name):
                self.engine.load_adapter(name, path)

    def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """The tenants' shares, as Engine.set_tenants."""
        self.engine.set_tenants(shares)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            adapter: str | None, output_token_ids: list[int], tenant: str | None = None,
            cache_salt: str | None = None) -> None:
        add = partial(self.engine.add_request, prompt_token_ids, params, adapter, request_id, output_token_ids,
                      tenant=tenant, cache_salt=cache_salt)
        if params.structured_outputs is None or self._grammars is None:
            add()
            return
        if request_id in self._waiting or request_id in self.engine.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = self._grammar_waits.submit(self._grammars.compile, params.structured_outputs)
        self._waiting[request_id] = _WaitingForGrammar(grammar, add, prompt_token_ids, adapter, output_token_ids)

    def step(self) -> StepResult:
        outputs = self._add_compiled()
        outputs += self.engine.step()
        evicted = self.engine.take_preempted()
        stats = self.engine.stats()
        return StepResult(outputs, evicted, stats.num_running + stats.num_waiting + len(self._waiting),
                          self.engine.held_adapters(), stats)

    def _add_compiled(self) -> list[RequestOutput]:
        """Add the requests whose grammars are compiled (after a short wait for one when the engine has
        nothing else to run); those the engine refuses end with finish_reason "error"."""
        if not self._waiting:
            return []
        if not self.engine.has_unfinished():
            concurrent.futures.wait([w.grammar for w in self._waiting.values()], timeout=GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        outputs = []
        for request_id, waiting in list(self._waiting.items()):
            if not waiting.grammar.done():
                continue
            del self._waiting[request_id]
            try:
                waiting.add(grammar=waiting.grammar.result())
            except ValueError as e:
                outputs.append(RequestOutput(request_id, None, waiting.prompt_token_ids, waiting.adapter,
                                             token_ids=list(waiting.output_token_ids), finished=True,
                                             finish_reason="error", error=str(e)))
        return outputs

    def release(self, request_ids: list[str]) -> list[tuple[str, list[int]]]:
        """Take requests out unfinished (the cluster evicts them): (request_id, output_token_ids);
        a token in flight is recomputed where they go."""
        taken = []
        for request_id in request_ids:
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None:
                taken.append((request_id, list(waiting.output_token_ids)))
                continue
            out = self.engine.abort(request_id)
            if out is not None:
                taken.append((request_id, out.token_ids))
        return taken

    def abort(self, request_id: str) -> None:
        if self._waiting.pop(request_id, None) is None:
            self.engine.abort(request_id)

    def close(self) -> None:
        self._grammar_waits.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
