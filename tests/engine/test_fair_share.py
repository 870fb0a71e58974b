"""Fair share across tenants at the level of the scheduler (torch-free): the Virtual Token Counter's
order of admission and preemption, the lift of a tenant back from idle, FCFS within a tenant, the
per-tenant caps, and a soak of random tenants' traffic that checks the scheduler's invariants. Places
taken in a full batch: test_fair_share_places."""

import itertools
import random

import pytest
from scheduler_steps import finish_step, run_step, schedule

from punica.engine.fair_share import FairQueue
from punica.engine.kv_cache import PageAllocator, namespace
from punica.engine.request import Request, Status
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler, is_decode
from punica.engine.tenancy import TenantLimitError, TenantShare
from punica.engine.waiting import FcfsQueue

NAMES = itertools.count()


def request(tenant, prompt_len=8, max_tokens=8, tokens=None):
    prompt = list(tokens) if tokens is not None else list(range(1, prompt_len + 1))
    return Request(f"{tenant}-{next(NAMES)}", prompt, SamplingParams(max_tokens=max_tokens), tenant=tenant)


def backlogged(sched, depths, num_steps):
    """Run `num_steps` steps keeping each tenant's queue `depths[tenant]` deep."""
    for _ in range(num_steps):
        for tenant, depth in depths.items():
            account = sched.waiting.tenants.get(tenant)
            for _ in range(depth - (account.num_waiting if account else 0)):
                sched.add(request(tenant))
        run_step(sched)


def test_backlogged_tenants_are_served_in_proportion_to_their_weights_whatever_they_send():
    queue = FairQueue()
    queue.set_shares({"heavy": TenantShare(weight=3.0)})
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=queue)
    backlogged(sched, {"flood": 100, "light": 10, "heavy": 10}, num_steps=600)  # more than a batch each
    served = {t: a.num_computed_tokens for t, a in queue.tenants.items()}
    assert served["heavy"] / served["light"] == pytest.approx(3, rel=0.1), served
    assert served["flood"] / served["light"] == pytest.approx(1, rel=0.1), served

    fcfs = Scheduler(PageAllocator(1000, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=FcfsQueue())
    backlogged(fcfs, {"flood": 100, "light": 10, "heavy": 10}, num_steps=600)
    served = {t: a.num_computed_tokens for t, a in fcfs.waiting.tenants.items()}
    assert served["flood"] > 8 * served["light"], "first come, first served: the flood takes the engine"


def test_a_tenant_back_from_idle_starts_from_the_least_active_service():
    queue = FairQueue()
    a, b, c = request("a"), request("b"), request("c")
    queue.add(a)
    queue.add(b)
    queue.charge(a, 100)
    queue.charge(b, 40)
    queue.add(c)
    assert queue.tenants["c"].service == 40
    queue.remove(c)
    queue.charge(b, 100)
    queue.add(again := request("c"))
    assert queue.tenants["c"].service == 100, "lifted again to the least service of a and b"
    queue.charge(again, 500)
    queue.remove(again)
    queue.add(request("c"))
    assert queue.tenants["c"].service == 600, "never lowered"
    for r in (list(queue)[2], a, b):                          # c's, a's, then b's
        queue.remove(r)
    queue.add(request("d"))
    assert queue.tenants["d"].service == 140, "none active: from the service of the last to go idle (b)"


def test_credit_banked_while_idle_does_not_let_a_returning_tenant_starve_the_others():
    queue = FairQueue()
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64, waiting=queue)
    backlogged(sched, {"a": 4, "b": 4}, num_steps=200)
    assert queue.tenants["a"].service > 500
    for _ in range(30):
        sched.add(request("late"))
    admitted = []
    for _ in range(80):
        for tenant in ("a", "b"):
            while queue.tenants[tenant].num_waiting < 4:
                sched.add(request(tenant))
        admitted += [r.tenant for r in run_step(sched).prefills if r.num_cached == len(r.prompt_token_ids)]
    assert len(admitted) >= 24
    assert min(admitted[:24].count(t) for t in ("a", "b", "late")) >= 6, admitted[:24]


