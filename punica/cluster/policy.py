"""Cluster placement, migration and scale decisions (torch-free, pure bookkeeping).

A policy keeps the global view: which requests run on which GPU (in join order, so the last
is the newest), each GPU's batch size, and its KV use in tokens. Every running request grows
by one token per step of its GPU (`step`); when a GPU's KV use would pass its capacity, its
NEWEST request is evicted and queued again like a new request (keeping its arrival order), to
be resumed elsewhere by recomputing prompt + generated tokens. Waiting requests are placed in
strict arrival order (FCFS): the head waits until some GPU can take it.

Adapters: each GPU holds up to `max_loras` adapters (LRU order; one a running request uses is
pinned), and a GPU with every slot pinned cannot take a request of another adapter. When the
policy `models_loads` (the simulator), placing a request whose adapter the GPU does not hold
starts a load (`started_loads`): the request holds its batch slot and prompt KV but waits, not
growing, until `adapter_loaded`; requests of an adapter being loaded wait for the same load. The
Ray backend's engines load adapters themselves: there the policy only follows what the workers
report as held (`set_adapters`).

The placement rules (`_candidates`) are punica.cluster.placement's.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from punica.cluster.policy_config import PolicyConfig

RequestId = Hashable  # the serving backend uses strings, the simulator ints


@dataclass(eq=False)
class GpuState:
    gpu_id: int
    kv_capacity: int                                        # tokens
    kv_used: int = 0
    num_steps: int = 0
    running: dict[RequestId, None] = field(default_factory=dict)  # join order: the last is the newest
    waiting_load: dict[RequestId, None] = field(default_factory=dict)  # placed, waiting for their adapter
    idle_since: float | None = 0.0
    adapters: dict[Hashable, int] = field(default_factory=dict)  # held (LRU first) -> requests using it
    loading: set[Hashable] = field(default_factory=set)
    num_pinned: int = 0                                     # adapters some request uses

    @property
    def batch_size(self) -> int:
        return len(self.running) + len(self.waiting_load)

    def has_adapter_room(self, adapter: Hashable | None, max_loras: int) -> bool:
        return adapter is None or adapter in self.adapters or len(self.adapters) < max_loras \
            or self.num_pinned < len(self.adapters)

    @property
    def kv_free(self) -> int:
        return self.kv_capacity - self.kv_used


@dataclass(eq=False)
class RequestState:
    request_id: RequestId
    seq: int                    # arrival order; kept when evicted, so FCFS survives migration
    num_tokens: int             # tokens (prompt + generated) when it was last placed or queued
    adapter: Hashable | None = None
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
        self._held: dict[Hashable, list[tuple[int, RequestId]]] = {}  # adapter -> heap of its held-back requests
        self._idle: list[tuple[float, int]] = []        # heap of (idle_since, gpu_id), lazily pruned
        self._seq = itertools.count()
        self.num_evictions = 0
        self.holders: dict[Hashable, set[int]] = {}     # adapter -> GPUs holding it
        self.started_loads: list[tuple[int, Hashable]] = []  # (gpu, adapter) loads to start; the owner drains it
        self.num_loads = 0

    # ---- GPUs -------------------------------------------------------------------------
    def limit_adapter_slots(self, num_slots: int) -> None:
        """A GPU holds at most `num_slots` adapters (a worker's pool, which --max-lora-bytes may make
        smaller than max_loras): max_loras is lowered to it, never raised."""
        if num_slots < self.config.max_loras:
            self.config = dataclasses.replace(self.config, max_loras=num_slots)

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
        moved = list(gpu.running) + list(gpu.waiting_load)
        for request_id in moved:
            self._requeue(gpu, request_id)
        for adapter in gpu.adapters:
            self._unhold(gpu_id, adapter)
        del self.gpus[gpu_id]
        return moved

    # ---- adapters -----------------------------------------------------------------------
    def set_adapters(self, gpu_id: int, adapters: list[Hashable]) -> None:
        """What a GPU's engine reports it holds (resident or loading, LRU first): adapters it no
        longer holds are forgotten unless a request placed there uses them."""
        gpu = self.gpus[gpu_id]
        for adapter in [a for a, refs in gpu.adapters.items() if not refs and a not in adapters]:
            del gpu.adapters[adapter]
            self._unhold(gpu_id, adapter)
        for adapter in adapters:
            if adapter not in gpu.adapters:
                gpu.adapters[adapter] = 0
                self.holders.setdefault(adapter, set()).add(gpu_id)
            else:
                gpu.adapters[adapter] = gpu.adapters.pop(adapter)  # move to the MRU end

    def adapter_loaded(self, gpu_id: int, adapter: Hashable) -> list[RequestId]:
        """A load `started_loads` asked for finished: its waiting requests start running (returned)."""
        gpu = self.gpus[gpu_id]
        gpu.loading.discard(adapter)
        ready = [r for r in gpu.waiting_load if self.requests[r].adapter == adapter]
        for request_id in ready:
            del gpu.waiting_load[request_id]
            gpu.running[request_id] = None
            self.requests[request_id].joined_step = gpu.num_steps
        return ready

    def is_loading(self, request_id: RequestId) -> bool:
        request = self.requests[request_id]
        return request.gpu_id is not None and request_id in self.gpus[request.gpu_id].waiting_load

    def _unhold(self, gpu_id: int, adapter: Hashable) -> None:
        holders = self.holders[adapter]
        holders.discard(gpu_id)
        if not holders:
            del self.holders[adapter]

    def _use_adapter(self, gpu: GpuState, adapter: Hashable) -> bool:
        """A request of `adapter` joins the GPU (which has room for it); whether it must wait for a load."""
        refs = gpu.adapters.pop(adapter, None)
        if refs is None:
            if len(gpu.adapters) >= self.config.max_loras:
                lru = next(a for a, r in gpu.adapters.items() if not r)
                del gpu.adapters[lru]
                self._unhold(gpu.gpu_id, lru)
            self.holders.setdefault(adapter, set()).add(gpu.gpu_id)
            self.num_loads += 1
            refs = 0
            if self.config.models_loads:
                gpu.loading.add(adapter)
                self.started_loads.append((gpu.gpu_id, adapter))
        gpu.adapters[adapter] = refs + 1
        gpu.num_pinned += refs == 0
        return adapter in gpu.loading

    def _release_adapter(self, gpu: GpuState, adapter: Hashable | None) -> None:
        if adapter is None or adapter not in gpu.adapters:
            return
        gpu.adapters[adapter] -= 1
        gpu.num_pinned -= gpu.adapters[adapter] == 0

    # ---- requests -----------------------------------------------------------------------
    def submit(self, request_id: RequestId, num_tokens: int, adapter: Hashable | None = None) -> None:
        """Queue a new request whose prompt has `num_tokens` tokens (and uses `adapter`, if any)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already known")
        self.requests[request_id] = RequestState(request_id, next(self._seq), num_tokens, adapter)
        heapq.heappush(self._waiting, (self.requests[request_id].seq, request_id))

    def schedule(self, now: float = 0.0) -> list[tuple[RequestId, int]]:
        """Place waiting requests in arrival order until the head fits nowhere: [(request_id, gpu_id)].

        A request held back by its placement rule alone (`_held_back`: its adapter's spread cap)
        waits apart, in a queue per adapter, without blocking those behind it: each schedule
        tries only the head of each such queue (on the GPUs its rule allows), so held-back
        requests cost one try per adapter, not one per request."""
        placed = []
        for adapter in list(self._held):
            queue = self._held[adapter]
            if not self._held_back(self.requests[queue[0][1]]):   # the adapter may spread again
                for entry in self._held.pop(adapter):
                    heapq.heappush(self._waiting, entry)
                continue
            while queue and (gpu := self._choose(self.requests[queue[0][1]])) is not None:
                request_id = heapq.heappop(queue)[1]
                self._join(gpu, self.requests[request_id])
                placed.append((request_id, gpu.gpu_id))
            if not queue:
                del self._held[adapter]
        while self._waiting:
            request = self.requests[self._waiting[0][1]]
            gpu = self._choose(request)
            if gpu is None:
                if not self._held_back(request):
                    break
                heapq.heappush(self._held.setdefault(request.adapter, []), heapq.heappop(self._waiting))
                continue
            heapq.heappop(self._waiting)
            self._join(gpu, request)
            placed.append((request.request_id, gpu.gpu_id))
        return placed

    def _held_back(self, request: RequestState) -> bool:
        return False

    def step(self, gpu_id: int, num_steps: int = 1, now: float = 0.0) -> list[RequestId]:
        """Run `num_steps` steps on a GPU: each running request grows by one token per step.

        As in the engine, a step that lacks KV room for every request's next token first evicts
        the GPU's newest requests (they do not run that step and wait to be placed again).
        Returns the evicted requests, newest first."""
        gpu = self.gpus[gpu_id]
        evicted: list[RequestId] = []
        while num_steps > 0 and gpu.running:
            fitting = min(num_steps, gpu.kv_free // len(gpu.running))
            gpu.num_steps += fitting
            gpu.kv_used += fitting * len(gpu.running)
            num_steps -= fitting
            if num_steps:
                self._leave(gpu)
                while gpu.running and gpu.kv_free < len(gpu.running):
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
            held = self._held.get(request.adapter, [])
            queue = held if (request.seq, request_id) in held else self._waiting
            queue.remove((request.seq, request_id))
            heapq.heapify(queue)
            if not held and request.adapter in self._held:
                del self._held[request.adapter]
            return
        gpu = self.gpus[request.gpu_id]
        self._leave(gpu)
        gpu.kv_used -= self.num_tokens(request_id, request)
        gpu.running.pop(request_id, None)
        gpu.waiting_load.pop(request_id, None)
        self._release_adapter(gpu, request.adapter)
        self._enter(gpu, now)

    def num_tokens(self, request_id: RequestId, request: RequestState | None = None) -> int:
        """A request's tokens now: when placed plus one per step of its GPU since."""
        request = request or self.requests[request_id]
        if request.gpu_id is None or request_id not in self.gpus[request.gpu_id].running:
            return request.num_tokens
        return request.num_tokens + self.gpus[request.gpu_id].num_steps - request.joined_step

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be placed, held back ones included."""
        return len(self._waiting) + sum(len(queue) for queue in self._held.values())

    @property
    def num_placeable_waiting(self) -> int:
        """Waiting requests that a new GPU could take (held-back ones wait for GPUs holding their adapter)."""
        return len(self._waiting)

    def waiting_ids(self) -> list[RequestId]:
        return [request_id for _, request_id in sorted(self._waiting + [e for q in self._held.values() for e in q])]

    # ---- scale decisions ----------------------------------------------------------------
    def needs_gpu(self) -> bool:
        """No GPU is lightly loaded and requests that a new GPU could take wait (`scale_ahead`:
        whether or not they do): ask for one more GPU. Lightly loaded: a batch below
        `light_load_batch` and, under KV-aware packing, KV use below the same fraction of
        `max_packed_kv_tokens`."""
        return bool(self._waiting or self.config.scale_ahead) and not self._has_light_gpu()

    def _has_light_gpu(self) -> bool:
        cap = self.config.max_packed_kv_tokens
        light_kv = None if cap is None else cap * self.config.light_load_batch / self.config.max_batch_size
        return any(light_kv is None or self.gpus[g].kv_used < light_kv
                   for b in range(self.config.light_load_batch) for g in self._buckets[b])

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
    def _choose(self, request: RequestState) -> GpuState | None:
        for gpu_id in self._candidates(request):
            gpu = self.gpus[gpu_id]
            if not gpu.has_adapter_room(request.adapter, self.config.max_loras):
                continue
            if self.sync is not None:
                self.sync(gpu_id)
            if gpu.kv_free >= request.num_tokens and self._packing_room(gpu, request):
                return gpu
        return None

    def _packing_room(self, gpu: GpuState, request: RequestState) -> bool:
        cap = self.config.max_packed_kv_tokens
        return cap is None or gpu.batch_size == 0 or gpu.kv_used + request.num_tokens <= cap

    def _candidates(self, request: RequestState) -> Iterator[int]:
        raise NotImplementedError

    def _busiest_first(self) -> Iterator[int]:
        for bucket in reversed(self._buckets):
            yield from bucket

    def _join(self, gpu: GpuState, request: RequestState) -> None:
        self._leave(gpu)
        request.gpu_id, request.joined_step = gpu.gpu_id, gpu.num_steps
        waits = request.adapter is not None and self._use_adapter(gpu, request.adapter)
        (gpu.waiting_load if waits else gpu.running)[request.request_id] = None
        gpu.kv_used += request.num_tokens
        gpu.idle_since = None
        self._enter(gpu)

    def _requeue(self, gpu: GpuState, request_id: RequestId) -> None:
        request = self.requests[request_id]
        request.num_tokens = self.num_tokens(request_id, request)
        gpu.kv_used -= request.num_tokens
        gpu.running.pop(request_id, None)
        gpu.waiting_load.pop(request_id, None)
        self._release_adapter(gpu, request.adapter)
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
