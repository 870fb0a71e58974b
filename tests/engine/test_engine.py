"""The engine against transformers+PEFT per request, with preemption, sampling and bad input."""

import gc
import shutil
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.pool import slot_bytes
from punica.models.loader import load_hf_dir
from punica.models.quantized import Linear
from punica.ops.linear import (
    CPU_SKINNY_BLOCK,
    FEW_ROWS_PATHS,
    MAX_CPU_SKINNY_ROWS,
    MIN_CPU_PACKED_ROWS,
    cpu_packing_available,
)


@pytest.mark.slow
def test_mixed_adapters_join_and_leave_match_transformers_peft(setup, greedy, hf_greedy, make_engine, run_all,
                                                               workload):
    engine = make_engine(setup, max_batch_size=6, page_size=4)
    requests = workload(44, seed=0)
    outs = run_all(engine, requests, greedy)
    peft_model = setup[2]
    for (prompt, adapter, max_tokens), out in zip(requests, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert out.token_ids == hf_greedy(peft_model, prompt, adapter, max_tokens), (adapter, prompt)
    assert engine.allocator.num_used == 0


def test_preemption_loses_and_repeats_nothing(setup, greedy, make_engine, run_all, workload):
    requests = workload(24, seed=1)
    ample = run_all(make_engine(setup, max_batch_size=8, page_size=4), requests, greedy)
    tight = make_engine(setup, max_batch_size=8, page_size=4, kv_cache_tokens=96)
    outs = run_all(tight, requests, greedy)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    assert tight.allocator.num_free == tight.allocator.num_pages


@pytest.mark.skipif(not cpu_packing_available(), reason="no oneDNN fp32 reorder on this CPU")
def test_cpu_weights_are_packed_when_memory_allows(setup, greedy, make_engine, run_all, workload, monkeypatch):
    """On a CPU every fp32 projection gets a packed copy (punica.ops.linear) and the latency budget
    sees no row blocks; with no memory to spare, none does and the budget pads W @ x^T's blocks. The
    tokens are the same."""
    requests = workload(12, seed=4)
    packed = make_engine(setup, max_batch_size=4, page_size=4)
    monkeypatch.setattr("punica.engine.runner.available_memory", lambda: 0)
    plain = make_engine(setup, max_batch_size=4, page_size=4)
    for engine, is_packed in ((packed, True), (plain, False)):
        runner = engine.executor.worker.runner
        linears = [module for module in runner.model.modules() if isinstance(module, Linear)]
        assert linears and all((linear.packed is not None) == is_packed for linear in linears)
        assert (runner.packed_bytes > 0) == is_packed
        assert engine.executor.row_sizes == (() if is_packed else (CPU_SKINNY_BLOCK, MAX_CPU_SKINNY_ROWS))
    assert [o.token_ids for o in run_all(packed, requests, greedy)] == [o.token_ids for o in run_all(plain, requests,
                                                                                                       greedy)]


@pytest.mark.skipif(not cpu_packing_available(), reason="no oneDNN fp32 reorder on this CPU")
@pytest.mark.parametrize("path", FEW_ROWS_PATHS)
def test_cpu_gemms_of_few_rows_take_the_path_chosen_for_their_shape(setup, greedy, make_engine, run_all, workload,
                                                                    monkeypatch, path):
    """The runner gives each packed projection the path chosen for its shape in this process (here
    set beforehand, so nothing is timed); the tokens are those of the unpacked engine."""
    requests = workload(8, seed=5)
    monkeypatch.setattr("punica.engine.runner.available_memory", lambda: 0)
    plain = make_engine(setup, max_batch_size=4, page_size=4)
    shapes = {tuple(m.weight.shape) for m in plain.executor.worker.runner.model.modules() if isinstance(m, Linear)}
    monkeypatch.undo()  # memory to pack with again
    paths = (path,) * (MIN_CPU_PACKED_ROWS - 1)  # at every few-row count
    monkeypatch.setattr("punica.ops.linear.CHOSEN_PATHS", dict.fromkeys(shapes, paths))
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    linears = [m for m in engine.executor.worker.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(linear.packed.few_rows == paths for linear in linears)
    assert [o.token_ids for o in run_all(engine, requests, greedy)] == [o.token_ids for o in run_all(plain, requests,
                                                                                                       greedy)]


def test_max_lora_bytes_caps_the_adapter_slots(setup, greedy, make_engine, run_all, workload):
    """Three adapters through a pool whose bytes hold two slots: the engine reports 2 slots and gives the
    tokens of an engine of max_loras=2."""
    requests = workload(12, seed=3)
    two = make_engine(setup, max_batch_size=4, page_size=4, max_loras=2)
    one = slot_bytes(two.model_config, two.config.max_lora_rank, torch.float32)
    capped = make_engine(setup, max_batch_size=4, page_size=4, max_loras=8, max_lora_bytes=5 * one // 2)
    assert capped.adapter_snapshot()["gpu_slots"]["total"] == 2
    assert [o.token_ids for o in run_all(capped, requests, greedy)] == [o.token_ids for o in run_all(two, requests,
                                                                                                       greedy)]


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(setup, hf_greedy, make_engine, run_all,
                                                                       workload):
    requests = workload(16, seed=2)

    def sampled(max_tokens):
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                              repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                              seed=1234, ignore_eos=True)

    first = run_all(make_engine(setup, max_batch_size=8, page_size=4), requests, sampled)
    tight = make_engine(setup, max_batch_size=3, page_size=4, kv_cache_tokens=64)
    second = run_all(tight, requests, sampled)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert any(o.token_ids != hf_greedy(setup[2], p, a, m) for o, (p, a, m) in zip(first, requests))


def test_logprobs_and_stop_token_ids(setup, make_engine, run_all):
    engine = make_engine(setup)
    prompt = [5, 6, 7, 8]
    out = run_all(engine, [(prompt, "a", 12)],
                  lambda m: SamplingParams(max_tokens=m, temperature=0, logprobs=True, ignore_eos=True))[0]
    assert len(out.logprobs) == 12 and all(lp <= 0 for lp in out.logprobs)
    stop_at = out.token_ids[3]
    first = out.token_ids.index(stop_at)
    stopped = run_all(engine, [(prompt, "a", 12)], lambda m: SamplingParams(
        max_tokens=m, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[:first + 1]


@pytest.mark.parametrize("bad, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5] * 300), "context"),
    (dict(adapter="nope"), "unknown adapter 'nope'"),
    (dict(prompt=[1, 999]), "token ids"),
])
def test_bad_request_fails_alone(setup, bad, message, greedy, make_engine):
    engine = make_engine(setup, max_batch_size=4)
    good = engine.add_request([1, 2, 3], greedy(5), "a")
    engine.step()
    kwargs = dict(prompt=[4, 5, 6], params=greedy(3), adapter=None) | bad
    with pytest.raises(ValueError, match=message):
        engine.add_request(**kwargs)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [good] and len(outs[0].token_ids) == 5


def test_an_adapter_with_overflowing_weights_fails_only_its_own_requests(setup, tmp_path, greedy, hf_greedy, run_all):
    """A startup adapter whose weights are all 1e30 (finite, in PEFT's format) is refused by its
    read: its requests fail with the reason, a co-batched request on a good adapter gets its clean
    output, and the engine keeps serving."""
    base, paths, peft_model = setup
    huge = Path(shutil.copytree(paths["a"], tmp_path / "huge"))
    weights = load_file(huge / "adapter_model.safetensors")
    save_file({key: torch.full_like(tensor, 1e30) for key, tensor in weights.items()},
              huge / "adapter_model.safetensors")
    engine = engine_on_model(load_hf_dir(base, dtype=torch.float32), EngineConfig(max_batch_size=4),
                    paths | {"huge": str(huge)})
    prompt = [5, 6, 7, 8]
    bad = engine.add_request(prompt, greedy(6), "huge")
    good = engine.add_request(prompt, greedy(6), "a")
    outs = {}
    while engine.has_unfinished():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert outs[bad].finish_reason == "error" and outs[bad].error.startswith(f"LoRA adapter {huge}: layer 0 ")
    assert "gain" in outs[bad].error and "over the limit" in outs[bad].error
    assert outs[good].finish_reason == "length" and outs[good].token_ids == hf_greedy(peft_model, prompt, "a", 6)
    assert engine.adapters.num_load_failures == 1
    assert run_all(engine, [(prompt, "c", 4)], greedy)[0].token_ids == hf_greedy(peft_model, prompt, "c", 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-3), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=2), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(frequency_penalty=3), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("reload", [False, True])
def test_a_request_preempted_after_its_adapter_is_unloaded_fails_and_never_runs_on_a_reload(setup, reload, greedy,
                                                                                            hf_greedy, make_engine):
    """Requests running on "a" when it is unloaded (and, with `reload`, loaded again from another
    adapter's directory) finish if they stay in the batch; one preempted afterwards fails at once
    with finish_reason "error" instead of waiting for ever or resuming on the new registration.
    A request queued after the reload runs on the new adapter."""
    base, paths, peft_model = setup
    engine = make_engine(setup, max_batch_size=3, page_size=4, kv_cache_tokens=48)
    ids = [engine.add_request([3 + i] * 8, greedy(20), "a") for i in range(3)]
    outs = {}
    while len(engine.running_request_ids()) < 3:
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    engine.unload_adapter("a")
    if reload:
        engine.load_adapter("a", paths["c"])
    preemptions = engine.stats().num_preemptions
    later = engine.add_request([5, 6, 7], greedy(4), "a") if reload else None
    deadline = time.monotonic() + 60  # the reload's read runs on a worker thread, as long as it takes
    while engine.has_unfinished() and time.monotonic() < deadline:
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert not engine.has_unfinished(), "a request waits for ever"
    assert engine.stats().num_preemptions > preemptions
    reasons = [outs[i].finish_reason for i in ids]
    assert "error" in reasons and set(reasons) <= {"length", "error"}
    assert all("unloaded" in outs[i].error for i in ids if outs[i].finish_reason == "error")
    if reload:
        assert outs[later].token_ids == hf_greedy(peft_model, [5, 6, 7], "c", 4)
    assert engine.allocator.num_used == 0 and not engine.adapters.refs


def test_a_step_that_can_run_nothing_sleeps_so_adapter_reads_get_the_gil(setup, greedy, make_engine, monkeypatch):
    """Every queued request waits for its adapter's read: `step` sleeps (releasing the GIL to the
    reader threads) instead of returning at once, so a caller's tight `while has_unfinished():
    step()` loop cannot starve the reads; the request then runs as usual."""
    from punica.engine import core as engine_module
    from punica.lora.manager import AdapterManager

    read_may_finish = threading.Event()
    real_read = AdapterManager._read

    def slow_read(self, registration, row):
        assert read_may_finish.wait(60), "the test never let the read finish"
        return real_read(self, registration, row)

    monkeypatch.setattr(AdapterManager, "_read", slow_read)
    sleeps, real_sleep = [], time.sleep
    monkeypatch.setattr(engine_module.time, "sleep", lambda s: sleeps.append(s) or real_sleep(s))
    engine = make_engine(setup, max_batch_size=4)
    request_id = engine.add_request([5, 6, 7], greedy(3), "b")
    assert engine.step() == [] and engine.step() == [], "nothing can run while the read is held"
    assert sleeps == [engine_module.STALLED_WAIT_S] * 2
    read_may_finish.set()
    outs = [o for outputs in engine.steps() for o in outputs if o.finished]
    assert [o.request_id for o in outs] == [request_id] and len(outs[0].token_ids) == 3


def test_abort_frees_pages(setup, greedy, make_engine):
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    rid = engine.add_request(list(range(1, 30)), greedy(20), "b")
    other = engine.add_request([1, 2], greedy(4), None)
    engine.step()
    assert engine.allocator.num_used > 0
    out = engine.abort(rid)
    assert out.finished and out.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0 and engine.abort(other) is None


def test_a_dropped_engine_frees_its_kv_cache_without_the_garbage_collector(setup, greedy, make_engine, run_all,
                                                                           workload):
    engine = make_engine(setup, kv_cache_tokens=256)
    run_all(engine, workload(4, seed=2), greedy)
    kv_cache = weakref.ref(engine.executor.worker.runner.kv_cache)
    gc.disable()
    try:
        del engine
        assert kv_cache() is None, "a reference cycle keeps the engine alive"
    finally:
        gc.enable()


def test_a_new_engine_on_the_model_of_a_dropped_one_lets_its_adapter_pool_go_first(setup, monkeypatch, greedy,
                                                                                      run_all, workload):
    """A MoE model's pool can take tens of GB: the dropped engine's must be gone before the next is
    allocated, though the model's layers pointed at it."""
    import punica.engine.worker as worker
    model = load_hf_dir(setup[0], dtype=torch.float32)
    first = engine_on_model(model, EngineConfig(kv_cache_tokens=256), setup[1])
    run_all(first, workload(4, seed=5), greedy)
    old = weakref.ref(first.executor.adapter_slots.buffer)
    del first
    alive_at_allocation = []

    class Pool(worker.LoraPool):
        def __init__(self, *args, **kwargs):
            alive_at_allocation.append(old() is not None)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(worker, "LoraPool", Pool)
    second = engine_on_model(model, EngineConfig(kv_cache_tokens=256), setup[1])
    assert alive_at_allocation == [False]
    assert [o.token_ids for o in run_all(second, workload(4, seed=5), greedy)]


def test_the_server_and_the_cluster_worker_use_the_engines_methods_not_its_parts(setup, make_engine):
    """Nothing outside punica.engine reaches into an engine's adapter manager, executor, scheduler,
    allocator, core or output processor; what they need, Engine's methods give."""
    import re

    import punica

    root = Path(punica.__file__).parent
    parts = re.compile(r"(?<!punica\.)\bengine\.(adapters|executor|scheduler|allocator|core|outputs)\b")
    outside = [p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "engine"]
    offenders = [f"{p.relative_to(root)}:{i}" for p in outside
                 for i, line in enumerate(p.read_text().splitlines(), 1) if parts.search(line)]
    assert not offenders
    engine = make_engine(setup)
    assert engine.model_config is engine.executor.model_config
    assert engine.on_cpu == (engine.adapters.device.type == "cpu")
    assert engine.adapter_snapshot() == engine.adapters.snapshot() and engine.held_adapters() == []
