"""Fair share in a full batch (torch-free): which running request a waiting one takes the place of
(FairQueue.displaced, Scheduler._displace): by the tenants' shares of the places and by their
service, several in a step within its budget, never trading places back and forth, and never for
a request whose adapter is not on the GPU, whose tenant is at its max_kv_tokens, or whose last
token is not on the host yet."""

import pytest
from scheduler_steps import finish_step, run_step, schedule
from test_fair_share import request

from punica.engine.fair_share import FairQueue
from punica.engine.kv_cache import PageAllocator
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import SampledTokens
from punica.engine.tenancy import TenantShare
from punica.engine.waiting import FcfsQueue


def fill(sched, tenant, n, max_tokens=50):
    for _ in range(n):
        sched.add(request(tenant, max_tokens=max_tokens))
    run_step(sched)


@pytest.mark.parametrize("fair", [True, False])
def test_a_tenant_under_its_share_of_a_full_batch_takes_the_place_of_the_floods_newest(fair):
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64,
                      waiting=FairQueue() if fair else FcfsQueue())
    fill(sched, "flood", 6)
    flood = list(sched.running)
    assert len(flood) == 4
    sched.add(b := request("b"))
    batch = run_step(sched)
    if fair:
        assert batch.preempted == [flood[-1]] and batch.prefills == [b], "b's share is 2 of 4 places"
        assert sched.waiting[0] is flood[-1], "the preempted request waits first of its tenant"
        sched.add(b1 := request("b"))
        assert run_step(sched).preempted == [flood[-2]] and b1 in sched.running
        sched.add(request("b"))
        batch = run_step(sched)
        assert batch.preempted == [] and len(sched.running) == 4, "b at its share: it waits its turn"
    else:
        assert batch.preempted == [] and b not in sched.running, "first come, first served: b waits"


def test_a_tenant_over_its_share_of_places_but_served_less_by_the_margin_takes_the_floods_place():
    """b already holds more than its share of the places (4 / 3 tenants), but the flood has had more
    service than b by over the margin: b's next request still takes the flood's newest place."""
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64,
                      waiting=FairQueue(margin=16))
    fill(sched, "c", 1, max_tokens=500)     # keeps the least service: b returns from idle at c's
    fill(sched, "flood", 6, max_tokens=500)
    for _ in range(20):
        run_step(sched)
    sched.add(b1 := request("b", max_tokens=500))
    assert run_step(sched).prefills == [b1]
    flood = [r for r in sched.running if r.tenant == "flood"]
    assert len(flood) == 2
    accounts = sched.waiting.tenants
    assert accounts["flood"].service > accounts["b"].service + 16
    sched.add(b2 := request("b", max_tokens=500))
    batch = run_step(sched)
    assert batch.preempted == [flood[-1]] and batch.prefills == [b2]


@pytest.mark.parametrize(("budget", "num_displaced"), [(64, 3), (20, 2)])
def test_several_waiting_tenants_take_places_in_one_step_while_their_prompts_fit_the_budget(budget, num_displaced):
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=budget, waiting=FairQueue())
    fill(sched, "flood", 6, max_tokens=500)
    while len(sched.running) < 4:
        run_step(sched)
    flood = list(sched.running)
    newcomers = [request(tenant) for tenant in "bcd"]
    for r in newcomers:
        sched.add(r)
    batch = run_step(sched)
    assert batch.preempted == flood[::-1][:num_displaced]
    assert batch.prefills == newcomers[:num_displaced]


def test_a_request_displaced_while_its_next_token_is_pending_waits_for_its_value():
    """Steps overlap: the next step is planned before the last one's tokens reach the host. A
    running request displaced then holds a PENDING token; it is recomputed from its tokens, so it
    is not admitted again before their values are known (here b's adapter cannot be taken, which
    leaves its place free in that plan)."""
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64, waiting=FairQueue(),
                      acquire=lambda r: r.tenant != "b")
    fill(sched, "flood", 4, max_tokens=50)
    in_flight = schedule(sched)
    sched.launched(in_flight.output)                    # every flood request's next token is PENDING
    victim = sched.running[-1]
    sched.add(request("b"))
    batch = schedule(sched)
    assert batch.preempted == [victim] and victim.num_pending == 1
    assert victim not in batch.requests and len(sched.running) == 3
    n = len(in_flight.output.sampling_rows)             # its tokens reach the host
    sched.update_from_output(in_flight.output, SampledTokens([7] * n, [True] * n, [None] * n, [[]] * n))
    finish_step(sched, batch)
    assert victim.num_pending == 0 and victim in schedule(sched).prefills


def test_tenants_within_a_place_of_their_share_never_trade_places():
    """Eight tenants, one request each, a batch of 4: each tenant's share is half a place, so the
    four waiting never displace the four running (no round robin by preemption)."""
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64, waiting=FairQueue())
    for tenant in "abcdefgh":
        sched.add(request(tenant, max_tokens=20))
    preempted = []
    while sched.has_unfinished():
        preempted += run_step(sched).preempted
    assert preempted == []


def test_two_backlogged_tenants_settle_at_equal_places_and_stop_preempting():
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=8, max_num_batched_tokens=64, waiting=FairQueue())
    fill(sched, "a", 8, max_tokens=500)
    for tenant in "ab":
        for _ in range(4):
            sched.add(request(tenant, max_tokens=500))
    for _ in range(10):
        run_step(sched)
    running = [r.tenant for r in sched.running]
    assert running.count("a") == 4 and running.count("b") == 4 and sched.num_preemptions == 4
    for _ in range(300):
        run_step(sched)
    assert sched.num_preemptions == 4


def test_a_waiting_request_whose_adapter_is_not_on_the_gpu_displaces_nothing():
    loaded: set[str] = set()
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64, waiting=FairQueue(),
                      acquire=lambda r: r.tenant in loaded, ready=lambda r: r.tenant in loaded)
    loaded.add("flood")
    fill(sched, "flood", 4)
    sched.add(b := request("b"))
    assert run_step(sched).preempted == []
    loaded.add("b")
    batch = run_step(sched)
    assert len(batch.preempted) == 1 and batch.prefills == [b]


def test_a_tenant_at_its_max_kv_tokens_displaces_nothing():
    queue = FairQueue()
    queue.set_shares({"b": TenantShare(max_kv_tokens=16)})
    sched = Scheduler(PageAllocator(1000, 4), max_batch_size=4, max_num_batched_tokens=64, waiting=queue)
    fill(sched, "b", 1, max_tokens=100)                  # b's only request runs: 8 + 1 tokens, 3 pages
    fill(sched, "flood", 3)
    assert len(sched.running) == 4
    sched.add(request("b"))                               # 2 more pages would take b over 4
    assert run_step(sched).preempted == []
