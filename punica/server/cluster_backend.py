"""The server's backend over several workers: the Punica cluster scheduler on Ray."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable

from punica.cluster.ray_backend import ClusterEngine
from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import TenantShare
from punica.server.residency import cluster_listing


class ClusterBackend:
    """The Backend (punica.server.backend) over a ClusterEngine. The served adapters are the
    cluster's: load and unload change them on every worker (see ClusterEngine.load_adapter for what
    a failing worker does). Every request's end goes to `on_finished` exactly once, as with
    AsyncEngine: its finished output as the stream passes it on, an abort when `abort` ends it, or
    an abort when its stream was left before it finished."""

    def __init__(self, cluster: ClusterEngine, on_finished: Callable[[RequestOutput], None] | None = None):
        self.cluster = cluster
        self.on_finished = on_finished

    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                       request_id: str, *, tenant: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        outputs = self.cluster.generate(prompt, params, adapter, request_id, tenant=tenant, cache_salt=cache_salt)
        finished = False
        try:
            async for out in outputs:
                if out.finished:
                    finished = True
                    if out.finish_reason != "abort":  # an abort is counted where it is made
                        self._finished(out)
                yield out
        finally:
            if not finished and request_id in self.cluster.requests:
                self._finished(RequestOutput(request_id, None, [], adapter, finished=True, finish_reason="abort",
                                             tenant=tenant))
            await outputs.aclose()  # aborts the request on its worker

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            self.on_finished(out)

    def check_room(self, tenant: str | None, adapter: str | None) -> None:
        self.cluster.check_room(tenant, adapter)

    async def abort(self, request_id: str) -> None:
        out = await self.cluster.abort(request_id)
        if out is not None:
            self._finished(out)

    @property
    def max_model_len(self) -> int:
        return self.cluster.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.cluster.model_config.vocab_size

    def has_adapter(self, name: str) -> bool:
        return name in self.cluster.adapters

    async def adapter_residency(self) -> dict:
        """Per worker: each places and evicts adapters on its own (one call to each, answered between its steps)."""
        workers = list(self.cluster.workers.items())
        snapshots = await asyncio.gather(*(actor.adapter_residency.remote() for _, actor in workers),
                                         return_exceptions=True)
        return cluster_listing(dict(self.cluster.adapters), {gpu_id: s for (gpu_id, _), s in zip(workers, snapshots)})

    def num_waiting(self) -> int:
        return self.cluster.num_waiting()

    async def load_adapter(self, name: str, path: str) -> None:
        """ValueError (a 400, no worker changed) for a broken adapter or a name in use;
        RuntimeError (a 500) naming the workers that failed, after a roll-back."""
        await self.cluster.load_adapter(name, path)

    async def unload_adapter(self, name: str) -> None:
        """ValueError (a 404) for an adapter not served; RuntimeError naming a failed worker."""
        await self.cluster.unload_adapter(name)

    async def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """On every worker, and on those that join later (ClusterEngine.set_tenants)."""
        await self.cluster.set_tenants(shares)

    def update_gauges(self, metrics) -> None:
        """The queue, and the counters of what the workers count (as their last steps reported it), with
        the time the driver spent compiling grammars to check them."""
        metrics.queue_length.set(self.cluster.policy.num_waiting)
        grammars = self.cluster.grammars
        metrics.update_totals(self.cluster.worker_stats.values(),
                              grammars.pool.compile_seconds if grammars is not None else 0.0)

    async def start(self) -> None:
        await self.cluster.start()

    async def shutdown(self) -> None:
        import ray

        await self.cluster.shutdown()
        ray.shutdown()


def start_ray() -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="warning", num_cpus=max(2, os.cpu_count() or 1))
