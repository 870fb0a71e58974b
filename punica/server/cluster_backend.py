"""The server's backend over several workers: the Punica cluster scheduler on Ray."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from punica.cluster.ray_backend import ClusterEngine
from punica.engine.engine import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.server.protocol import ProtocolError


class ClusterBackend:
    """Same methods as AsyncEngine; adapters are fixed when the workers start."""

    def __init__(self, cluster: ClusterEngine, adapters: dict[str, str]):
        self.cluster, self.adapters = cluster, dict(adapters)

    def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                 request_id: str) -> AsyncIterator[RequestOutput]:
        return self.cluster.generate(prompt, params, adapter, request_id)

    async def abort(self, request_id: str) -> None:
        await self.cluster.abort(request_id)

    @property
    def max_model_len(self) -> int:
        return self.cluster.max_model_len

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    async def adapter_paths(self) -> dict[str, str]:
        return dict(self.adapters)

    def num_waiting(self) -> int:
        return self.cluster.policy.num_waiting

    async def load_adapter(self, name: str, path: str) -> None:
        raise ProtocolError("loading adapters at run time is not supported with --workers")

    async def unload_adapter(self, name: str) -> None:
        raise ProtocolError("unloading adapters at run time is not supported with --workers")

    def update_gauges(self, metrics) -> None:
        metrics.queue_length.set(self.num_waiting())

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
