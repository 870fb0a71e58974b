"""Cluster placement, migration and scale decisions (torch-free, pure bookkeeping).

A policy keeps the global view: which requests run on which GPU (in join order, so the last
is the newest), each GPU's batch size, and its KV use in tokens. Every running request grows
by one token per step of its GPU (`step`); when a GPU's KV use would pass its capacity, its
NEWEST request is evicted and queued again like a new request (keeping its arrival order), to
be resumed elsewhere by recomputing prompt + generated tokens. Waiting requests are placed in
strict arrival order (FCFS): the head waits until some GPU can take it.

`PunicaPolicy` puts a request on the GPU with the LARGEST batch still below the max batch
size that has KV room for it (ties: the lowest GPU id); `LeastLoadedPolicy` on the smallest
such batch; `RoundRobinPolicy` on the next GPU in id order that has room. GPUs are kept in
bisect-sorted lists per batch size, so a placement looks at `max_batch_size` lists and, within
one, only at GPUs that lack KV room.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from punica.config import EngineConfig

RequestId = Hashable  # the serving backend uses strings, the simulator ints


@dataclass(frozen=True)
class PolicyConfig:
    max_batch_size: int = EngineConfig.max_batch_size
    light_load_batch: int = EngineConfig.max_batch_size // 2  # a GPU whose batch is below this is lightly loaded
    idle_release_s: float = 60.0    # release a GPU idle for this long
    min_gpus: int = 1               # never release below this many GPUs

    def __post_init__(self):
        if self.max_batch_size < 1 or self.min_gpus < 0 or self.idle_release_s < 0:
            raise ValueError(f"invalid policy config {self}")
        if not 1 <= self.light_load_batch <= self.max_batch_size:
            raise ValueError(f"light_load_batch must be in [1, {self.max_batch_size}], got {self.light_load_batch}")


@dataclass(eq=False)
class GpuState:
    gpu_id: int
    kv_capacity: int                                        # tokens
    kv_used: int = 0
    num_steps: int = 0
    running: dict[RequestId, None] = field(default_factory=dict)  # join order: the last is the newest
    idle_since: float | None = 0.0

    @property
    def batch_size(self) -> int:
        return len(self.running)

    @property
    def kv_free(self) -> int:
        return self.kv_capacity - self.kv_used


@dataclass(eq=False)
class RequestState:
    request_id: RequestId
    seq: int                    # arrival order; kept when evicted, so FCFS survives migration
    num_tokens: int             # tokens (prompt + generated) when it was last placed or queued
    gpu_id: int | None = None
    joined_step: int = 0        # its GPU's num_steps when it joined


class ClusterPolicy:
    """Shared bookkeeping; subclasses choose a GPU in `_candidates`."""

    name = "base"

    def __init__(self, config: PolicyConfig = PolicyConfig(), sync: Callable[[int], None] | None = None):
        """`sync(gpu_id)` is called right before a GPU's KV use is read to place a request, so
        an owner that advances GPUs lazily (the simulator) can first report the steps they ran."""
        self.config = config
        self.sync = sync
        self.gpus: dict[int, GpuState] = {}
        self.requests: dict[RequestId, RequestState] = {}
        self._buckets: list[list[int]] = [[] for _ in range(config.max_batch_size)]  # batch size -> ids
        self._waiting: list[tuple[int, RequestId]] = []       # heap of (seq, request_id)
        self._idle: list[tuple[float, int]] = []        # heap of (idle_since, gpu_id), lazily pruned
        self._seq = itertools.count()
        self.num_evictions = 0

    # ---- GPUs -------------------------------------------------------------------------
    def add_gpu(self, gpu_id: int, kv_capacity: int, now: float = 0.0) -> None:
        if gpu_id in self.gpus:
            raise ValueError(f"GPU {gpu_id} is already in the cluster")
        gpu = self.gpus[gpu_id] = GpuState(gpu_id, kv_capacity, idle_since=now)
        self._enter(gpu)
        heapq.heappush(self._idle, (now, gpu_id))

    def remove_gpu(self, gpu_id: int) -> list[RequestId]:
        """Forget a GPU (released or failed); its requests wait to be placed again, oldest first."""
        gpu = self.gpus[gpu_id]
        self._leave(gpu)
        moved = list(gpu.running)
        for request_id in moved:
            self._requeue(gpu, request_id)
        del self.gpus[gpu_id]
        return moved

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request_id: RequestId, num_tokens: int) -> None:
        """Queue a new request whose prompt has `num_tokens` tokens."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already known")
        self.requests[request_id] = RequestState(request_id, next(self._seq), num_tokens)
        heapq.heappush(self._waiting, (self.requests[request_id].seq, request_id))

    def schedule(self, now: float = 0.0) -> list[tuple[RequestId, int]]:
        """Place waiting requests in arrival order until the head fits nowhere: [(request_id, gpu_id)]."""
        placed = []
        while self._waiting:
            request = self.requests[self._waiting[0][1]]
            gpu = self._choose(request.num_tokens)
            if gpu is None:
                break
            heapq.heappop(self._waiting)
            self._join(gpu, request)
            placed.append((request.request_id, gpu.gpu_id))
        return placed

    def step(self, gpu_id: int, num_steps: int = 1, now: float = 0.0) -> list[RequestId]:
        """Run `num_steps` steps on a GPU: each running request grows by one token per step.

        As in the engine, a step that lacks KV room for every request's next token first evicts
        the GPU's newest requests (they do not run that step and wait to be placed again).
        Returns the evicted requests, newest first."""
        gpu = self.gpus[gpu_id]
        evicted: list[RequestId] = []
        while num_steps > 0 and gpu.batch_size:
            fitting = min(num_steps, gpu.kv_free // gpu.batch_size)
            gpu.num_steps += fitting
            gpu.kv_used += fitting * gpu.batch_size
            num_steps -= fitting
            if num_steps:
                self._leave(gpu)
                while gpu.batch_size and gpu.kv_free < gpu.batch_size:
                    request_id = next(reversed(gpu.running))
                    self._requeue(gpu, request_id)
                    evicted.append(request_id)
                self._enter(gpu, now)
        gpu.num_steps += num_steps
        self.num_evictions += len(evicted)
        return evicted

    def evict(self, request_id: RequestId, num_tokens: int, now: float = 0.0) -> None:
        """The GPU evicted a request itself (its engine ran out of KV cache first): it waits
        to be placed again with `num_tokens` tokens (prompt + generated)."""
        request = self.requests[request_id]
        gpu = self.gpus[request.gpu_id]
        self._leave(gpu)
        self._requeue(gpu, request_id)
        self._enter(gpu, now)
        request.num_tokens = num_tokens
        self.num_evictions += 1

    def finish(self, request_id: RequestId, now: float = 0.0) -> None:
        """A request finished or was aborted, running or waiting."""
        request = self.requests.pop(request_id)
        if request.gpu_id is None:
            self._waiting.remove((request.seq, request_id))
            heapq.heapify(self._waiting)
            return
        gpu = self.gpus[request.gpu_id]
        self._leave(gpu)
        gpu.kv_used -= self.num_tokens(request_id, request)
        del gpu.running[request_id]
        self._enter(gpu, now)

    def num_tokens(self, request_id: RequestId, request: RequestState | None = None) -> int:
        """A request's tokens now: when placed plus one per step of its GPU since."""
        request = request or self.requests[request_id]
        if request.gpu_id is None:
            return request.num_tokens
        return request.num_tokens + self.gpus[request.gpu_id].num_steps - request.joined_step

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def waiting_ids(self) -> list[RequestId]:
        return [request_id for _, request_id in sorted(self._waiting)]

    # ---- scale decisions ----------------------------------------------------------------
    def needs_gpu(self) -> bool:
        """Requests wait and no GPU is lightly loaded: ask for one more GPU."""
        return bool(self._waiting) and not any(self._buckets[b] for b in range(self.config.light_load_batch))

    def release_idle(self, now: float) -> list[int]:
        """Remove and return GPUs idle for at least `idle_release_s` (keeping `min_gpus`)."""
        released = []
        while self._idle and len(self.gpus) > self.config.min_gpus:
            since, gpu_id = self._idle[0]
            gpu = self.gpus.get(gpu_id)
            if gpu is not None and gpu.idle_since == since and now - since < self.config.idle_release_s:
                break
            heapq.heappop(self._idle)
            if gpu is not None and gpu.idle_since == since:
                self.remove_gpu(gpu_id)
                released.append(gpu_id)
        return released

    # ---- internals ----------------------------------------------------------------------
    def _choose(self, num_tokens: int) -> GpuState | None:
        for gpu_id in self._candidates():
            if self.sync is not None:
                self.sync(gpu_id)
            gpu = self.gpus[gpu_id]
            if gpu.kv_free >= num_tokens:
                return gpu
        return None

    def _candidates(self) -> Iterator[int]:
        raise NotImplementedError

    def _join(self, gpu: GpuState, request: RequestState) -> None:
        self._leave(gpu)
        request.gpu_id, request.joined_step = gpu.gpu_id, gpu.num_steps
        gpu.running[request.request_id] = None
        gpu.kv_used += request.num_tokens
        gpu.idle_since = None
        self._enter(gpu)

    def _requeue(self, gpu: GpuState, request_id: RequestId) -> None:
        request = self.requests[request_id]
        request.num_tokens = self.num_tokens(request_id, request)
        gpu.kv_used -= request.num_tokens
        del gpu.running[request_id]
        request.gpu_id = None
        heapq.heappush(self._waiting, (request.seq, request_id))

    def _enter(self, gpu: GpuState, now: float | None = None) -> None:
        """File a GPU under its batch size (no list when full); note when it turned idle."""
        if gpu.batch_size < self.config.max_batch_size:
            bisect.insort(self._buckets[gpu.batch_size], gpu.gpu_id)
        if gpu.batch_size == 0 and gpu.idle_since is None and now is not None:
            gpu.idle_since = now
            heapq.heappush(self._idle, (now, gpu.gpu_id))

    def _leave(self, gpu: GpuState) -> None:
        if gpu.batch_size < self.config.max_batch_size:
            bucket = self._buckets[gpu.batch_size]
            del bucket[bisect.bisect_left(bucket, gpu.gpu_id)]


class PunicaPolicy(ClusterPolicy):
    """The busiest GPU that still has room: GPUs run full or idle, and idle ones can go."""

    name = "punica"

    def _candidates(self) -> Iterator[int]:
        for bucket in reversed(self._buckets):
            yield from bucket


class LeastLoadedPolicy(ClusterPolicy):
    name = "least-loaded"

    def _candidates(self) -> Iterator[int]:
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

    def _choose(self, num_tokens: int) -> GpuState | None:
        gpu = super()._choose(num_tokens)
        if gpu is not None:
            self._last = gpu.gpu_id
        return gpu

    def _candidates(self) -> Iterator[int]:
        start, num_open = bisect.bisect_right(self._open, self._last), len(self._open)
        for i in range(num_open):
            yield self._open[(start + i) % num_open]


POLICIES = {cls.name: cls for cls in (PunicaPolicy, LeastLoadedPolicy, RoundRobinPolicy)}
