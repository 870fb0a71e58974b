"""On-demand adapters: many more adapters than GPU slots, LRU, pinning, failures, run-time load/unload."""

import random

import pytest
import torch

from helpers import tiny_llama
from punica.config import EngineConfig
from punica.factory import engine_on_model
from punica.engine.sampling_params import SamplingParams
from punica.lora.adapter import load_adapter
from punica.lora.batch import LoraBatch
from punica.lora.dummy import save_random_adapter
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool
from punica.models.loader import load_hf_dir
from punica.ops.attention import AttnBatch


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manager")
    tiny_llama(seed=11).save_pretrained(tmp / "base")
    return tmp


def model_of(base):
    return load_hf_dir(base / "base", dtype=torch.float32)


def adapter_dirs(base, model, n):
    rng = random.Random(0)
    return {f"t{i}": str(save_random_adapter(base / f"t{i}", model.config, rank=rng.choice([2, 4, 8]), seed=i,
                                             dtype=torch.float32)) for i in range(n)}


def reference_greedy(model, adapter_path, prompt, steps):
    """The model alone with one adapter in a one-slot pool: what the request must produce."""
    pool = LoraPool(model.config, 1, 8, torch.float32, "cpu")
    pool.write(0, load_adapter(adapter_path, model.config))
    model.set_lora(pool)
    kv = model.new_kv_cache(16, 4)
    tokens, pages = list(prompt), list(range(16))
    for step in range(steps):
        q = len(tokens) if step == 0 else 1
        attn = AttnBatch.build([q], [len(tokens)], [pages], 4, int(step == 0))
        logits = model(torch.tensor(tokens[-q:]), attn, LoraBatch.build([0], [q]), kv)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


def drain(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


@pytest.mark.parametrize("host_rows", [None, 3])
def test_200_adapters_through_8_slots_each_request_gets_its_own(base, host_rows):
    """With the default host tier (every adapter fits) and with one of 3 adapters, whose rows
    are reused by later reads (so adapters are read again)."""
    model = model_of(base)
    paths = adapter_dirs(base, model, 210)
    host_bytes = 4 << 30
    if host_rows is not None:
        host_bytes = host_rows * LoraPool(model.config, 1, 8, torch.float32, "cpu").slot_numel * 4
    engine = engine_on_model(model, EngineConfig(max_batch_size=16, max_loras=8, max_lora_rank=8, page_size=4,
                                                 lora_host_bytes=host_bytes), paths)
    if host_rows is not None:
        assert engine.adapters.arena.rows.shape[0] == host_rows
    rng = random.Random(1)
    names = list(paths) + rng.choices(list(paths), k=30)  # every adapter, some twice
    rng.shuffle(names)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(2, 9))] for _ in names]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, n) for p, n in zip(prompts, names)]
    outs = drain(engine)
    assert engine.adapters.num_loads >= 210 and len(engine.adapters.resident) <= 8
    assert len(engine.adapters.host) <= engine.adapters.arena.rows.shape[0]
    check = random.Random(2).sample(range(len(ids)), 40)
    reference = model_of(base)
    for i in check:
        assert outs[ids[i]].token_ids == reference_greedy(reference, paths[names[i]], prompts[i], 3), names[i]
    assert engine.allocator.num_used == 0 and not engine.adapters.refs


def manager_with(base, n, slots):
    model = model_of(base)
    pool = LoraPool(model.config, slots, 8, torch.float32, "cpu")
    manager = AdapterManager(model.config, pool, host_capacity_bytes=1 << 30)
    for name, path in adapter_dirs(base, model, n).items():
        manager.register(name, path)
    return manager


def load(manager, name):
    """Acquire, polling until the adapter is resident (reads run on a worker thread)."""
    for _ in range(1000):
        slot = manager.acquire(name)
        if slot is not None:
            return slot
        manager.executor.submit(lambda: None).result()
        manager.poll([name])
    raise AssertionError(f"{name} never loaded")


def test_eviction_is_lru_and_never_takes_a_slot_in_use(base):
    m = manager_with(base, 6, slots=3)
    slots = {n: load(m, n) for n in ("t0", "t1", "t2")}
    m.release("t0")
    m.release("t1")
    m.release("t2")
    load(m, "t0")            # t0 used again: t1 is now the least recently used
    m.release("t0")
    assert load(m, "t3") == slots["t1"] and "t1" not in m.resident
    # t3 stays held; t2 (free, older than t0) is evicted next, then t0, never t3
    assert load(m, "t4") == slots["t2"]
    assert load(m, "t5") == slots["t0"]
    # all three slots are held now: t1 waits, whatever we poll
    for _ in range(5):
        assert m.acquire("t1") is None
        m.executor.submit(lambda: None).result()
        m.poll(["t1"])
    m.release("t4")
    assert load(m, "t1") == slots["t2"]


