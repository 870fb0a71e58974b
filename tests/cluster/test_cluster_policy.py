"""Placement, KV checks, newest-first eviction, FCFS queueing and scale decisions, plus
hypothesis properties over random operation sequences."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from punica.cluster.placement import POLICIES, LeastLoadedPolicy, PunicaPolicy, RoundRobinPolicy
from punica.cluster.policy_config import PolicyConfig


def cluster(policy_class=PunicaPolicy, num_gpus=3, kv=100, **config):
    policy = policy_class(PolicyConfig(**({"max_batch_size": 4, "light_load_batch": 2} | config)))
    for gpu_id in range(num_gpus):
        policy.add_gpu(gpu_id, kv)
    return policy


def submit(policy, request_id, num_tokens=10):
    policy.submit(request_id, num_tokens)
    return policy.schedule()


def test_punica_places_on_the_largest_batch_below_max_lowest_id_first():
    policy = cluster()
    assert [submit(policy, f"r{i}") for i in range(5)] == [[("r0", 0)], [("r1", 0)], [("r2", 0)], [("r3", 0)],
                                                           [("r4", 1)]]
    policy.finish("r1")
    assert submit(policy, "r5") == [("r5", 0)]  # batch 3 beats batch 1
    submit(policy, "r6")                        # GPU 0 full again: the busiest with room is GPU 1
    assert policy.requests["r6"].gpu_id == 1


def test_least_loaded_and_round_robin_spread_requests():
    least, robin = cluster(LeastLoadedPolicy), cluster(RoundRobinPolicy)
    assert [submit(least, f"r{i}")[0][1] for i in range(4)] == [0, 1, 2, 0]
    assert [submit(robin, f"r{i}")[0][1] for i in range(4)] == [0, 1, 2, 0]
    least.finish("r1")
    robin.finish("r1")
    assert submit(least, "x")[0][1] == 1  # the only GPU with an empty batch
    assert submit(robin, "x")[0][1] == 1  # next after GPU 0 in id order


def test_kv_check_skips_gpus_without_room():
    policy = cluster(kv=30)
    submit(policy, "big", 25)
    assert submit(policy, "r", 10) == [("r", 1)]  # GPU 0 has the larger batch but only 5 tokens free
    assert submit(policy, "s", 5) == [("s", 0)]


def test_requests_wait_in_arrival_order_when_nothing_fits():
    policy = cluster(num_gpus=1, kv=40)
    submit(policy, "a", 30)
    assert submit(policy, "b", 20) == [] and submit(policy, "c", 5) == []  # c fits but waits behind b
    assert policy.waiting_ids() == ["b", "c"]
    policy.finish("a")
    assert policy.schedule() == [("b", 0), ("c", 0)]


def test_kv_exhaustion_evicts_the_newest_which_is_placed_again_with_its_tokens():
    policy = cluster(num_gpus=2, kv=40)
    for name in ("old", "mid", "new"):
        assert submit(policy, name, 10)[0][1] == 0
    assert policy.step(0, 3) == []             # 30 + 3*3 = 39 tokens
    assert policy.step(0, 1) == ["new"]        # a 4th step needs 42: the newest leaves before it
    assert policy.gpus[0].kv_used == 13 + 13 + 2 and policy.num_tokens("new") == 13
    assert policy.schedule() == [("new", 1)]   # placed again like a new request, elsewhere
    assert policy.num_tokens("new") == 13 and policy.gpus[1].kv_used == 13


def test_evicted_request_keeps_its_place_ahead_of_later_arrivals():
    policy = cluster(num_gpus=1, kv=25)
    submit(policy, "a", 10)
    submit(policy, "b", 10)
    assert submit(policy, "later", 6) == []
    assert policy.step(0, 3) == ["b"]
    assert policy.waiting_ids() == ["b", "later"]


def test_backend_eviction_and_gpu_removal_requeue_requests():
    policy = cluster(num_gpus=2)
    for name in ("a", "b", "c"):
        submit(policy, name)
    policy.evict("c", 17)
    assert policy.waiting_ids() == ["c"] and policy.gpus[0].kv_used == 20
    assert policy.schedule() == [("c", 0)]
    assert sorted(policy.remove_gpu(0)) == ["a", "b", "c"]
    assert [g for _, g in policy.schedule()] == [1, 1, 1] and policy.num_tokens("c") == 17


def test_scale_up_when_requests_wait_and_no_gpu_is_lightly_loaded():
    policy = cluster(num_gpus=1, kv=1000)
    for i in range(4):
        submit(policy, f"r{i}")
    assert not policy.needs_gpu()          # full, but nobody waits
    submit(policy, "r4")
    assert policy.needs_gpu()
    policy.add_gpu(1, 1000)
    assert policy.schedule() == [("r4", 1)] and not policy.needs_gpu()


def test_kv_aware_packing_caps_a_busy_gpus_kv_and_scale_ahead_asks_before_anyone_waits():
    policy = cluster(num_gpus=2, kv=1000, max_packed_kv_tokens=100, scale_ahead=True)  # light: batch < 2, KV < 50
    assert not policy.needs_gpu()
    assert submit(policy, "big", 150) == [("big", 0)]   # an idle GPU takes any request its KV holds
    assert submit(policy, "a", 60) == [("a", 1)]        # GPU 0 is past the cap: the next busiest
    assert policy.needs_gpu() and not policy.num_waiting  # no GPU is light; nobody waits yet
    assert submit(policy, "b", 50) == []                # 60 + 50 would pass the cap on GPU 1
    policy.finish("a")
    assert policy.schedule() == [("b", 1)]



def test_scale_down_releases_gpus_idle_long_enough_keeping_min_gpus():
    policy = PunicaPolicy(PolicyConfig(max_batch_size=4, light_load_batch=2, idle_release_s=10, min_gpus=2))
    for gpu_id in range(3):
        policy.add_gpu(gpu_id, 100, now=0.0)
    policy.submit("r", 5)
    assert policy.schedule() == [("r", 0)]
    assert policy.release_idle(now=9.0) == []
    policy.finish("r", now=8.0)                   # GPU 0 idle again from t=8
    assert policy.release_idle(now=10.0) == [1]   # GPU 2 stays: min_gpus
    assert policy.release_idle(now=30.0) == [] and sorted(policy.gpus) == [0, 2]


OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 60)),
    st.tuples(st.just("step"), st.integers(0, 3), st.integers(1, 8)),
    st.tuples(st.just("finish"), st.integers(0, 200)),
    st.tuples(st.just("remove"), st.integers(0, 3)),
    st.tuples(st.just("add"), st.integers(0, 3)),
), max_size=80)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_no_request_lost_or_duplicated_batch_and_kv_within_limits(name, ops):
    policy = POLICIES[name](PolicyConfig(max_batch_size=3, light_load_batch=2))
    for gpu_id in range(2):
        policy.add_gpu(gpu_id, 64)
    submitted, finished = [], set()
    for op in ops:
        if op[0] == "submit":
            submitted.append(len(submitted))
            policy.submit(submitted[-1], op[1])
        elif op[0] == "step" and op[1] in policy.gpus:
            policy.step(op[1], op[2])
        elif op[0] == "finish" and op[1] < len(submitted) and op[1] not in finished:
            finished.add(op[1])
            policy.finish(op[1])
        elif op[0] == "remove" and op[1] in policy.gpus and len(policy.gpus) > 1:
            policy.remove_gpu(op[1])
        elif op[0] == "add" and op[1] not in policy.gpus:
            policy.add_gpu(op[1], 64)
        policy.schedule()
        running = [r for gpu in policy.gpus.values() for r in gpu.running]
        waiting = policy.waiting_ids()
        assert sorted(running + waiting) == sorted(set(submitted) - finished)  # each exactly once
        for gpu in policy.gpus.values():
            assert gpu.batch_size <= 3
            assert gpu.kv_used == sum(policy.num_tokens(r) for r in gpu.running) <= gpu.kv_capacity
        if waiting:  # FCFS: the head fits on no GPU
            head = policy.num_tokens(waiting[0])
            assert all(g.batch_size == 3 or g.kv_free < head for g in policy.gpus.values())


def test_a_wrong_cluster_policy_is_a_clear_error_naming_the_choices(capsys):
    from punica.cli import build_parser
    from punica.server.args import CLUSTER_POLICIES, ServerArgs

    with pytest.raises(ValueError, match="cluster_policy must be one of punica, adapter-aware, round-robin, "
                                         "least-loaded, got 'busiest'"):
        ServerArgs(cluster_policy="busiest")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cluster-policy", "busiest"])
    assert "--cluster-policy: invalid choice: 'busiest' (choose from" in capsys.readouterr().err
    assert set(CLUSTER_POLICIES) == set(POLICIES)   # the server offers exactly the placement rules


def test_serve_max_packed_kv_tokens_is_checked_and_reaches_the_ray_policy(capsys, monkeypatch):
    import ray

    from punica.cli import build_parser, main
    from punica.cluster.ray_backend import build_cluster_engine
    from punica.config import EngineArgs
    from punica.server.args import ServerArgs
    from punica.server.serve import build_state

    with pytest.raises(ValueError, match="max_packed_kv_tokens must be >= 1, got 0"):
        ServerArgs(max_packed_kv_tokens=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-packed-kv-tokens", "many"])
    assert "--max-packed-kv-tokens: invalid int value: 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-packed-kv-tokens", "-5"])   # refused before anything starts
    assert e.value.code == 2
    assert "argument --max-packed-kv-tokens: must be >= 1, got -5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs --workers N"):
        build_state(EngineArgs(), server=ServerArgs(max_packed_kv_tokens=14000))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})   # no Ray started: only the policy is built
    engine = build_cluster_engine(EngineArgs(workers=2), {}, policy="adapter-aware", max_packed_kv_tokens=14000)
    assert engine.policy.name == "adapter-aware" and engine.policy.config.max_packed_kv_tokens == 14000
    assert build_cluster_engine(EngineArgs(workers=2), {}).policy.config.max_packed_kv_tokens is None


def test_simulate_has_a_flag_for_every_described_policy_setting_and_serve_shares_max_packed_kv_tokens():
    from dataclasses import fields

    from punica.cli import build_parser
    from punica.flags import from_arguments
    from punica.server.args import ServerArgs

    args = build_parser().parse_args(["simulate", "--out", "x", "--max-batch-size", "16", "--light-load-batch", "4",
                                      "--idle-release-s", "5", "--max-loras", "3", "--max-gpus-per-adapter", "2",
                                      "--max-packed-kv-tokens", "9000", "--scale-ahead"])
    assert from_arguments(PolicyConfig, args) == PolicyConfig(16, 4, 5.0, max_loras=3, max_gpus_per_adapter=2,
                                                              max_packed_kv_tokens=9000, scale_ahead=True)
    described = [f.name for f in fields(PolicyConfig) if "help" in f.metadata]
    assert len(described) == 7 and all(hasattr(args, name) for name in described)
    defaults = build_parser().parse_args(["simulate", "--out", "x"])
    assert from_arguments(PolicyConfig, defaults) == PolicyConfig()
    shared = {f.name: f for f in fields(ServerArgs)}["max_packed_kv_tokens"]
    assert shared.metadata == {f.name: f for f in fields(PolicyConfig)}["max_packed_kv_tokens"].metadata


@pytest.mark.parametrize("config, message", [
    (dict(min_gpus=-1), "min_gpus must be >= 0, got -1"),
    (dict(idle_release_s=float("nan")), "idle_release_s must be >= 0, got nan"),
    (dict(max_batch_size=4, light_load_batch=5), r"light_load_batch must be in \[1, 4\], got 5"),
])
def test_a_policy_setting_out_of_its_bounds_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**config)
