"""The placement rules: which GPUs a policy tries for a request, in order (torch-free).

`PunicaPolicy` puts a request on the GPU with the LARGEST batch still below the max batch
size that has KV room for it (ties: the lowest GPU id); `LeastLoadedPolicy` on the smallest
such batch; `RoundRobinPolicy` on the next GPU in id order that has room; `AdapterAwarePolicy`
first on a GPU that holds the request's adapter (resident or loading; busiest first), then by
Punica's rule while the adapter is held by fewer than `max_gpus_per_adapter` GPUs (else it
waits for room on one that holds it, letting the requests behind it pass). Evicted (migrated)
requests are placed by the same rule, so they too prefer GPUs holding their adapter. GPUs are
kept in bisect-sorted lists per batch size, so a placement looks at `max_batch_size` lists and,
within one, only at GPUs that lack room.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from punica.cluster.policy import ClusterPolicy, GpuState, PolicyConfig, RequestState


class PunicaPolicy(ClusterPolicy):
    """The busiest GPU that still has room: GPUs run full or idle, and idle ones can go."""

    name = "punica"

    def _candidates(self, request: RequestState) -> Iterator[int]:
        return self._busiest_first()


class AdapterAwarePolicy(ClusterPolicy):
    """GPUs holding the request's adapter first (busiest first), then Punica's rule while the
    adapter is spread over fewer than `max_gpus_per_adapter` GPUs."""

    name = "adapter-aware"

    def _candidates(self, request: RequestState) -> Iterator[int]:
        holders = self.holders.get(request.adapter, ()) if request.adapter is not None else ()
        full = self.config.max_batch_size
        yield from sorted((g for g in holders if self.gpus[g].batch_size < full),
                          key=lambda g: (-self.gpus[g].batch_size, g))
        if not self._held_back(request):
            yield from (g for g in self._busiest_first() if g not in holders)

    def _held_back(self, request: RequestState) -> bool:
        cap = self.config.max_gpus_per_adapter
        return cap is not None and request.adapter is not None and len(self.holders.get(request.adapter, ())) >= cap


class LeastLoadedPolicy(ClusterPolicy):
    name = "least-loaded"

    def _candidates(self, request: RequestState) -> Iterator[int]:
        for bucket in self._buckets:
            yield from bucket


class RoundRobinPolicy(ClusterPolicy):
    """The next GPU after the last one chosen, in id order, that has a free batch slot."""

    name = "round-robin"

    def __init__(self, config: PolicyConfig = PolicyConfig(), sync: Callable[[int], None] | None = None):
        super().__init__(config, sync)
        self._open: list[int] = []   # sorted ids of GPUs below max batch
        self._last = -1

    def _enter(self, gpu: GpuState, now: float | None = None) -> None:
        super()._enter(gpu, now)
        if gpu.batch_size < self.config.max_batch_size:
            bisect.insort(self._open, gpu.gpu_id)

    def _leave(self, gpu: GpuState) -> None:
        super()._leave(gpu)
        if gpu.batch_size < self.config.max_batch_size:
            del self._open[bisect.bisect_left(self._open, gpu.gpu_id)]

    def _choose(self, request: RequestState) -> GpuState | None:
        gpu = super()._choose(request)
        if gpu is not None:
            self._last = gpu.gpu_id
        return gpu

    def _candidates(self, request: RequestState) -> Iterator[int]:
        start, num_open = bisect.bisect_right(self._open, self._last), len(self._open)
        for i in range(num_open):
            yield self._open[(start + i) % num_open]


POLICIES = {cls.name: cls for cls in (PunicaPolicy, LeastLoadedPolicy, RoundRobinPolicy, AdapterAwarePolicy)}
