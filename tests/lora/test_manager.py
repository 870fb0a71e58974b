"""On-demand adapters: many more adapters than GPU slots, LRU, pinning, failures, run-time load/unload."""

import json
import random

import pytest
import torch

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.adapter import load_adapter, read_adapter
from punica.lora.adapter_config import AdapterError
from punica.lora.batch import LoraBatch
from punica.lora.dummy import save_random_adapter
from punica.lora.layers import attach_pool
from punica.lora.manager import AdapterManager
from punica.lora.pool import LoraPool
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.ops.attention import AttnBatch

BASE_SEED = 11


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("manager")
    tiny_llama(seed=BASE_SEED).save_pretrained(tmp / "base")
    return tmp


@pytest.fixture(scope="module")
def peft_adapter(tiny_llama, make_peft_adapter):
    """The function `peft_adapter(path, r=8, alpha=64, seed=0)`: a real PEFT adapter for the base
    model (alpha 64: strong enough to change greedy outputs)."""
    base_model = tiny_llama(seed=BASE_SEED)

    def peft_adapter(path, r=8, alpha=64, seed=0):
        return make_peft_adapter(base_model, path, r=r, alpha=alpha, seed=seed)

    return peft_adapter


def edit_config(path, **changes):
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


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
    attach_pool(model, pool)
    kv = model.new_kv_cache(16, 4)
    tokens, pages = list(prompt), list(range(16))
    for step in range(steps):
        q = len(tokens) if step == 0 else 1
        attn = AttnBatch.build([q], [len(tokens)], [pages], 4, int(step == 0))
        logits = model(torch.tensor(tokens[-q:]), ForwardBatch(attn, LoraBatch.build([0], [q]), kv))
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


def drain(engine):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


@pytest.mark.slow
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


def wait_for_reads(manager):
    """Until the reads started so far have finished (not yet taken in by a poll)."""
    for future, _ in list(manager.reads.values()):
        future.result()


def load(manager, name):
    """Acquire, polling until the adapter is resident (reads run on worker threads)."""
    for _ in range(1000):
        slot = manager.acquire(name)
        if slot is not None:
            return slot
        wait_for_reads(manager)
        manager.poll([name])
    raise AssertionError(f"{name} never loaded")


def names(registrations):
    """The adapter names of a manager's registration-keyed collection (resident, host, reads)."""
    return {registration.name for registration in registrations}


def test_reads_run_torch_serially_beside_the_engine_thread(base):
    """The reading threads keep no OpenMP team beside the engine thread's (punica.ops.cpu_threads)."""
    manager = manager_with(base, 1, 1)
    load(manager, "t0")
    assert manager.executor.submit(torch.get_num_threads).result() == 1


def test_eviction_is_lru_and_never_takes_a_slot_in_use(base):
    m = manager_with(base, 6, slots=3)
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


def test_held_lists_resident_adapters_lru_first_then_those_on_their_way(base):
    m = manager_with(base, 4, slots=3)
    m.release(load(m, "t0"))
    m.release(load(m, "t1"))
    m.release(load(m, "t0"))       # t1 is now the least recently used
    assert m.acquire("t2") is None  # its read starts
    assert m.held() == ["t1", "t0", "t2"]
    m.unregister("t1")
    assert m.held() == ["t0", "t2"]


def test_queued_adapters_are_prefetched_without_evicting(base):
    m = manager_with(base, 5, slots=3)
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


def test_a_long_queue_does_not_pin_every_slot(base):
    m = manager_with(base, 3, slots=2)
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


def test_pinned_adapter_is_never_evicted(base):
    m = manager_with(base, 4, slots=2)
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
    assert "t0" not in names(engine.adapters.resident) and len(engine.adapters.free_slots) >= 1
    engine.load_adapter("t0", paths["t0"])  # the name can be registered again
    again = engine.add_request([1, 2, 3], params, "t0")
    assert drain(engine)[again].token_ids == outs[first].token_ids


def test_register_checks_the_name_the_config_and_the_rank(base, tmp_path, peft_adapter):
    m = manager_with(base, 0, slots=2)  # max_lora_rank 8
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


def test_a_rank_over_the_pool_is_refused_at_load_not_per_request(base, tmp_path, peft_adapter):
    engine = engine_on_model(model_of(base), EngineConfig(max_loras=2, max_lora_rank=16))
    with pytest.raises(ValueError, match="rank 512, over this engine's max_lora_rank 16"):
        engine.load_adapter("wide", str(peft_adapter(tmp_path / "wide", r=512)))
    assert "wide" not in engine.adapters.registry


