"""One GPU's (or one tensor-parallel group's) engine, as a cluster worker: it hands preempted
requests back to the cluster scheduler instead of requeueing them locally, and resumes requests
that already have output (Engine.add_request with output_token_ids, Engine.take_preempted).

Resuming recomputes prompt + generated tokens with the same SamplingParams; seeded sampling
is keyed by position and penalties see the same output tokens, so a migrated request produces
exactly the tokens it would have produced where it started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from punica.config import EngineArgs, ModelConfig
from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.stats import EngineStats
from punica.engine.tenancy import TenantShare


@dataclass(frozen=True)
class WorkerInfo:
    kv_tokens: int
    max_batch_size: int
    max_model_len: int
    model_config: ModelConfig   # what an adapter must fit (the driver checks adapters against it)


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    evicted: list[tuple[str, list[int]]]   # (request_id, output_token_ids) handed back
    num_unfinished: int
    adapters: list[str]                    # held on the GPU or loading (AdapterManager.held)
    stats: EngineStats                     # after the step (the server's metrics sum the workers' totals)


class EngineWorker:
    """Runs one Engine (one process, or one tensor-parallel group); the Ray backend wraps this class as an actor."""

    def __init__(self, args: EngineArgs, adapters: dict[str, str]):
        import torch

        from punica.factory import build_engine, resolve_device

        if resolve_device(args.device) == "cpu":
            torch.set_num_threads(1)  # workers share the machine's cores
        self.engine = build_engine(dataclasses.replace(args, workers=0), adapters)

    def info(self) -> WorkerInfo:
        stats = self.engine.stats()
        return WorkerInfo(stats.num_kv_pages * self.engine.config.page_size, self.engine.config.max_batch_size,
                          self.engine.max_model_len, self.engine.executor.model_config)

    def adapters(self) -> dict[str, str]:
        """The adapters this worker serves: name -> directory."""
        return self.engine.adapter_paths()

    def adapter_residency(self) -> dict:
        """Where this worker's adapters are and their load counters (AdapterManager.snapshot)."""
        return self.engine.adapters.snapshot()

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
        self.engine.add_request(prompt_token_ids, params, adapter, request_id, output_token_ids, tenant=tenant,
                                cache_salt=cache_salt)

    def step(self) -> StepResult:
        outputs = self.engine.step()
        evicted = self.engine.take_preempted()
        stats = self.engine.stats()
        return StepResult(outputs, evicted, stats.num_running + stats.num_waiting, self.engine.adapters.held(), stats)

    def release(self, request_ids: list[str]) -> list[tuple[str, list[int]]]:
        """Take requests out unfinished (the cluster evicts them): (request_id, output_token_ids);
        a token in flight is recomputed where they go."""
        taken = []
        for request_id in request_ids:
            out = self.engine.abort(request_id)
            if out is not None:
                taken.append((request_id, out.token_ids))
        return taken

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def close(self) -> None:
        self.engine.close()