def test_first_come_first_served_within_a_tenant_and_a_preempted_request_first_again():
    queue = FairQueue()
    a0, a1, a2, b0 = request("a"), request("a"), request("a"), request("b")
    for r in (a0, a1, a2, b0):
        queue.add(r)
    order = []
    while (r := queue.next_candidate(set(), set())) is not None:
        queue.admit(r)
        queue.charge(r, 10)
        order.append(r)
    assert order == [a0, b0, a1, a2]
    queue.preempted(a1)
    queue.add(a3 := request("a"))
    assert list(queue) == [a1, a3] and queue[0] is a1
    assert queue.next_candidate(set(), set()) is a1
    assert queue.next_candidate({a1}, set()) is a3, "a request waiting for its adapter is passed"
    assert queue.next_candidate(set(), {"a"}) is None, "a blocked tenant is passed whole"


@pytest.mark.parametrize("fair", [True, False])
def test_under_kv_pressure_the_tenant_served_most_loses_its_newest_request(fair):
    queue = FairQueue() if fair else FcfsQueue()
    queue.set_shares({"b": TenantShare(weight=4.0)})         # b's tokens count a quarter of a's
    sched = Scheduler(PageAllocator(4, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=queue)
    a0, b0 = request("a"), request("b")                       # 8 tokens: 2 pages each, the whole cache
    sched.add(a0)
    sched.add(b0)
    run_step(sched)                                           # a served 8, b 2: both decode, 9 tokens
    batch = run_step(sched)                                   # each needs a third page
    if fair:
        assert batch.preempted == [a0] and batch.decodes == [b0], "a was served more: its request goes"
    else:
        assert batch.preempted == [b0] and batch.decodes == [a0], "fcfs: the newest goes"


def test_max_concurrent_requests_counts_queued_and_running_requests_of_its_tenant():
    queue = FairQueue()
    queue.set_shares({"capped": TenantShare(max_concurrent_requests=2)})
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=1, max_num_batched_tokens=64, waiting=queue)
    first, second = request("capped"), request("capped")
    sched.add(first)
    sched.add(second)
    run_step(sched)
    assert first.status is Status.RUNNING and second.status is Status.WAITING
    with pytest.raises(TenantLimitError, match="'capped' already has 2 requests queued or running"):
        queue.check_room("capped")
    queue.check_room("other")
    queue.check_room(None)
    sched.finish(first, "abort")
    queue.check_room("capped")
    queue.set_shares({})
    sched.add(request("capped"))
    queue.check_room("capped")


def test_max_kv_tokens_makes_admission_wait_and_growth_preempt_the_tenants_own_newest():
    queue = FairQueue()
    queue.set_shares({"a": TenantShare(max_kv_tokens=19)})    # 4 pages of 4 tokens (whole pages)
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=queue)
    a0, a1, a2, b0 = request("a", 7), request("a", 6), request("a", 5), request("b", 8)
    for r in (a0, a1, a2, b0):
        sched.add(r)
    batch = run_step(sched)                                   # a0 and a1 hold 2 pages each: 4
    assert batch.prefills == [a0, b0, a1] and a2.status is Status.WAITING, "a2 waits, b0 (later) goes"
    assert sched.can_grow_running()
    batch = run_step(sched)                                   # 8 and 7 tokens: still 2 pages each
    assert batch.decodes == [b0, a0, a1] and not batch.preempted, "b was served least: ranked first"
    assert not sched.can_grow_running(), "the next step preempts (the engine must not run ahead of it)"
    batch = schedule(sched)                                   # a0 needs a 3rd page: a has none left
    assert batch.preempted == [a1] and batch.decodes == [b0, a0]
    assert queue.tenants["a"].num_running == 1 and a1.status is Status.WAITING and list(queue) == [a1, a2]

    alone = FairQueue()
    alone.set_shares({"a": TenantShare(max_kv_tokens=8)})
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=alone)
    sched.add(long := request("a", 30, max_tokens=20))
    while not long.finished:
        assert not run_step(sched).preempted
    assert len(long.output_token_ids) == 20, "a tenant's only request may outgrow its cap"


