"""Continuous-batching scheduler (torch-free), with chunked prefill, prefix caching, and tenants.

Each step computes at most `max_num_batched_tokens` tokens. The running requests are first ranked
by the waiting queue (punica.engine.waiting: in admission order for `FcfsQueue`; for the fair share
of punica.engine.fair_share, by their tenants' service, least first): the rank says who keeps its
place, the last being preempted first. Running decodes come first, one token each in rank order,
growing their pages; when pages run out the LAST ranked running request is preempted: its pages are
freed (its full pages stay in the prefix cache) and it goes back to the head of its queue, to be
recomputed later from prompt + generated tokens. Then prompts take what is left of the budget: first
the prompts already running, in rank order (a long prompt prefills over several steps, one chunk a
step, each chunk attending to the pages of the chunks before it), then waiting requests, admitted
in the order the queue gives (`next_candidate`) while the batch has room, pages suffice and the
budget lasts. A prompt chunk makes room by preempting prompts ranked after it, never a decode, and
shrinks to the pages that are left: so only decodes ever preempt a decode. A request is only ever
preempted by one ranked before it, so nothing already scheduled in a step is preempted in it.

Without chunked prefill a prompt runs whole in the step that admits it, and the budget counts
prompt tokens only (one longer prompt runs alone).

An admitted request first takes the longest cached prefix of its tokens (kv_cache: pages named
by adapter identity, tenant, cache salt and content), which counts as computed; one still owed
prompt logprobs takes none (cached tokens have no logits): it counts as a lookup that found nothing.

A tenant's max_kv_tokens bounds the pages its running requests hold together, except that its only
running request may grow past it (so a request longer than the cap still runs): a request of a
tenant at its cap waits to be admitted (its tenant's later requests too) while others go ahead, and
a running request that would take its tenant over the cap preempts its tenant's last ranked request
(perhaps itself; a prompt chunk shrinks rather than preempt a decode). Each scheduled token is
charged to its tenant (the queue's service).

A request whose adapter is not yet on the GPU (`acquire` says False) waits where it is while
requests behind it go ahead; otherwise admission never skips the request the queue gives, so
nothing starves. `release` is called when an admitted request leaves the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from punica.config import ceil_div
from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status
from punica.engine.tenancy import TenantStats
from punica.engine.waiting import FcfsQueue, WaitingQueue, key_of


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
                 release: Callable[[Request], None] = lambda request: None,
                 waiting: WaitingQueue | None = None):
        self.allocator = allocator
        self.acquire, self.release = acquire, release
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting = waiting if waiting is not None else FcfsQueue()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.num_chunked_steps = 0        # steps that ran a prompt chunk short of its prompt's end
        self.prefix_cache: dict[str | None, PrefixCacheCounts] = {}  # per adapter (None: base model)
        # during `schedule`: the running requests ranked (the last is preempted first), and the
        # pages each tenant's running requests hold
        self._ranked: list[Request] = []
        self._held: dict[str | None, int] = {}

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._held = {}
        for request in self.running:
            self.allocator.cache_full_pages(request)
            self._held[key_of(request)] = self._held.get(key_of(request), 0) + len(request.pages)
        self._ranked = self.waiting.rank(self.running, self._held, self.allocator.page_size)
        preempted: list[Request] = []
        decodes = [r for r in self._ranked if is_decode(r)]
        for request in decodes:
            if request.status is Status.RUNNING:  # not preempted by a decode ranked before it
                self._make_room(request, preempted)
        decodes = [r for r in decodes if r.status is Status.RUNNING]
        for request in decodes:
            request.num_scheduled = 1
            self.waiting.charge(request, 1)
        if self.chunked_prefill:
            budget = max(0, self.max_num_batched_tokens - len(decodes))
        else:
            budget = self.max_num_batched_tokens
        prefills = []
        for request in [r for r in self._ranked if not is_decode(r)]:
            if budget == 0:
                break
            if request.status is Status.RUNNING and self._grow_prompt(request, budget, preempted):
                prefills.append(request)
                budget -= request.num_scheduled
        prefills += self._admit(budget)
        if any(r.num_cached + r.num_scheduled < r.num_tokens for r in prefills):
            self.num_chunked_steps += 1
        self._ranked, self._held = [], {}
        return ScheduledBatch(prefills, decodes, preempted)

    def can_grow_running(self) -> bool:
        """Whether every running decode can take its next token without a preemption, for want of
        pages or by its tenant's max_kv_tokens."""
        held: dict[str | None, int] = {}
        needed: dict[str | None, int] = {}
        for request in self.running:
            key = key_of(request)
            held[key] = held.get(key, 0) + len(request.pages)
            if is_decode(request):
                needed[key] = needed.get(key, 0) + self.allocator.pages_needed(request, request.num_tokens)
        if sum(needed.values()) > self.allocator.num_free:
            return False
        for key, num_pages in needed.items():
            max_pages = self.waiting.max_kv_pages(key, self.allocator.page_size)
            if (num_pages and max_pages is not None and self.waiting.tenants[key].num_running > 1
                    and held[key] + num_pages > max_pages):
                return False
        return True

    def _make_room(self, request: Request, preempted: list[Request]) -> None:
        """Grow a decode by its next token, preempting the last ranked running requests (perhaps
        itself) until it fits."""
        while (victim := self._victim(request, request.num_tokens)) is not None:
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return
        self._grow(request, request.num_tokens)

    def _grow_prompt(self, request: Request, budget: int, preempted: list[Request]) -> bool:
        """Grow a running prompt by its next chunk (at most `budget` tokens), preempting prompts
        ranked after it, never a decode, and shrinking the chunk to the pages left; False if none is left."""
        chunk = min(request.num_tokens - request.num_cached, budget)
        while (victim := self._victim(request, request.num_cached + chunk)) is not None:
            if victim is request or is_decode(victim):
                chunk = min(chunk, self._room(request) - request.num_cached)
                break
            self._preempt(victim)
            preempted.append(victim)
        if chunk <= 0:
            return False
        self._grow(request, request.num_cached + chunk)
        request.num_scheduled = chunk
        self.waiting.charge(request, chunk)
        return True

    def _victim(self, request: Request, num_tokens: int) -> Request | None:
        """The running request to preempt before `request` may hold `num_tokens` tokens, None if it
        may: its tenant's last ranked when the tenant would go over its max_kv_tokens, else the last
        ranked when the cache is out of pages."""
        key = key_of(request)
        max_pages = self._max_pages(request)
        if max_pages is not None and self._held[key] + self.allocator.pages_needed(request, num_tokens) > max_pages:
            return next(r for r in reversed(self._ranked) if key_of(r) == key)
        if not self.allocator.can_grow(request, num_tokens):
            return self._ranked[-1]
        return None

    def _max_pages(self, request: Request) -> int | None:
        """The pages its tenant's running requests may hold together; None when there is no cap or
        it is its tenant's only request in (or entering) the batch."""
        account = self.waiting.tenants[key_of(request)]
        if account.num_running - (request.status is Status.RUNNING) == 0:
            return None
        return self.waiting.max_kv_pages(key_of(request), self.allocator.page_size)

    def _room(self, request: Request) -> int:
        """The tokens a running request can hold, without preempting anything."""
        pages = len(request.pages) + self.allocator.num_free
        max_pages = self._max_pages(request)
        if max_pages is not None:
            pages = min(pages, len(request.pages) + max_pages - self._held[key_of(request)])
        return pages * self.allocator.page_size

    def _grow(self, request: Request, num_tokens: int) -> None:
        num_pages = len(request.pages)
        self.allocator.grow(request, num_tokens)
        self._held[key_of(request)] += len(request.pages) - num_pages

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._ranked.remove(request)
        self._held[key_of(request)] -= len(request.pages)
        self.release(request)
        self.allocator.free(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.preempted(request)

    def _admit(self, budget: int) -> list[Request]:
        admitted: list[Request] = []
        page_size = self.allocator.page_size
        passed: set[Request] = set()        # waiting for their adapter: those behind them go ahead
        blocked: set[str | None] = set()    # tenants at their max_kv_tokens: others go ahead
        while len(self.running) < self.max_batch_size and budget > 0:
            request = self.waiting.next_candidate(passed, blocked)
            if request is None:
                break
            # cached tokens have no logits: a request still owed prompt logprobs computes its prompt
            hit = [] if request.needs_prompt_logprobs else self.allocator.match(request)
            computed = len(hit) * page_size
            chunk = request.num_tokens - computed
            if self.chunked_prefill:
                chunk = min(chunk, budget)
            elif admitted and chunk > budget:
                break
            key, num_pages = key_of(request), ceil_div(computed + chunk, page_size)
            max_pages = self._max_pages(request)
            if max_pages is not None and self._held.get(key, 0) + num_pages > max_pages:
                blocked.add(key)
                continue
            if num_pages - len(hit) > self.allocator.num_free_after(hit):
                break
            if not self.acquire(request):
                passed.add(request)
                continue
            self.waiting.admit(request)
            self.allocator.take(request, hit)
            self.allocator.grow(request, computed + chunk)
            self._held[key] = self._held.get(key, 0) + len(request.pages)
            counts = self.prefix_cache.setdefault(request.adapter, PrefixCacheCounts())
            counts.queried_tokens += request.num_tokens
            counts.hit_tokens += computed
            if not request.num_preemptions:
                request.num_cached_prompt_tokens = computed
            request.num_scheduled = chunk
            self.waiting.charge(request, chunk)
            request.status = Status.RUNNING
            self.running.append(request)
            self._ranked.append(request)
            admitted.append(request)
            budget -= chunk
        return admitted

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished (or aborted) and release its pages, wherever it is; the KV of a request
        that failed stays out of the prefix cache."""
        if request in self.running:
            self.running.remove(request)
            self.release(request)
            self.waiting.left_batch(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.allocator.free(request, cache=reason != "error")
        request.status = Status.FINISHED
        request.finish_reason = reason

    def tenant_stats(self) -> dict[str | None, TenantStats]:
        return self.waiting.stats(self.running, self.allocator.page_size)