def test_an_adapter_broken_after_registration_fails_in_its_read_alone(base, tmp_path, peft_adapter):
    """lora_alpha 1e300 written after registration: the read (worker thread) refuses it, its
    requests fail with the message, the co-batched ones finish as if it did not exist, and the
    manager's slots stay whole."""
    model = model_of(base)
    paths = adapter_dirs(base, model, 2)
    broken = peft_adapter(tmp_path / "broken", r=4)
    engine = engine_on_model(model, EngineConfig(max_batch_size=8, max_loras=2, max_lora_rank=8), paths)
    engine.load_adapter("broken", str(broken))
    edit_config(broken, lora_alpha=1e300)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = [1, 2, 3]
    good = {engine.add_request(prompt, params, n): n for n in ("t0", "t1")}
    bad = engine.add_request(prompt, params, "broken")
    outs = drain(engine)
    assert outs[bad].finish_reason == "error"
    assert outs[bad].error.startswith(f"LoRA adapter {broken}: the scale") and "over the limit" in outs[bad].error
    reference = model_of(base)
    for rid, name in good.items():
        assert outs[rid].token_ids == reference_greedy(reference, paths[name], prompt, 4), name
    assert engine.adapters.num_load_failures == 1
    again = engine.add_request(prompt, params, "t0")
    assert drain(engine)[again].token_ids == outs[next(iter(good))].token_ids
    adapters = engine.adapters
    assert not adapters.refs and len(adapters.free_slots) + len(adapters.resident) == 2


def test_an_adapter_inside_an_adapter_dir_reads_no_file_outside_it(base, tmp_path):
    """Its config is checked at registration and its weights at the read (on the worker thread),
    each as opened: a link out, even one made after the registration, fails its requests alone."""
    model = model_of(base)
    root = tmp_path / "adapters"
    tenant = save_random_adapter(root / "tenant", model.config, rank=4, seed=1, dtype=torch.float32)
    other = save_random_adapter(tmp_path / "elsewhere", model.config, rank=4, seed=2, dtype=torch.float32)
    engine = engine_on_model(model, EngineConfig(max_loras=2, max_lora_rank=8, adapter_dirs=(str(root),)))
    linked = save_random_adapter(root / "linked", model.config, rank=4, seed=3, dtype=torch.float32)
    (linked / "adapter_config.json").unlink()
    (linked / "adapter_config.json").symlink_to(other / "adapter_config.json")
    with pytest.raises(AdapterError, match="adapter_config.json resolves to a file outside"):
        engine.load_adapter("linked", str(linked))
    engine.load_adapter("tenant", str(tenant))
    (tenant / "adapter_model.safetensors").unlink()
    (tenant / "adapter_model.safetensors").symlink_to(other / "adapter_model.safetensors")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    bad, good = engine.add_request([1, 2], params, "tenant"), engine.add_request([1, 2], params)
    outs = drain(engine)
    assert outs[bad].finish_reason == "error"
    assert "adapter_model.safetensors resolves to a file outside" in outs[bad].error
    assert outs[good].finish_reason == "length"


def test_a_read_or_copy_in_flight_for_an_unloaded_registration_is_never_used(base):
    model = model_of(base)
    old, new = (save_random_adapter(base / f"inflight-{i}", model.config, rank=4, seed=40 + i, alpha=4 + i,
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


@pytest.mark.slow
@pytest.mark.parametrize("max_loras", [1, 2])
def test_reload_under_the_same_name_keeps_admitted_requests_on_the_old_adapter(base, tmp_path, max_loras, peft_adapter):
    """unload + load of another directory under the same name while a request runs on the old:
    that request finishes with the old adapter's output, the next gets exactly what a clean
    engine gives with the new one; with a spare slot they run side by side, with one slot the
    new one waits for the old one's slot to be freed."""
    old, new = peft_adapter(tmp_path / "old", seed=1), peft_adapter(tmp_path / "new", seed=2)
    config = EngineConfig(max_batch_size=4, max_loras=max_loras, max_lora_rank=8, page_size=4)
    prompt = [3, 14, 15, 92, 65]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def alone(path):
        engine = engine_on_model(model_of(base), config, {"x": str(path)})
        request_id = engine.add_request(prompt, greedy, "x")
        return drain(engine)[request_id].token_ids

    old_tokens, new_tokens = alone(old), alone(new)
    assert old_tokens != new_tokens  # the adapters differ where the test looks

    engine = engine_on_model(model_of(base), config, {"x": str(old)})
    first = engine.add_request(prompt, greedy, "x")
    outs = {}
    while not engine.scheduler.running:
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    engine.unload_adapter("x")
    engine.load_adapter("x", str(new))
    second = engine.add_request(prompt, greedy, "x")
    outs |= {o.request_id: o for o in engine.step() if o.finished}  # the new adapter's read starts
    wait_for_reads(engine.adapters)
    for _ in range(3):             # read taken in, copied, admitted (into the spare slot, if any)
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    running = {r.request_id for r in engine.scheduler.running}
    assert running == ({first, second} if max_loras == 2 else {first})
    outs |= drain(engine)
    assert outs[first].token_ids == old_tokens
    assert outs[second].token_ids == new_tokens
    adapters = engine.adapters
    assert not adapters.refs and not adapters.retired
    assert len(adapters.free_slots) + len(adapters.resident) == max_loras
