"""On-demand adapters in an engine: many more adapters than GPU slots, each request on its own;
adapters broken, missing or unloaded fail only their requests; run-time unload and reload."""

import random

import pytest
import torch
from on_demand import adapter_dirs, drain, edit_config, model_of, names, reference_greedy, wait_for_reads

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.adapter_config import AdapterError
from punica.lora.dummy import save_random_adapter
from punica.lora.pool import LoraPool


@pytest.mark.slow
@pytest.mark.parametrize("host_rows", [None, 3])
def test_200_adapters_through_8_slots_each_request_gets_its_own(base_dir, host_rows):
    """With the default host tier (every adapter fits) and with one of 3 adapters, whose rows
    are reused by later reads (so adapters are read again)."""
    model = model_of(base_dir)
    paths = adapter_dirs(base_dir, model, 210)
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
    reference = model_of(base_dir)
    for i in check:
        assert outs[ids[i]].token_ids == reference_greedy(reference, paths[names[i]], prompts[i], 3), names[i]
    assert engine.allocator.num_used == 0 and not engine.adapters.refs


def test_corrupt_or_missing_adapter_fails_only_its_requests(base_dir):
    model = model_of(base_dir)
    paths = adapter_dirs(base_dir, model, 3)
    broken = base_dir / "broken"
    save_random_adapter(broken, model.config, rank=4, seed=9)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    vanished = base_dir / "vanished"
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
        engine.load_adapter("nowhere", str(base_dir / "nowhere"))


def test_unload_while_running_finishes_admitted_and_fails_queued(base_dir):
    model = model_of(base_dir)
    paths = adapter_dirs(base_dir, model, 2)
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


def test_a_rank_over_the_pool_is_refused_at_load_not_per_request(base_dir, tmp_path, peft_adapter):
    engine = engine_on_model(model_of(base_dir), EngineConfig(max_loras=2, max_lora_rank=16))
    with pytest.raises(ValueError, match="rank 512, over this engine's max_lora_rank 16"):
        engine.load_adapter("wide", str(peft_adapter(tmp_path / "wide", r=512)))
    assert "wide" not in engine.adapters.registry


def test_an_adapter_broken_after_registration_fails_in_its_read_alone(base_dir, tmp_path, peft_adapter):
    """lora_alpha 1e300 written after registration: the read (worker thread) refuses it, its
    requests fail with the message, the co-batched ones finish as if it did not exist, and the
    manager's slots stay whole."""
    model = model_of(base_dir)
    paths = adapter_dirs(base_dir, model, 2)
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
    reference = model_of(base_dir)
    for rid, name in good.items():
        assert outs[rid].token_ids == reference_greedy(reference, paths[name], prompt, 4), name
    assert engine.adapters.num_load_failures == 1
    again = engine.add_request(prompt, params, "t0")
    assert drain(engine)[again].token_ids == outs[next(iter(good))].token_ids
    adapters = engine.adapters
    assert not adapters.refs and len(adapters.free_slots) + len(adapters.resident) == 2


def test_an_adapter_inside_an_adapter_dir_reads_no_file_outside_it(base_dir, tmp_path):
    """Its config is checked at registration and its weights at the read (on the worker thread),
    each as opened: a link out, even one made after the registration, fails its requests alone."""
    model = model_of(base_dir)
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


@pytest.mark.slow
@pytest.mark.parametrize("max_loras", [1, 2])
def test_reload_under_the_same_name_keeps_admitted_requests_on_the_old_adapter(base_dir, tmp_path, max_loras,
                                                                                peft_adapter):
    """unload + load of another directory under the same name while a request runs on the old:
    that request finishes with the old adapter's output, the next gets exactly what a clean
    engine gives with the new one; with a spare slot they run side by side, with one slot the
    new one waits for the old one's slot to be freed."""
    old, new = peft_adapter(tmp_path / "old", seed=1), peft_adapter(tmp_path / "new", seed=2)
    config = EngineConfig(max_batch_size=4, max_loras=max_loras, max_lora_rank=8, page_size=4)
    prompt = [3, 14, 15, 92, 65]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def alone(path):
        engine = engine_on_model(model_of(base_dir), config, {"x": str(path)})
        request_id = engine.add_request(prompt, greedy, "x")
        return drain(engine)[request_id].token_ids

    old_tokens, new_tokens = alone(old), alone(new)
    assert old_tokens != new_tokens  # the adapters differ where the test looks

    engine = engine_on_model(model_of(base_dir), config, {"x": str(old)})
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