def test_set_shares_applies_to_queued_and_running_requests_and_unnamed_tenants_get_the_default():
    queue = FairQueue()
    queue.add(r := request("a"))
    queue.set_shares({"a": TenantShare(weight=2.0)})
    queue.charge(r, 10)
    assert queue.tenants["a"].service == 5
    queue.set_shares({"b": TenantShare(weight=2.0)})
    queue.charge(r, 10)
    assert queue.tenants["a"].service == 15


@pytest.mark.parametrize("share", [dict(weight=0), dict(weight=-1.0), dict(weight=float("inf")),
                                   dict(weight=float("nan")), dict(weight="2"), dict(weight=True),
                                   dict(max_concurrent_requests=0), dict(max_concurrent_requests=2.5),
                                   dict(max_kv_tokens=0), dict(max_kv_tokens=True)])
def test_a_share_that_cannot_be_is_refused_naming_its_field(share):
    with pytest.raises(ValueError, match=next(iter(share))):
        TenantShare(**share)


def test_fair_scheduling_soak_every_attended_token_holds_its_own_kv_caps_hold_and_nothing_starves():
    """Random traffic of five tenants (one flooding, weights, KV caps, shared system prompts, cache
    salts, random aborts) over a tiny cache with the prefix cache and chunked prefill: constant
    preemption. Every step checks the budget, that nothing scheduled is preempted, each capped
    tenant's pages, and that each request's cached tokens are slots holding its own namespace's KV."""
    rng = random.Random(1)
    page_size, num_pages, budget = 4, 40, 24
    queue = FairQueue()
    queue.set_shares({"flood": TenantShare(max_kv_tokens=96), "heavy": TenantShare(weight=3.0, max_kv_tokens=64),
                      "capped": TenantShare(max_kv_tokens=20)})
    alloc = PageAllocator(num_pages, page_size, prefix_caching=True)
    sched = Scheduler(alloc, max_batch_size=6, max_num_batched_tokens=budget, waiting=queue)
    system = [rng.randrange(50) for _ in range(9)]
    kv = {}                                                   # (page, offset) -> (namespace, token)
    live, num_finished = [], 0
    for step in itertools.count():
        assert step < 4000, "the queue drains once arrivals stop: nobody starves"
        if step >= 2000 and not sched.has_unfinished():
            break
        if step < 2000:
            for tenant, rate in (("flood", 0.3), ("heavy", 0.05), ("capped", 0.05), ("light", 0.03), (None, 0.03)):
                if rng.random() < rate:
                    tokens = system + [rng.randrange(50) for _ in range(rng.randint(1, 16))]
                    r = request(tenant, tokens=tokens, max_tokens=rng.randint(1, 24))
                    r.cache_salt = rng.choice([None, "s"])
                    live.append(r)
                    sched.add(r)
        batch = schedule(sched)
        assert sum(batch.num_scheduled[r] for r in batch.requests) <= budget
        assert all(is_decode(r) for r in batch.decodes)
        assert all(r.status is Status.RUNNING for r in batch.requests), "nothing scheduled was preempted"
        for tenant, cap in (("flood", 24), ("heavy", 16), ("capped", 5)):
            running = [r for r in sched.running if r.tenant == tenant]
            assert len(running) <= 1 or sum(len(r.pages) for r in running) <= cap, tenant
        for r in batch.requests:
            for pos in range(r.num_cached):
                assert kv[r.pages[pos // page_size], pos % page_size] == (namespace(r), r.token_ids[pos])
            for pos in range(r.num_cached, r.num_cached + batch.num_scheduled[r]):
                kv[r.pages[pos // page_size], pos % page_size] = (namespace(r), r.token_ids[pos])
        finish_step(sched, batch, lambda: rng.randrange(50))
        for r in list(live):
            if r.status is Status.RUNNING and rng.random() < 0.003:
                sched.finish(r, "abort")
            if r.finished:
                live.remove(r)
                num_finished += 1
    assert num_finished > 800 and sched.num_preemptions > 50 and sched.num_chunked_steps > 50
    assert sum(c.hit_tokens for c in sched.prefix_cache.values()) > 0
    assert alloc.num_used == 0 and alloc.num_free == num_pages
    stats = sched.tenant_stats()
    assert all(s.num_waiting == s.num_running == s.num_kv_tokens == 0 for s in stats.values())
    assert set(stats) == {"flood", "heavy", "capped", "light", None}
