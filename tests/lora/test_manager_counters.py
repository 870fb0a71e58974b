"""The AdapterManager's residency counters: tiers, loads, evictions, load time, hits and misses."""

import pytest
import torch
from on_demand import wait_for_reads

from punica.engine.admission import acquire_adapter, release_adapter
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams
from punica.lora.dummy import save_random_adapter
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory, tiny_llama, punica_config):
    config = punica_config(tiny_llama())
    root = tmp_path_factory.mktemp("residency")
    return config, {f"t{i}": save_random_adapter(root / f"t{i}", config, rank=4, seed=i, dtype=torch.float32)
                    for i in range(5)}


@pytest.fixture()
def manager(adapter_paths):
    """Two GPU slots and a host tier of two adapters, five adapters registered."""
    config, paths = adapter_paths
    pool = LoraPool(config, 2, 4, torch.float32, "cpu")
    manager = AdapterManager(config, pool, host_capacity_bytes=2 * pool.slot_numel * 4)
    for name, path in paths.items():
        manager.register(name, path)
    return manager


def step(manager, demand):
    """What the engine does between two admission attempts: the reads started so far finish, then a poll."""
    wait_for_reads(manager)
    manager.poll(demand)


def admit(manager, name):
    """Queue a request for `name` (noting the adapter's residency, as the engine does), step until it
    is admitted, and let it leave."""
    queued = manager.residency(name)
    for _ in range(100):
        slot = manager.acquire(name, queued)
        if slot is not None:
            manager.release(slot)
            return slot
        step(manager, [name])
    raise AssertionError(f"{name} was never admitted")


def counts(manager, name):
    a = manager.snapshot()["adapters"][name]
    return a["tier"], a["loads"], a["evictions"], a["hits"], a["misses"]


def test_tiers_loads_evictions_hits_and_misses_count_what_happened(manager):
    snapshot = manager.snapshot()
    assert {a["tier"] for a in snapshot["adapters"].values()} == {"disk"}
    assert snapshot["host_tier"] == {"adapters": 0, "bytes_used": 0, "bytes_limit": 2 * manager.row_bytes}

    assert manager.acquire("t0") is None  # the read starts
    t0 = manager.snapshot()["adapters"]["t0"]
    assert (t0["tier"], t0["loading"], t0["loads"]) == ("disk", "host", {"host": 0, "gpu": 0})
    step(manager, ["t0"])  # read taken in, the copy into a free slot started
    t0 = manager.snapshot()["adapters"]["t0"]
    assert (t0["tier"], t0["loading"], t0["loads"]) == ("host", "gpu", {"host": 1, "gpu": 0})
    step(manager, ["t0"])
    slot0 = manager.acquire("t0")
    manager.release(slot0)
    t0 = manager.snapshot()["adapters"]["t0"]
    assert (t0["tier"], t0["slot"], t0["loading"], t0["hits"], t0["misses"]) == ("gpu", slot0, None, 0, 1)
    assert t0["last_load_seconds"]["host"] == t0["load_seconds"]["host"] > 0

    admit(manager, "t1")                        # miss: t1 to the other free slot
    assert manager.residency("t0") == 1
    assert admit(manager, "t0") == slot0        # hit: resident when queued, still resident
    admit(manager, "t2")                        # host row of t0 evicted (LRU), then t1's GPU slot (LRU)
    assert counts(manager, "t0") == ("gpu", {"host": 1, "gpu": 1}, {"host": 1, "gpu": 0}, 1, 1)
    assert counts(manager, "t1") == ("host", {"host": 1, "gpu": 1}, {"host": 0, "gpu": 1}, 0, 1)

    queued = manager.residency("t0")            # t0 on the GPU when this request is queued ...
    admit(manager, "t3")                        # ... then t1's host row and t0's slot go to t3
    assert manager.residency("t0") is None
    for _ in range(100):
        slot = manager.acquire("t0", queued)
        if slot is not None:
            break
        step(manager, ["t0"])
    manager.release(slot)                       # a miss: t0 was read and copied again (t2 evicted twice)

    assert counts(manager, "t0") == ("gpu", {"host": 2, "gpu": 2}, {"host": 1, "gpu": 1}, 1, 2)
    assert counts(manager, "t1") == ("disk", {"host": 1, "gpu": 1}, {"host": 1, "gpu": 1}, 0, 1)
    assert counts(manager, "t2") == ("disk", {"host": 1, "gpu": 1}, {"host": 1, "gpu": 1}, 0, 1)
    assert counts(manager, "t3") == ("gpu", {"host": 1, "gpu": 1}, {"host": 0, "gpu": 0}, 0, 1)
    assert counts(manager, "t4") == ("disk", {"host": 0, "gpu": 0}, {"host": 0, "gpu": 0}, 0, 0)
    snapshot = manager.snapshot()
    assert snapshot["gpu_slots"] == {"total": 2, "used": 2, "held": 0}
    assert snapshot["host_tier"]["bytes_used"] == snapshot["host_tier"]["bytes_limit"]
    t0 = snapshot["adapters"]["t0"]
    assert t0["load_seconds"]["gpu"] > t0["last_load_seconds"]["gpu"] > 0


def test_a_new_registration_of_a_name_counts_from_zero(manager, adapter_paths):
    admit(manager, "t0")
    manager.unregister("t0")
    assert "t0" not in manager.snapshot()["adapters"]
    manager.register("t0", adapter_paths[1]["t0"], pinned=True)
    t0 = manager.snapshot()["adapters"]["t0"]
    assert (t0["tier"], t0["pinned"], t0["loads"], t0["misses"]) == ("disk", True, {"host": 0, "gpu": 0}, 0)


def test_a_request_sent_back_to_the_queue_is_a_hit_again_unless_its_adapter_left(manager):
    """The engine's side: a request notes the residency when queued and when it leaves the batch."""
    def request(name):
        return Request("r", [1], SamplingParams(), adapter=name, registration=manager.current[name],
                       queued_residency=manager.residency(name))

    def run(r):
        while not acquire_adapter(manager, r):
            step(manager, [r.adapter])
        release_adapter(manager, r)  # as a preemption does: back to the queue

    r = request("t0")
    run(r)
    run(r)                                      # still on the GPU: a hit
    admit(manager, "t1")
    admit(manager, "t2")                        # evicts t0 (least recently used) from its slot
    run(r)                                      # reloaded: a miss
    assert counts(manager, "t0")[3:] == (1, 2)