def test_queued_adapters_are_prefetched_without_evicting(base):
    m = manager_with(base, 5, slots=3)
    load(m, "t0")
    m.release("t0")  # resident and unused: evictable, but a prefetch does not evict
    for _ in range(1000):
        m.poll(["t1", "t2", "t1", "t3", "t4"])  # queue order; the lookahead is max_loras = 3 adapters
        m.executor.submit(lambda: None).result()
        if {"t1", "t2"} <= set(m.resident) and "t3" in m.host:
            break
    assert {"t0", "t1", "t2"} == set(m.resident), "copied into the free slots; t0 kept"
    assert "t3" in m.host and "t3" not in m.resident, "read ahead, waiting for a slot"
    assert "t4" not in m.host and "t4" not in m.reads, "beyond the lookahead"
    assert m.acquire("t1") is not None and m.acquire("t3") is None


def test_a_long_queue_does_not_pin_every_slot(base):
    m = manager_with(base, 3, slots=2)
    for name in ("t0", "t1"):
        load(m, name)
        m.release(name)
    load(m, "t1")  # t1 most recently used, t0 the least
    m.release("t1")
    queue = ["t2", "t0", "t1"]  # t1 is queued, but behind the lookahead of max_loras = 2 adapters
    for _ in range(1000):
        if m.acquire("t2") is not None:
            break
        m.executor.submit(lambda: None).result()
        m.poll(queue)
    assert set(m.resident) == {"t0", "t2"}, "t1 evicted for t2; t0, least recently used but next, kept"


def test_pinned_adapter_is_never_evicted(base):
    m = manager_with(base, 4, slots=2)
    model_dir = m.registry["t0"]
    m.unregister("t0")
    m.register("t0", model_dir, pinned=True)
    pinned_slot = load(m, "t0")
    m.release("t0")
    for name in ("t1", "t2", "t3"):
        slot = load(m, name)
        assert slot != pinned_slot
        m.release(name)
    assert m.resident["t0"] == pinned_slot


def test_corrupt_or_missing_adapter_fails_only_its_requests(base):
    model = model_of(base)
    paths = adapter_dirs(base, model, 3)
    broken = base / "broken"
    save_random_adapter(broken, model.config, rank=4, seed=9)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    vanished = base / "vanished"
    save_random_adapter(vanished, model.config, rank=4, seed=10)
    engine = engine_on_model(model, EngineConfig(max_batch_size=8, max_loras=2, max_lora_rank=8), paths)
    engine.load_adapter("broken", str(broken))
    engine.load_adapter("vanished", str(vanished))
    (vanished / "adapter_config.json").unlink()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    good = [engine.add_request([1, 2, 3], params, n) for n in ("t0", "t1", "t2", None)]
    bad = engine.add_request([1, 2, 3], params, "broken")
    gone = engine.add_request([4, 5], params, "vanished")
    outs = drain(engine)
    assert outs[bad].finish_reason == "error" and "adapter_model.safetensors" in outs[bad].error
    assert outs[gone].finish_reason == "error" and "no adapter_config.json" in outs[gone].error
    assert all(outs[g].finish_reason == "length" and len(outs[g].token_ids) == 4 for g in good)
    late = engine.add_request([1, 2], params, "broken")  # queued after the failure: fails too
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(late, "error")]
    with pytest.raises(ValueError, match="is not a directory"):
        engine.load_adapter("nowhere", str(base / "nowhere"))


def test_unload_while_running_finishes_admitted_and_fails_queued(base):
    model = model_of(base)
    paths = adapter_dirs(base, model, 2)
    engine = engine_on_model(model, EngineConfig(max_batch_size=1, max_loras=2, max_lora_rank=8), paths)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params, "t0")
    queued = engine.add_request([4, 5, 6], params, "t0")
    while not engine.scheduler.running:
        engine.step()
    engine.unload_adapter("t0")
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.add_request([1], params, "t0")
    outs = drain(engine)
    assert outs[first].finish_reason == "length" and len(outs[first].token_ids) == 6
    assert outs[queued].finish_reason == "error" and "unloaded" in outs[queued].error
    assert "t0" not in engine.adapters.resident and len(engine.adapters.free_slots) >= 1
    engine.load_adapter("t0", paths["t0"])  # the name can be registered again
    again = engine.add_request([1, 2, 3], params, "t0")
    assert drain(engine)[again].token_ids == outs[first].token_ids
