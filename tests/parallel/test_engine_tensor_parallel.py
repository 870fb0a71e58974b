"""The Engine over 2 gloo ranks (this process is rank 0) against the Engine in one process."""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from punica.config import EngineConfig
from punica.engine.engine import Engine
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.models.loader import DummyWeights, dummy_model, load_hf_dir
from punica.parallel.executor import start_tensor_parallel

pytestmark = pytest.mark.slow

# name -> (rank, alpha, targets): row-parallel o/down and column-parallel projections, mixed ranks
ADAPTERS = {
    "attn": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mlp": (16, 8, ("gate_proj", "up_proj", "down_proj")),
    "mixed": (4, 12, ("v_proj", "o_proj", "up_proj", "down_proj")),
    "all": (8, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
}
# 4 adapters through 2 slots: slots are rewritten while requests run; a small KV cache preempts
CONFIG = EngineConfig(max_batch_size=6, max_loras=2, page_size=4, kv_cache_tokens=48)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_peft_adapter, tiny_llama):
    tmp = tmp_path_factory.mktemp("tp_engine")
    hf = tiny_llama(seed=11)  # 4 heads, 2 kv heads: one kv head per rank
    hf.save_pretrained(tmp / "base")
    paths = {name: str(make_peft_adapter(hf, tmp / name, r=r, alpha=alpha, targets=targets, seed=i + 1))
             for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())}
    return tmp / "base", paths


def workload():
    """(step at which it arrives, prompt, adapter, max_tokens): the same prompt under every adapter
    and the base model, and requests that join while others decode."""
    rng = random.Random(4)
    shared = [rng.randrange(3, 128) for _ in range(9)]
    names = [None, *ADAPTERS]
    requests = [(0, shared, name, 10) for name in names]
    for i in range(8):
        requests.append((1 + 2 * i, [rng.randrange(3, 128) for _ in range(rng.randint(2, 20))],
                         names[i % len(names)], rng.randint(3, 14)))
    return requests


def tensor_parallel_engine(source, paths, device="cpu", **start_kw) -> Engine:
    """The Engine over 2 ranks (this process is rank 0) of a checkpoint directory or DummyWeights."""
    return Engine(start_tensor_parallel(source, CONFIG, torch.float32, device, 2, **start_kw), None, CONFIG, paths)


def run_workload(engine):
    """Greedy token ids of every request, in workload order."""
    pending = sorted(enumerate(workload()), key=lambda item: item[1][0])
    ids, outs, step = {}, {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, adapter, max_tokens) = pending.pop(0)
            ids[i] = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                        adapter)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        step += 1
    return [outs[ids[i]].token_ids for i in range(len(ids))]


def check_dummy_two_ranks(expect, config, paths, device, rank0_kv_heads, **start_kw):
    """Two ranks, each generating only its shard of the dummy model (seed 7), give `expect`: the
    tokens one process gives with the same seed. And those tokens depend on the weights."""
    engine = tensor_parallel_engine(DummyWeights(config, seed=7), paths, device, **start_kw)
    try:
        got = run_workload(engine)
        assert engine.executor.worker.model.config.num_kv_heads == rank0_kv_heads
    finally:
        engine.close()
    assert got == expect
    assert len({tuple(tokens[:3]) for tokens in expect}) > len(expect) // 2


def test_two_ranks_match_one_process(setup):
    base, paths = setup
    expect = run_workload(engine_on_model(load_hf_dir(base, torch.float32), CONFIG, paths))
    engine = tensor_parallel_engine(base, paths, timeout_s=60)
    try:
        got = run_workload(engine)
        assert engine.executor.worker.runner.kv_cache.pages.shape[-2] == 1  # rank 0 caches its one kv head
        assert engine.stats().num_preemptions > 0
        assert engine.adapters.num_loads == len(ADAPTERS)  # every adapter read once, written into 2 slots
    finally:
        engine.close()
    assert got == expect
    base_tokens = expect[0]
    for adapted in expect[1:len(ADAPTERS) + 1]:  # each adapter changes the shared prompt's output
        assert adapted != base_tokens
    assert [p.exitcode for p in engine.executor.workers.processes] == [0]  # the worker left when told to
    assert mp.active_children() == []


def test_random_weights_two_ranks_match_one_process(setup, punica_config, tiny_llama):
    """Each rank generates only its shard of the dummy model, and the shards add up to the model
    one process generates with the same seed (the same tokens over mixed adapters)."""
    _, paths = setup
    config = punica_config(tiny_llama())
    expect = run_workload(engine_on_model(dummy_model(config, torch.float32, seed=7), CONFIG, paths))
    check_dummy_two_ranks(expect, config, paths, "cpu", rank0_kv_heads=1, timeout_s=60)


