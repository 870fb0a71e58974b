"""The AdapterManager alone: more adapters than GPU slots, LRU eviction, prefetching, pinning, the
checks at registration, and reads or copies in flight for a registration since unloaded."""

import pytest
import torch
from on_demand import edit_config, load, manager_with, model_of, names, wait_for_reads

from punica.lora.adapter import read_adapter
from punica.lora.adapter_config import AdapterError
from punica.lora.dummy import save_random_adapter
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool


def test_reads_run_torch_serially_beside_the_engine_thread(base_dir):
    """The reading threads keep no OpenMP team beside the engine thread's (punica.ops.cpu_threads)."""
    manager = manager_with(base_dir, 1, 1)
    load(manager, "t0")
    assert manager.executor.submit(torch.get_num_threads).result() == 1


def test_eviction_is_lru_and_never_takes_a_slot_in_use(base_dir):
    m = manager_with(base_dir, 6, slots=3)
    slots = {n: load(m, n) for n in ("t0", "t1", "t2")}
    m.release(slots["t0"])
    m.release(slots["t1"])
    m.release(slots["t2"])
    m.release(load(m, "t0"))  # t0 used again: t1 is now the least recently used
    assert load(m, "t3") == slots["t1"] and "t1" not in names(m.resident)
    # t3 stays held; t2 (free, older than t0) is evicted next, then t0, never t3
    assert load(m, "t4") == slots["t2"]
    assert load(m, "t5") == slots["t0"]
    # all three slots are held now: t1 waits, whatever we poll
    for _ in range(5):
        assert m.acquire("t1") is None
        wait_for_reads(m)
        m.poll(["t1"])
    m.release(slots["t2"])  # t4's
    assert load(m, "t1") == slots["t2"]


def test_held_lists_resident_adapters_lru_first_then_those_on_their_way(base_dir):
    m = manager_with(base_dir, 4, slots=3)
    m.release(load(m, "t0"))
    m.release(load(m, "t1"))
    m.release(load(m, "t0"))       # t1 is now the least recently used
    assert m.acquire("t2") is None  # its read starts
    assert m.held() == ["t1", "t0", "t2"]
    m.unregister("t1")
    assert m.held() == ["t0", "t2"]


def test_queued_adapters_are_prefetched_without_evicting(base_dir):
    m = manager_with(base_dir, 5, slots=3)
    m.release(load(m, "t0"))  # resident and unused: evictable, but a prefetch does not evict
    for _ in range(1000):
        m.poll(["t1", "t2", "t1", "t3", "t4"])  # queue order; the lookahead is max_loras = 3 adapters
        wait_for_reads(m)
        if {"t1", "t2"} <= names(m.resident) and "t3" in names(m.host):
            break
    assert {"t0", "t1", "t2"} == names(m.resident), "copied into the free slots; t0 kept"
    assert "t3" in names(m.host) and "t3" not in names(m.resident), "read ahead, waiting for a slot"
    assert "t4" not in names(m.host) and "t4" not in names(m.reads), "beyond the lookahead"
    assert m.acquire("t1") is not None and m.acquire("t3") is None


def test_a_long_queue_does_not_pin_every_slot(base_dir):
    m = manager_with(base_dir, 3, slots=2)
    for name in ("t0", "t1"):
        m.release(load(m, name))
    m.release(load(m, "t1"))  # t1 most recently used, t0 the least
    queue = ["t2", "t0", "t1"]  # t1 is queued, but behind the lookahead of max_loras = 2 adapters
    for _ in range(1000):
        if m.acquire("t2") is not None:
            break
        wait_for_reads(m)
        m.poll(queue)
    assert names(m.resident) == {"t0", "t2"}, "t1 evicted for t2; t0, least recently used but next, kept"


def test_pinned_adapter_is_never_evicted(base_dir):
    m = manager_with(base_dir, 4, slots=2)
    model_dir = m.registry["t0"]
    m.unregister("t0")
    m.register("t0", model_dir, pinned=True)
    pinned_slot = load(m, "t0")
    m.release(pinned_slot)
    for name in ("t1", "t2", "t3"):
        slot = load(m, name)
        assert slot != pinned_slot
        m.release(slot)
    assert m.resident[m.current["t0"]] == pinned_slot


def test_register_checks_the_name_the_config_and_the_rank(base_dir, tmp_path, peft_adapter):
    m = manager_with(base_dir, 0, slots=2)  # max_lora_rank 8
    good = peft_adapter(tmp_path / "good", r=8)
    for name in ("../x", ".hidden", "a b", "", "x" * 10_000):
        with pytest.raises(ValueError, match="adapter name .*(must start|hold only|over the limit of 128)"):
            m.register(name, good)
    for name in ("tenant-a", "org/adapter_v1.2"):
        m.register(name, good)
    big = peft_adapter(tmp_path / "big", r=32)
    with pytest.raises(ValueError, match=r"'big' has rank 32, over this engine's max_lora_rank 8 "
                                         r"\(start it with max_lora_rank / --max-lora-rank >= 32\)"):
        m.register("big", big)
    nan, huge = peft_adapter(tmp_path / "nan"), peft_adapter(tmp_path / "huge")
    edit_config(nan, lora_alpha=float("nan"))
    edit_config(huge, lora_alpha=1e300)
    with pytest.raises(AdapterError, match=f"{nan}: lora_alpha=nan must be a finite number"):
        m.register("nan", nan)
    with pytest.raises(AdapterError, match=f"{huge}: the scale .* is over the limit"):
        m.register("huge", huge)
    assert list(m.registry) == ["tenant-a", "org/adapter_v1.2"]


def test_a_read_or_copy_in_flight_for_an_unloaded_registration_is_never_used(base_dir):
    model = model_of(base_dir)
    old, new = (save_random_adapter(base_dir / f"inflight-{i}", model.config, rank=4, seed=40 + i, alpha=4 + i,
                                    dtype=torch.float32) for i in range(2))
    pool = LoraPool(model.config, 2, 8, torch.float32, "cpu")
    m = AdapterManager(model.config, pool, host_capacity_bytes=1 << 30)
    expected = read_adapter(new, model.config)
    expected_packed = pool.pack(expected)

    def holds_new(slot):
        return torch.equal(pool.buffer[slot], expected_packed) and pool.scales[slot] == expected.scale

    m.register("x", old)
    assert m.acquire("x") is None  # the read of the old adapter starts
    m.unregister("x")
    m.register("x", new)
    wait_for_reads(m)              # the old read is done, not yet taken in
    slot = load(m, "x")
    assert holds_new(slot)
    m.release(slot)

    m.unregister("x")
    m.register("x", old)
    assert m.acquire("x") is None
    wait_for_reads(m)
    m.poll(["x"])                  # the read is taken in and its copy starts (done at the next poll)
    assert names(m.copies) == {"x"} and m.acquire("x") is None
    m.unregister("x")
    m.register("x", new)
    slot = load(m, "x")
    assert holds_new(slot)
    m.release(slot)
    assert not m.refs and not m.copies and len(m.free_slots) + len(m.resident) == 2
