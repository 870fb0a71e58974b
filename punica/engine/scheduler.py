"""FCFS continuous-batching scheduler (torch-free), with chunked prefill and prefix caching.

Each step computes at most `max_num_batched_tokens` tokens. Running decodes come first, one
token each, growing their pages; when pages run out the NEWEST running request is preempted:
its pages are freed (its full pages stay in the prefix cache) and it goes back to the head of
the queue, to be recomputed later from prompt + generated tokens. Then prompts take what is left
of the budget, in admission order: first the prompts already running (a long prompt prefills
over several steps, one chunk a step, each chunk attending to the pages of the chunks before
it), then waiting requests, admitted in arrival order while the batch has room, pages suffice and
the budget lasts. A prompt chunk makes room by preempting newer prompts, never a decode, and
shrinks to the pages that are left: so only decodes ever preempt a decode.

Without chunked prefill a prompt runs whole in the step that admits it, and the budget counts
prompt tokens only (one longer prompt runs alone).

An admitted request first takes the longest cached prefix of its tokens (kv_cache: pages named
by adapter identity and content), which counts as computed; one still owed prompt logprobs takes
none (cached tokens have no logits): it counts as a lookup that found nothing.

A request whose adapter is not yet on the GPU (`acquire` says False) waits where it is while
requests behind it go ahead; otherwise admission never skips the head of the queue, so nothing
starves. `release` is called when an admitted request leaves the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from punica.config import ceil_div
from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledBatch:
    prefills: list[Request]   # run request.num_scheduled of their uncached tokens each
    decodes: list[Request]    # run one token each
    preempted: list[Request]  # sent back to the queue this step

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


@dataclass
class PrefixCacheCounts:
    queried_tokens: int = 0   # tokens of admitted requests looked up in the prefix cache
    hit_tokens: int = 0       # of them, found there


def is_decode(request: Request) -> bool:
    return request.num_tokens - request.num_cached == 1


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True,
                 acquire: Callable[[Request], bool] = lambda request: True,
                 release: Callable[[Request], None] = lambda request: None):
        self.allocator = allocator
        self.acquire, self.release = acquire, release
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.num_chunked_steps = 0        # steps that ran a prompt chunk short of its prompt's end
        self.prefix_cache: dict[str | None, PrefixCacheCounts] = {}  # per adapter (None: base model)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        for request in self.running:
            self.allocator.cache_full_pages(request)
        preempted: list[Request] = []
        decodes = [r for r in self.running if is_decode(r)]
        for request in decodes:
            if request.status is Status.RUNNING:  # not preempted by an older decode
                self._make_room(request, preempted)
        decodes = [r for r in decodes if r.status is Status.RUNNING]
        for request in decodes:
            request.num_scheduled = 1
        if self.chunked_prefill:
            budget = max(0, self.max_num_batched_tokens - len(decodes))
        else:
            budget = self.max_num_batched_tokens
        prefills = []
        for request in [r for r in self.running if not is_decode(r)]:
            if budget == 0:
                break
            if request.status is Status.RUNNING and self._grow_prompt(request, budget, preempted):
                prefills.append(request)
                budget -= request.num_scheduled
        prefills += self._admit(budget)
        if any(r.num_cached + r.num_scheduled < r.num_tokens for r in prefills):
            self.num_chunked_steps += 1
        return ScheduledBatch(prefills, decodes, preempted)

    def can_grow_running(self) -> bool:
        """Whether every running decode can take its next token without a preemption."""
        needed = sum(self.allocator.pages_needed(r, r.num_tokens) for r in self.running if is_decode(r))
        return needed <= self.allocator.num_free

    def _make_room(self, request: Request, preempted: list[Request]) -> None:
        """Grow a decode by its next token, preempting the newest running requests (perhaps itself)
        until it fits."""
        while not self.allocator.can_grow(request, request.num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return
        self.allocator.grow(request, request.num_tokens)

    def _grow_prompt(self, request: Request, budget: int, preempted: list[Request]) -> bool:
        """Grow a running prompt by its next chunk (at most `budget` tokens), preempting newer
        prompts, never a decode, and shrinking the chunk to the pages left; False if none is left."""
        chunk = min(request.num_tokens - request.num_cached, budget)
        while not self.allocator.can_grow(request, request.num_cached + chunk):
            victim = self.running[-1]
            if victim is request or is_decode(victim):
                room = (len(request.pages) + self.allocator.num_free) * self.allocator.page_size
                chunk = min(chunk, room - request.num_cached)
                break
            self._preempt(victim)
            preempted.append(victim)
        if chunk <= 0:
            return False
        self.allocator.grow(request, request.num_cached + chunk)
        request.num_scheduled = chunk
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.release(request)
        self.allocator.free(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, budget: int) -> list[Request]:
        admitted: list[Request] = []
        page_size = self.allocator.page_size
        for request in list(self.waiting):
            if len(self.running) >= self.max_batch_size or budget <= 0:
                break
            # cached tokens have no logits: a request still owed prompt logprobs computes its prompt
            hit = [] if request.needs_prompt_logprobs else self.allocator.match(request)
            computed = len(hit) * page_size
            chunk = request.num_tokens - computed
            if self.chunked_prefill:
                chunk = min(chunk, budget)
            elif admitted and chunk > budget:
                break
            pages = ceil_div(computed + chunk, page_size) - len(hit)
            if pages > self.allocator.num_free_after(hit):
                break
            if not self.acquire(request):
                continue
            self.waiting.remove(request)
            self.allocator.take(request, hit)
            self.allocator.grow(request, computed + chunk)
            counts = self.prefix_cache.setdefault(request.adapter, PrefixCacheCounts())
            counts.queried_tokens += request.num_tokens
            counts.hit_tokens += computed
            if not request.num_preemptions:
                request.num_cached_prompt_tokens = computed
            request.num_scheduled = chunk
            request.status = Status.RUNNING
            self.running.append(request)
            admitted.append(request)
            budget -= chunk
        return admitted

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished (or aborted) and release its pages, wherever it is; the KV of a request
        that failed stays out of the prefix cache."""
        if request in self.running:
            self.running.remove(request)
            self.release(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request, cache=reason != "error")
        request.status = Status.FINISHED
        request.finish_reason = reason
