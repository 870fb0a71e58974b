"""Adapters in the policy: slots (LRU, pinned while used), loads a placed request waits for, the
adapter-aware rule (holders first, busiest first, the spread cap, migration), and what workers
report; and in the simulator, a request waits exactly its adapter's load time."""

import pytest

from punica.cluster.placement import AdapterAwarePolicy, PunicaPolicy, rendezvous
from punica.cluster.policy_config import PolicyConfig
from punica.cluster.simulator import SimConfig, Simulator, ideal_cache_loads
from punica.cluster.step_time import StepTimeModel
from punica.cluster.trace import Trace, fig13_trace


def cluster(policy_class=AdapterAwarePolicy, num_gpus=3, kv=100, **config):
    defaults = {"max_batch_size": 4, "light_load_batch": 2, "max_loras": 2, "models_loads": True}
    policy = policy_class(PolicyConfig(**(defaults | config)))
    for gpu_id in range(num_gpus):
        policy.add_gpu(gpu_id, kv)
    return policy


def place(policy, request_id, adapter, num_tokens=10):
    policy.submit(request_id, num_tokens, adapter)
    placed = policy.schedule()
    return placed[0][1] if placed else None


def test_a_placed_request_waits_for_its_adapter_and_does_not_grow_meanwhile():
    policy = cluster(PunicaPolicy)
    assert place(policy, "r0", "a") == 0
    assert policy.started_loads == [(0, "a")] and policy.is_loading("r0")
    assert place(policy, "r1", "a") == 0 and policy.started_loads == [(0, "a")]  # waits for the same load
    assert policy.step(0, 5) == [] and policy.num_tokens("r0") == 10 and policy.gpus[0].kv_used == 20
    assert sorted(policy.adapter_loaded(0, "a")) == ["r0", "r1"] and not policy.is_loading("r0")
    policy.step(0, 3)
    assert policy.num_tokens("r0") == 13 and policy.gpus[0].kv_used == 26


def test_slots_evict_the_lru_unused_adapter_and_a_gpu_with_every_slot_pinned_is_skipped():
    policy = cluster(PunicaPolicy, num_gpus=2, max_batch_size=8)
    for i, adapter in enumerate("ab"):
        place(policy, f"r{i}", adapter)
    assert place(policy, "r2", "c") == 1  # GPU 0's two slots are both in use
    policy.finish("r0")                    # "a" unused now: GPU 0 (the busier) evicts it for "d"
    assert place(policy, "r3", "d") == 0
    assert list(policy.gpus[0].adapters) == ["b", "d"] and policy.holders.get("a") is None
    assert policy.num_loads == 4


def test_a_workers_smaller_adapter_pool_lowers_the_slots_the_policy_counts_never_raises_them():
    policy = cluster(PunicaPolicy, num_gpus=2, max_batch_size=8, max_loras=3)
    policy.limit_adapter_slots(8)
    assert policy.config.max_loras == 3
    policy.limit_adapter_slots(1)           # a pool of one slot by its bytes
    assert policy.config.max_loras == 1
    place(policy, "r0", "a")
    assert place(policy, "r1", "b") == 1    # GPU 0's one slot is in use


def test_adapter_aware_prefers_a_gpu_holding_the_adapter_even_if_less_busy():
    aware, punica = cluster(min_gpus=4), cluster(PunicaPolicy)  # four GPUs kept: none drains
    for policy in (aware, punica):
        place(policy, "x0", "x")
        place(policy, "x1", "x")          # GPU 0: batch 2, adapter x
    for policy in (aware, punica):
        policy.add_gpu(9, 100)
        policy.set_adapters(9, ["a"])     # a worker reports holding "a"
    assert place(aware, "a0", "a") == 9   # holds "a", though GPU 0 is busier
    assert place(punica, "a0", "a") == 0  # busiest first, wherever the adapter is
    assert aware.num_loads == punica.num_loads - 1


def test_holders_fill_busiest_first_then_the_cap_makes_requests_wait_for_them():
    policy = cluster(num_gpus=3, max_gpus_per_adapter=2)
    assert [place(policy, f"h{i}", "hot") for i in range(4)] == [0, 0, 0, 0]  # batch 4: full
    assert place(policy, "h4", "hot") == 1                                   # a second GPU (under the cap)
    policy.adapter_loaded(0, "hot")
    policy.adapter_loaded(1, "hot")
    assert [place(policy, f"h{i}", "hot") for i in range(5, 8)] == [1, 1, 1]
    assert place(policy, "h8", "hot") is None                                # both holders full, cap 2
    assert place(policy, "cold", "c") == 2                                   # passes the held-back h8
    assert place(policy, "h9", "hot") is None and policy.waiting_ids() == ["h8", "h9"]
    policy.finish("h1")
    assert policy.schedule() == [("h8", 0)]
    assert policy.waiting_ids() == ["h9"]