def test_fp8_random_weights_two_ranks_match_one_process(setup, punica_config, tiny_llama):
    """quantization="fp8" reaches every rank: each quantizes its shard of the dummy weights, whose
    rows and scales are those of the model one process quantizes."""
    _, paths = setup
    config = punica_config(tiny_llama())
    expect = run_workload(engine_on_model(dummy_model(config, torch.float32, seed=7, quantization="fp8"), CONFIG,
                                          paths))
    check_dummy_two_ranks(expect, config, paths, "cpu", rank0_kv_heads=1, timeout_s=60, quantization="fp8")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_two_gpus_match_one_on_a_7b_shape(tmp_path, quantization):
    """On two GPUs (NCCL, CUDA graphs): a Llama-2-7B-shaped model of random weights over 2 ranks
    gives the tokens one GPU gives, over mixed adapters rewritten through 2 slots. fp32 (not
    TF32): the ranks' partial sums differ from one GPU's only in rounding order, far below the
    gaps between random logits; in bf16 that rounding flips near-tied greedy tokens."""
    from punica.config import preset_config
    from punica.lora.dummy import save_random_adapter

    config = preset_config("llama-2-7b")
    adapters = {"attn": (8, ("q", "k", "v", "o")), "mlp": (16, ("gate", "up", "down")),
                "mixed": (4, ("v", "o", "up", "down")), "all": (16, ("q", "k", "v", "o", "gate", "up", "down"))}
    paths = {name: str(save_random_adapter(tmp_path / name, config, rank, seed=i, projections=projections))
             for i, (name, (rank, projections)) in enumerate(adapters.items())}
    engine = engine_on_model(dummy_model(config, torch.float32, "cuda", seed=7, quantization=quantization), CONFIG,
                             paths)
    expect = run_workload(engine)
    del engine  # frees its KV cache at once (no reference cycle)
    torch.cuda.empty_cache()
    check_dummy_two_ranks(expect, config, paths, "cuda", rank0_kv_heads=16, quantization=quantization)


def test_a_moe_model_over_two_ranks_matches_one_process(tmp_path, tiny_moe_model, make_moe_adapter):
    """Qwen3-MoE through the whole tensor-parallel engine (each rank every expert's half, adapters on
    attention, on the experts or both, rewritten in 2 slots): one process's tokens."""
    hf = tiny_moe_model("qwen3_moe", seed=5)
    hf.save_pretrained(tmp_path / "base")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    specs = {"attn": (8, 16, False, ["q_proj", "o_proj"], None), "mlp": (4, 8, True, None, experts),
             "mixed": (8, 32, False, ["v_proj"], ["mlp.experts.down_proj"]),
             "all": (16, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"], experts)}
    assert list(specs) == list(ADAPTERS)  # the names the workload asks for
    paths = {name: str(make_moe_adapter(hf, tmp_path / name, *spec, seed=i + 1))
             for i, (name, spec) in enumerate(specs.items())}
    expect = run_workload(engine_on_model(load_hf_dir(tmp_path / "base", torch.float32), CONFIG, paths))
    engine = tensor_parallel_engine(tmp_path / "base", paths, timeout_s=60)
    try:
        got = run_workload(engine)
    finally:
        engine.close()
    assert got == expect
    assert len({tuple(tokens) for tokens in expect[:len(specs) + 1]}) == len(specs) + 1, "each adapter matters"


def test_killed_worker_fails_every_later_request_loudly(setup):
    base, paths = setup
    engine = tensor_parallel_engine(base, paths, timeout_s=600)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    try:
        running = engine.add_request([5, 6, 7], params, "attn")
        while not engine.step():  # until it runs (its adapter is loaded) and has a token
            pass
        unloaded = engine.add_request([4, 2], params, "mlp")  # its adapter's shard cannot reach rank 1 any more
        worker = engine.executor.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        failed = {}
        later = engine.add_request([8, 9], params, None)
        start = time.monotonic()
        while engine.has_unfinished():
            failed.update((o.request_id, o) for o in engine.step() if o.finished)
        assert time.monotonic() - start < 120  # found dead, not timed out (600 s)
        for request_id in (running, later, unloaded):
            assert failed[request_id].finish_reason == "error"
            assert re.search(r"rank 1 \(pid \d+\) exited with code -9", failed[request_id].error)
    finally:
        engine.close()
    assert mp.active_children() == []


def test_cli_generate_with_two_ranks(setup, tmp_path, make_peft_adapter, tiny_llama):
    """`punica generate --tensor-parallel-size 2` prints what LLM prints in one process."""
    from punica import LLM
    from punica.models.sources import resolve_model_dir

    tokenizer_dir = resolve_model_dir(None)  # the embedded model's tokenizer, on a tiny model of its vocabulary
    hf = tiny_llama(seed=2, vocab_size=49152)
    hf.save_pretrained(tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "base" / name)
    adapter = make_peft_adapter(hf, tmp_path / "ad", r=8, alpha=32, seed=3)
    prompt = "The quick brown fox"
    llm = LLM(model=str(tmp_path / "base"), adapters={"ad": str(adapter)}, device="cpu")
    expect = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), adapter="ad")[0]
    assert len(expect.token_ids) == 8 and expect.text.strip()

    result = subprocess.run(
        [sys.executable, "-m", "punica.cli", "generate", "--model", str(tmp_path / "base"), "--prompt", prompt,
         "--raw", "--max-tokens", "8", "--adapter", f"ad={adapter}", "--use", "ad", "--device", "cpu",
         "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expect.text + "\n"


RANK_0_THEN_DIE = """
import os, signal, sys, torch
from punica.config import EngineConfig
from punica.parallel.executor import start_tensor_parallel
executor = start_tensor_parallel(sys.argv[1], EngineConfig(kv_cache_tokens=64), torch.float32, "cpu", 2)
print(executor.workers.processes[0].pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind
"""


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False


def test_workers_exit_when_rank_0_dies(setup):
    base, _ = setup
    result = subprocess.run([sys.executable, "-c", RANK_0_THEN_DIE, str(base)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    worker_pid = int(result.stdout)
    deadline = time.monotonic() + 10
    while running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(worker_pid)
