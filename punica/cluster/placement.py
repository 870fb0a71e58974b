"""The placement rules: which GPUs a policy tries for a request, in order (torch-free).

`PunicaPolicy` puts a request on the GPU with the LARGEST batch still below the max batch
size that has KV room for it (ties: the lowest GPU id); `LeastLoadedPolicy` on the smallest
such batch; `RoundRobinPolicy` on the next GPU in id order that has room; `AdapterAwarePolicy`
first on a GPU that holds the request's adapter (resident or loading), then on the adapter's
rendezvous-hash home, while the least loaded GPUs drain (its docstring has the rule); with
`max_gpus_per_adapter`, a request whose adapter that many GPUs hold waits for room on one of
them, letting the requests behind it pass. Evicted (migrated)
requests are placed by the same rule, so they too prefer GPUs holding their adapter. GPUs are
kept in bisect-sorted lists per batch size, so a placement looks at `max_batch_size` lists and,
within one, only at GPUs that lack room.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Hashable, Iterator

from punica.cluster.policy import ClusterPolicy, GpuState, RequestState
from punica.cluster.policy_config import PolicyConfig


class PunicaPolicy(ClusterPolicy):
    """The busiest GPU that still has room: GPUs run full or idle, and idle ones can go."""

    name = "punica"

    def _candidates(self, request: RequestState) -> Iterator[int]:
        return self._busiest_first()


class AdapterAwarePolicy(ClusterPolicy):
    """Affinity placement: a request goes where its adapter is held, a miss to its adapter's
    home, while the least loaded GPUs drain so that they can be released.

    In order: (1) live holders with a batch below the reserve mark (`max_batch_size -
    RESERVED_SLOTS`), busiest first; (2) live holders above the mark; (3) the other live GPUs
    by rendezvous hash of (adapter, GPU), below the mark first, so that each adapter has one
    home and the homes partition the adapters (and the GPUs' host tiers); (4) Punica's rule over
    every GPU. The last slots of a nearly full GPU are thus kept for requests that have no holder
    with room to spare. Live: every GPU but the k least loaded, which drain (nothing prefers
    them, so they can go idle and be released), k = n - ceil(total batch / (DRAIN_FILL x
    max_batch_size)), at most n - `min_gpus`. With `max_gpus_per_adapter`, (3) and (4) stop
    once that many GPUs hold the adapter.

    A GPU is asked for as by Punica's rule while requests wait, and before any waits once the
    batches add up to SCALE_AHEAD_FILL of the cluster's and no GPU is lightly loaded: packing by adapter
    fills the holders of hot adapters, so a burst would otherwise queue for a whole GPU start-up."""

    name = "adapter-aware"
    RESERVED_SLOTS = 2
    DRAIN_FILL = 0.95
    SCALE_AHEAD_FILL = 0.98

    def __init__(self, config: PolicyConfig = PolicyConfig(), sync: Callable[[int], None] | None = None):
        super().__init__(config, sync)
        self._total_batch = 0

    def _candidates(self, request: RequestState) -> Iterator[int]:
        full = self.config.max_batch_size
        mark = full - self.RESERVED_SLOTS
        draining = self._draining()
        holders = self.holders.get(request.adapter, ()) if request.adapter is not None else ()
        yield from sorted((g for g in holders if g not in draining and self.gpus[g].batch_size < full),
                          key=lambda g: (self.gpus[g].batch_size >= mark, -self.gpus[g].batch_size, g))
        if self._held_back(request):
            return
        if request.adapter is not None:
            homes = (g for g, gpu in self.gpus.items()
                     if g not in draining and g not in holders and gpu.batch_size < full)
            yield from sorted(homes, key=lambda g: (self.gpus[g].batch_size >= mark, -rendezvous(request.adapter, g)))
        yield from self._busiest_first()

    def needs_gpu(self) -> bool:
        if self.num_waiting or self.config.scale_ahead:
            return super().needs_gpu()
        return self._total_batch >= self.SCALE_AHEAD_FILL * self.config.max_batch_size * len(self.gpus) \
            and not self._has_light_gpu()

    def _draining(self) -> set[int]:
        """The k least loaded GPUs (of equal batches, the highest ids), never more than could be
        released (down to `min_gpus`). They are found among the GPUs below max batch, which are
        at least k: the full ones alone need as many GPUs as there are of them."""
        num_needed = math.ceil(self._total_batch / (self.DRAIN_FILL * self.config.max_batch_size))
        num_draining = min(len(self.gpus) - num_needed, len(self.gpus) - self.config.min_gpus)
        draining: set[int] = set()
        for bucket in self._buckets:
            for gpu_id in reversed(bucket):
                if len(draining) >= num_draining:
                    return draining
                draining.add(gpu_id)
        return draining

    def _enter(self, gpu: GpuState, now: float | None = None) -> None:
        super()._enter(gpu, now)
        self._total_batch += gpu.batch_size

    def _leave(self, gpu: GpuState) -> None:
        super()._leave(gpu)
        self._total_batch -= gpu.batch_size

    def _held_back(self, request: RequestState) -> bool:
        cap = self.config.max_gpus_per_adapter
        return cap is not None and request.adapter is not None and len(self.holders.get(request.adapter, ())) >= cap


def rendezvous(adapter: Hashable, gpu_id: int) -> int:
    """The weight of `gpu_id` as a home of `adapter` (highest random weight hashing): the same in
    every process, so a driver restarted keeps each adapter's home."""
    digest = hashlib.blake2b(f"{adapter!r}/{gpu_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


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