def test_held_back_requests_ask_for_no_gpu_and_cost_one_try_per_adapter_and_schedule():
    policy = cluster(num_gpus=1, max_gpus_per_adapter=1, max_batch_size=2, light_load_batch=1)
    assert [place(policy, f"h{i}", "hot") for i in range(2)] == [0, 0]
    assert [place(policy, f"h{i}", "hot") for i in range(2, 20)] == [None] * 18
    assert policy.num_waiting == 18 and policy.num_placeable_waiting == 0
    assert not policy.needs_gpu()            # a new GPU could not take them: the cap holds them back
    tries = []
    choose = policy._choose
    policy._choose = lambda request: tries.append(request.request_id) or choose(request)
    assert policy.schedule() == [] and tries == ["h2"]  # only the head of the adapter's queue
    assert place(policy, "cold", "c") is None and policy.needs_gpu() and policy.num_placeable_waiting == 1
    policy.finish("h0")
    assert policy.schedule() == [("h2", 0)]  # the oldest held-back request first
    policy.finish("h3")                      # a waiting one leaves
    assert policy.waiting_ids() == ["h4"] + [f"h{i}" for i in range(5, 20)] + ["cold"]


def test_migration_prefers_gpus_holding_the_migrated_requests_adapter():
    policy = cluster(num_gpus=3, kv=40, max_batch_size=8, min_gpus=3)
    policy.set_adapters(2, ["a"])
    assert place(policy, "x0", None, 34) == 0 and place(policy, "x1", None, 1) == 0
    assert place(policy, "a0", "a", 5) == 2
    policy.adapter_loaded(2, "a")
    policy.gpus[0].adapters["a"] = 0   # GPU 0 holds "a" too, unused
    policy.holders["a"].add(0)
    assert place(policy, "a1", "a", 4) == 0  # the busiest holder
    policy.adapter_loaded(0, "a")
    evicted = policy.step(0, 1)              # GPU 0's KV runs out: its newest goes
    assert evicted == ["a1"]
    assert policy.schedule() == [("a1", 2)]  # to the other GPU holding "a", not to the empty GPU 1


def home(num_gpus, among=None):
    """An adapter name whose rendezvous home among GPUs 0..num_gpus-1 is GPU `among` (default: the last)."""
    among = num_gpus - 1 if among is None else among
    return next(name for name in (f"m{i}" for i in range(1000))
                if max(range(num_gpus), key=lambda g: rendezvous(name, g)) == among)


def test_a_holder_below_the_reserve_mark_comes_before_a_busier_one_above_it():
    policy = cluster(num_gpus=2, max_batch_size=8, min_gpus=2)  # mark: 8 - 2 = 6
    policy.set_adapters(0, ["a"])
    policy.set_adapters(1, ["a", "b"])
    assert [place(policy, f"x{i}", None) for i in range(7)] == [0] * 7  # GPU 0: batch 7, above the mark
    assert place(policy, "b0", "b") == 1                                # GPU 1: batch 1
    assert place(policy, "a0", "a") == 1     # the holder below the mark, not the busiest holder
    assert place(policy, "y0", None) == 0    # GPU 0's last slot is still free


def test_a_miss_goes_to_the_adapters_rendezvous_home_not_the_busiest_gpu():
    policy = cluster(num_gpus=3, max_batch_size=8, min_gpus=3)
    place(policy, "x0", None)
    place(policy, "x1", None)                                    # GPU 0 the busiest
    adapter = home(3)
    assert place(policy, "m", adapter) == 2 and policy.holders[adapter] == {2}
    assert place(policy, "m2", adapter) == 2                     # its holder since
    assert place(policy, "x2", None) == 0                        # no adapter: Punica's rule


def test_the_least_loaded_gpus_drain_down_to_min_gpus_and_lose_their_holder_preference():
    for min_gpus, expected in ((1, 0), (3, 2)):
        policy = cluster(num_gpus=3, max_batch_size=8, min_gpus=min_gpus)
        assert [place(policy, f"x{i}", None) for i in range(4)] == [0] * 4  # batch 4: one GPU's worth
        policy.set_adapters(2, ["a"])                            # GPU 2 holds "a", idle
        # one GPU's batch suffices (4 <= 0.95 x 8), so GPUs 1 and 2 drain unless min_gpus keeps them
        assert place(policy, "a0", "a") == expected


def test_adapter_aware_asks_for_a_gpu_ahead_once_the_batches_fill_the_cluster():
    for policy_class, expected in ((AdapterAwarePolicy, [False, True]), (PunicaPolicy, [False, False])):
        policy = cluster(policy_class, num_gpus=2, kv=10_000, max_batch_size=32, light_load_batch=16)
        for i in range(62):
            place(policy, f"x{i}", None)
        asked = [policy.needs_gpu()]                             # 62 < 0.98 x 64
        place(policy, "x62", None)
        asked.append(policy.needs_gpu())                         # 63: nothing waits yet
        assert policy.num_waiting == 0 and asked == expected


