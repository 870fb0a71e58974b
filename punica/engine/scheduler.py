"""Continuous-batching scheduler (torch-free), with chunked prefill, prefix caching, and tenants.

The scheduler owns its requests' state. `schedule` plans a step (a frozen SchedulerOutput: which
requests run how many tokens, in the order of the step's rows); what the step did once launched, and
the ends of requests, are punica.engine.scheduler_results' (the Scheduler's other half).

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

With a latency budget (punica.engine.step_cost) and decodes running, the prompts' tokens are also
capped at what keeps the step's predicted time within `max_itl_ratio` of a decode-only step; the
engine reports each step's time (`observe`) to the model behind the prediction.

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
requests behind it go ahead, and so does one preempted while a launched step samples its next token
(PENDING): it is recomputed from its tokens, so it waits for their values, which the next plan has;
otherwise admission never skips the request the queue gives, so nothing starves. `release` is
called when an admitted request leaves the batch.

When the batch is full, waiting requests whose adapters are on the GPU (`ready`) may take running
requests' places, if the queue says so (`displaced`: for the fair share, a tenant under its share of
the batch's places or served less than the running request's tenant; FCFS never): those requests are
preempted before the step's decodes are planned, and the waiting ones admitted first, as many as the
step's budget holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from punica.config import ceil_div
from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status
from punica.engine.scheduler_output import SchedulerOutput
from punica.engine.scheduler_results import SchedulerResults
from punica.engine.step_cost import LatencyBudget, StepFeatures
from punica.engine.tenancy import TenantStats
from punica.engine.waiting import FcfsQueue, WaitingQueue, key_of


@dataclass
class PrefixCacheCounts:
    queried_tokens: int = 0   # tokens of admitted requests looked up in the prefix cache
    hit_tokens: int = 0       # of them, found there


def is_decode(request: Request) -> bool:
    return request.num_tokens - request.num_cached == 1


def by_slot(row: tuple[Request, int]) -> int:
    return row[0].slot


class Scheduler(SchedulerResults):
    def __init__(self, allocator: PageAllocator, max_batch_size: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True,
                 acquire: Callable[[Request], bool] = lambda request: True,
                 release: Callable[[Request], None] = lambda request: None,
                 ready: Callable[[Request], bool] = lambda request: True,
                 waiting: WaitingQueue | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 latency: LatencyBudget | None = None):
        self.allocator = allocator
        self.acquire, self.release, self.ready = acquire, release, ready
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.latency = latency  # with chunked prefill, sizes the prompt tokens beside decodes (step_cost)
        self.eos_token_ids = eos_token_ids  # end a request (unless it ignores EOS)
        self.max_model_len = max_model_len  # prompt + output tokens of a request at most (None: max_tokens only)
        self.waiting = waiting if waiting is not None else FcfsQueue()
        self.requests: dict[str, Request] = {}  # every request not finished, by id
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        self.num_chunked_steps = 0        # steps that ran a prompt chunk short of its prompt's end
        self.prefix_cache: dict[str | None, PrefixCacheCounts] = {}  # per adapter (None: base model)
        self._steps = itertools.count(1)
        self._planned: dict[int, tuple[Request, ...]] = {}  # the rows' requests of outputs not yet updated
        # during `schedule`: the running requests ranked (the last is preempted first), and the
        # pages each tenant's running requests hold
        self._ranked: list[Request] = []
        self._held: dict[str | None, int] = {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # planning a step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._held = {}
        for request in self.running:
            self.allocator.cache_full_pages(request)
            self._held[key_of(request)] = self._held.get(key_of(request), 0) + len(request.pages)
        self._ranked = self.waiting.rank(self.running, self._held, self.allocator.page_size)
        preempted: list[Request] = []
        displacing = self._displace(preempted)
        decodes = [r for r in self._ranked if is_decode(r)]
        for request in decodes:
            if request.status is Status.RUNNING:  # not preempted by a decode ranked before it
                self._make_room(request, preempted)
        decodes = [r for r in decodes if r.status is Status.RUNNING]
        for request in decodes:
            self.waiting.charge(request, 1)
        prompts = [r for r in self._ranked if not is_decode(r)]
        budget = self._prompt_budget(decodes, prompts)
        prefills: list[tuple[Request, int]] = []
        for request in prompts:
            if budget == 0:
                break
            if request.status is Status.RUNNING and (chunk := self._grow_prompt(request, budget, preempted)):
                prefills.append((request, chunk))
                budget -= chunk
        prefills += self._admit(budget, displacing)
        if any(r.num_cached + chunk < r.num_tokens for r, chunk in prefills):
            self.num_chunked_steps += 1
        self._ranked, self._held = [], {}
        return self._output(sorted(prefills, key=by_slot), sorted(((r, 1) for r in decodes), key=by_slot), preempted)

    def _prompt_budget(self, decodes: list[Request], prompts: list[Request]) -> int:
        """The prompt tokens the step may compute beside its decodes: what they leave of the step's
        tokens, and with a latency budget and decodes running, no more than it allows for the first
        running prompt's next chunk (or a new prompt's first)."""
        if not self.chunked_prefill:
            return self.max_num_batched_tokens
        budget = max(0, self.max_num_batched_tokens - len(decodes))
        if self.latency is not None and decodes and (prompts or self.waiting):  # else no prompt can run
            position = next((r.num_cached for r in prompts if r.status is Status.RUNNING), 0)
            budget = min(budget, self.latency.prompt_tokens([r.num_cached for r in decodes], position))
        return budget

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        """A launched step took `seconds` (from its launch, or the step before it ending, to its tokens
        on the host): the latency budget's cost model learns from it."""
        if self.latency is not None:
            self.latency.observe(StepFeatures.of(output), seconds)

    def _output(self, prefills: list[tuple[Request, int]], decodes: list[tuple[Request, int]],
                preempted: list[Request]) -> SchedulerOutput:
        rows = prefills + decodes
        output = SchedulerOutput(
            step=next(self._steps), request_ids=tuple(r.request_id for r, _ in rows),
            num_computed=tuple(r.num_cached for r, _ in rows), num_scheduled=tuple(n for _, n in rows),
            num_prefills=len(prefills),
            sampling_rows=tuple(row for row, (r, n) in enumerate(rows) if r.num_cached + n == r.num_tokens),
            preempted_ids=tuple(r.request_id for r in preempted))
        if rows:
            self._planned[output.step] = tuple(r for r, _ in rows)
        return output

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

    def may_run_ahead(self, output: SchedulerOutput) -> bool:
        """Whether the next step can be planned before the tokens `output` sampled are on the host:
        not when one of its requests reads its output tokens to sample (penalties) or is certain to
        end by length (it must leave the batch), nor when a running decode would need a preemption
        (the victim is recomputed from its tokens)."""
        rows = self.requests_of(output)
        for request in (rows[row] for row in output.sampling_rows):
            if not request.finished and (request.params.uses_penalties
                                         or self.ends_by_length(request, len(request.output_token_ids))):
                return False
        return self.can_grow_running()

    def _displace(self, preempted: list[Request]) -> list[Request]:
        """In a full batch, the waiting requests, in the queue's order, that take running requests'
        places (`displaced`), each with its adapter on the GPU (`ready`) and its tenant under its
        max_kv_tokens: those running requests are preempted, and the waiting ones returned, to be
        admitted first in this step. Places are taken while the waiting ones' tokens fit in the
        step's budget (the first always), so that no request is preempted for a place that stays
        empty."""
        displacing: list[Request] = []
        num_tokens = 0
        passed: set[Request] = set()
        blocked: set[str | None] = set()  # tenants whose requests take no place
        while (len(self.running) + len(displacing) >= self.max_batch_size
               and (candidate := self.waiting.next_candidate(passed, blocked)) is not None):
            passed.add(candidate)
            if candidate.num_pending or not self.ready(candidate):
                continue
            if displacing and num_tokens + candidate.num_tokens > self.max_num_batched_tokens:
                break
            max_pages = self._max_pages(candidate)
            at_cap = max_pages is not None and self._held.get(key_of(candidate), 0) + ceil_div(
                candidate.num_tokens, self.allocator.page_size) > max_pages
            victim = None if at_cap else self.waiting.displaced(candidate, self._ranked, self.max_batch_size)
            if victim is None:
                blocked.add(key_of(candidate))
                continue
            self._preempt(victim)
            preempted.append(victim)
            displacing.append(candidate)
            num_tokens += candidate.num_tokens
        return displacing

    def _make_room(self, request: Request, preempted: list[Request]) -> None:
        """Grow a decode by its next token, preempting the last ranked running requests (perhaps
        itself) until it fits."""
        while (victim := self._victim(request, request.num_tokens)) is not None:
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return
        self._grow(request, request.num_tokens)

    def _grow_prompt(self, request: Request, budget: int, preempted: list[Request]) -> int:
        """Grow a running prompt by its next chunk (at most `budget` tokens), preempting prompts
        ranked after it, never a decode, and shrinking the chunk to the pages left; the chunk, 0 if
        no page is left."""
        chunk = min(request.num_tokens - request.num_cached, budget)
        while (victim := self._victim(request, request.num_cached + chunk)) is not None:
            if victim is request or is_decode(victim):
                chunk = min(chunk, self._room(request) - request.num_cached)
                break
            self._preempt(victim)
            preempted.append(victim)
        if chunk <= 0:
            return 0
        self._grow(request, request.num_cached + chunk)
        self.waiting.charge(request, chunk)
        return chunk
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

    def _admit(self, budget: int, first: list[Request]) -> list[tuple[Request, int]]:
        """Admit waiting requests in the queue's order (those of `first` before all) while the batch has room,
        pages suffice and the budget lasts: (request, its first chunk) of each."""
        admitted: list[tuple[Request, int]] = []
        page_size = self.allocator.page_size
        passed: set[Request] = set()        # waiting for their adapter: those behind them go ahead
        blocked: set[str | None] = set()    # tenants at their max_kv_tokens: others go ahead
        while len(self.running) < self.max_batch_size and budget > 0:
            request = first.pop(0) if first else self.waiting.next_candidate(passed, blocked)
            if request is None:
                break
            if request.num_pending:  # preempted in this plan: its last token is not on the host yet
                passed.add(request)
                continue
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
            self.waiting.charge(request, chunk)
            request.status = Status.RUNNING
            self.running.append(request)
            self._ranked.append(request)
            admitted.append((request, chunk))
            budget -= chunk
        return admitted

    def tenant_stats(self) -> dict[str | None, TenantStats]:
        return self.waiting.stats(self.running, self.allocator.page_size)
