"""Tenants in the engine (fp32, CPU, tiny model): shares and caps given by set_tenants, per-tenant
stats, and fair admission across tenants."""

import pytest

from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import TenantLimitError, TenantShare

PROMPT = list(range(5, 29))  # 24 tokens: 6 pages of 4


def test_max_concurrent_requests_refuses_a_tenants_request_over_it_until_one_finishes(setup, make_engine):
    engine = make_engine(setup, max_batch_size=1, page_size=4)
    engine.set_tenants({"A": TenantShare(max_concurrent_requests=2), "a": TenantShare(max_concurrent_requests=1)})
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.add_request(PROMPT, params, tenant="A")
    engine.add_request(PROMPT, params, tenant="A")
    engine.step()                                            # one runs, one waits: both count
    with pytest.raises(TenantLimitError, match="tenant 'A' already has 2 requests queued or running"):
        engine.add_request(PROMPT, params, tenant="A")
    engine.add_request(PROMPT, params, tenant="B")
    engine.add_request(PROMPT, params, "a")                  # without a tenant, its adapter is its tenant
    with pytest.raises(TenantLimitError, match="tenant 'a'"):
        engine.add_request(PROMPT, params, "a")
    engine.add_request(PROMPT, params, "a", tenant="B")
    engine.abort(first)
    engine.add_request(PROMPT, params, tenant="A")
    assert engine.stats().tenants["A"].num_waiting + engine.stats().tenants["A"].num_running == 2
    for _ in engine.steps():
        pass
    stats = engine.stats().tenants
    assert set(stats) == {"A", "B", "a"}
    assert all(s.num_waiting == s.num_running == s.num_kv_tokens == 0 for s in stats.values())
    assert stats["B"].num_computed_tokens == 2 * (len(PROMPT) + 2), "prompts and decodes (a last token is not run)"
    assert stats["B"].service > stats["B"].num_computed_tokens, "lifted to A's service when it came"


def test_set_tenants_and_add_request_refuse_what_is_not_a_tenant(setup, make_engine):
    engine = make_engine(setup, page_size=4)
    with pytest.raises(TypeError, match="TenantShare"):
        engine.set_tenants({"A": {"weight": 2}})
    with pytest.raises(TypeError, match="TenantShare"):
        engine.set_tenants({None: TenantShare()})
    with pytest.raises(ValueError, match="tenant must be a string"):
        engine.add_request(PROMPT, tenant=7)
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        engine.add_request(PROMPT, cache_salt=b"salt")
    assert not engine.has_unfinished()


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_a_tenant_arriving_behind_a_flood_runs_next_only_under_fair_scheduling(setup, make_engine, scheduling):
    engine = make_engine(setup, max_batch_size=2, page_size=4, scheduling=scheduling)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(8):
        engine.add_request(PROMPT, params, tenant="flood")
    steady = engine.add_request(PROMPT, params, tenant="steady")
    engine.step()
    running = engine.running_request_ids()
    assert (steady in running) == (scheduling == "fair"), running
    for _ in engine.steps():
        pass


def test_a_tenant_over_its_max_kv_tokens_preempts_its_own_requests_and_outputs_do_not_change(setup, make_engine,
                                                                                           workload, greedy):
    """A request preempted for its tenant's cap is recomputed later from its prompt and tokens, and
    generates what it would have without the cap."""
    requests = [(prompt, adapter, max_tokens + 8) for prompt, adapter, max_tokens in workload(12, seed=3)]
    outputs = {}
    for capped in (False, True):
        engine = make_engine(setup, max_batch_size=8, page_size=4)
        if capped:
            engine.set_tenants({"A": TenantShare(max_kv_tokens=48)})
        ids = [engine.add_request(prompt, greedy(max_tokens), adapter, tenant="A")
               for prompt, adapter, max_tokens in requests]
        finished = {}
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
        outputs[capped] = [finished[i].token_ids for i in ids]
        assert (engine.stats().num_preemptions > 0) == capped
    assert outputs[True] == outputs[False]