def test_set_adapters_keeps_adapters_in_use_and_forgets_the_rest():
    policy = cluster(models_loads=False)
    place(policy, "r", "a")
    assert not policy.is_loading("r")     # the engine loads it; the policy does not wait
    policy.set_adapters(0, ["b"])
    assert set(policy.gpus[0].adapters) == {"a", "b"} and policy.holders == {"a": {0}, "b": {0}}
    policy.finish("r")
    policy.set_adapters(0, ["b"])
    assert set(policy.gpus[0].adapters) == {"b"} and policy.holders == {"b": {0}}


FLAT = StepTimeModel(base=0.1, per_request=0.0, per_context_token=0.0, per_prefill_token=0.0,
                     adapter_load_s=0.05, adapter_read_s=0.2)


def simulate(trace, policy="punica", host_tier_adapters=8, **config):
    policy_config = PolicyConfig(**({"max_batch_size": 8, "light_load_batch": 4, "max_loras": 1} | config))
    sim_config = SimConfig(1, 4096, FLAT, policy, policy_config, gpu_startup_s=5.0,
                           host_tier_adapters=host_tier_adapters)
    return Simulator(sim_config, trace).run()


def test_a_request_waits_its_adapters_read_and_load_then_joins_the_step_in_flight():
    # r0 (adapter 0) arrives at 0: read + load 0.25 s, then 3 steps of 0.1 s; r1 (adapter 0) at 0.3
    # joins the step in flight (0.25-0.35) at once
    trace = Trace([0.0, 0.3], [5, 5], [3, 2], [0, 0], duration_s=10.0)
    result = simulate(trace)
    assert result["ttft_p99_s"] == pytest.approx(0.35) and result["ttft_p50_s"] == pytest.approx(0.05)
    assert result["adapter_loads"] == 1 and result["adapter_reads"] == 1


def test_an_adapter_back_from_the_host_tier_costs_only_its_load():
    # one slot: adapter 1 evicts 0, then 0 comes back from the host tier (0.05 s, no read)
    trace = Trace([0.0, 10.0, 20.0], [5, 5, 5], [1, 1, 1], [0, 1, 0], duration_s=30.0)
    result = simulate(trace)
    assert result["adapter_loads"] == 3 and result["adapter_reads"] == 2
    # first tokens after 0.35, 0.35 and 0.15 s (read + load + one 0.1 s step, or load + step)
    assert result["ttft_p50_s"] == pytest.approx(0.35) and result["latency_p50_s"] == pytest.approx(0.35)
    assert result["makespan_s"] == pytest.approx(20.15)


@pytest.mark.parametrize(("policy", "cap"), [("punica", None), ("adapter-aware", None), ("adapter-aware", 1)])
def test_tokens_are_conserved_with_loads_and_evictions(policy, cap):
    trace = fig13_trace(400, duration_s=300.0, seed=3, max_total=512, num_adapters=50, zipf_alpha=1.1)
    result = simulate(trace, policy, max_loras=4, max_gpus_per_adapter=cap)
    assert result["num_evictions"] >= 0 and result["adapter_loads"] > 0
    assert sum(result["series"]["tokens"]) == sum(trace.output_lens) == result["output_tokens"]


@pytest.mark.parametrize(("policy", "max_ttft"), [("adapter-aware", 0.2), ("punica", 5.0)])
def test_the_simulator_starts_the_gpu_adapter_aware_asks_for_ahead(policy, max_ttft):
    # GPU 1 is released at t=2; four long requests fill GPU 0 at t=10, a fifth comes at t=16:
    # adapter-aware asked for a GPU at t=10 (ready at 15), Punica's policy only at 16 (ready at 21,
    # after GPU 0's first finish at 20.1)
    trace = Trace([10.0] * 4 + [16.0], [5] * 5, [100] * 5, [None] * 5, duration_s=30.0)
    config = PolicyConfig(max_batch_size=4, light_load_batch=2, idle_release_s=2.0)
    result = Simulator(SimConfig(2, 4096, FLAT, policy, config, gpu_startup_s=5.0), trace).run()
    assert result["ttft_p99_s"] <= max_ttft and (policy == "adapter-aware" or result["ttft_p99_s"] > 4)


def test_the_floor_is_an_ideal_popularity_cache_of_the_slots_held_at_each_arrival():
    adapters = [0, 1, 0, 2, 0, 1, None]   # by popularity: 0, 1, 2
    assert ideal_cache_loads(adapters, [1] * 7) == 4   # three first uses, and 1 again (not in the top 1)
    assert ideal_cache_loads(adapters, [2] * 7) == 3
    assert ideal_cache_loads(adapters, [2] * 5 + [1, 1]) == 4
    trace = fig13_trace(400, duration_s=300.0, seed=3, max_total=512, num_adapters=50, zipf_alpha=1.1)
    result = simulate(trace, "adapter-aware", max_loras=4)
    assert 0 < result["floor_loads_per_1k_requests"] <= result["loads_per_1k_requests"]
