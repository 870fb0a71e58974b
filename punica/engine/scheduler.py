"""FCFS continuous-batching scheduler (torch-free).

Each step: every running request decodes one token (growing its pages; when pages run out
the NEWEST running request is preempted: its pages are freed and it goes back to the head of
the queue, to be recomputed later from prompt + generated tokens); then waiting requests are
admitted in arrival order while the batch has room, pages suffice and the step's prefill-token
budget lasts. A request whose adapter is not yet on the GPU (`acquire` says False) waits
where it is while requests behind it go ahead; otherwise admission never skips the head of the
queue, so nothing starves. `release` is called when an admitted request leaves the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledBatch:
    prefills: list[Request]   # run over all their uncached tokens
    decodes: list[Request]    # run one token each
    preempted: list[Request]  # sent back to the queue this step

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_prefill_tokens: int,
                 acquire: Callable[[Request], bool] = lambda request: True,
                 release: Callable[[Request], None] = lambda request: None):
        self.allocator = allocator
        self.acquire, self.release = acquire, release
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        preempted = self._grow_running()
        decodes = list(self.running)
        prefills = self._admit()
        return ScheduledBatch(prefills, decodes, preempted)

    def can_grow_running(self) -> bool:
        """Whether every running request can take its next token without a preemption."""
        needed = sum(self.allocator.pages_needed(r, r.num_tokens) for r in self.running)
        return needed <= self.allocator.num_free

    def _grow_running(self) -> list[Request]:
        preempted: list[Request] = []
        i = 0
        while i < len(self.running):
            request = self.running[i]
            if self.allocator.can_grow(request, request.num_tokens):
                self.allocator.grow(request, request.num_tokens)
                i += 1
                continue
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request)
        self.allocator.free(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        for request in list(self.waiting):
            if len(self.running) >= self.max_batch_size:
                break
            need = request.num_tokens
            if (admitted and need > budget) or not self.allocator.can_grow(request, need):
                break
            if not self.acquire(request):
                continue
            self.waiting.remove(request)
            self.allocator.grow(request, need)
            request.status = Status.RUNNING
            self.running.append(request)
            admitted.append(request)
            budget -= need
        return admitted

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished (or aborted) and release its pages, wherever it is."""
        if request in self.running:
            self.running.remove(request)
            self.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
