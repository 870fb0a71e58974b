"""Tensor parallelism: 2 gloo ranks give the same logits and tokens as one process (fp32, CPU)."""

import random
import time

import pytest
import torch
import torch.multiprocessing as mp

from punica.lora.adapter import load_adapter
from punica.lora.batch import LoraBatch
from punica.lora.layers import attach_pool
from punica.lora.pool import LoraPool
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.ops.attention import AttnBatch
from punica.parallel.launcher import run_parallel
from punica.parallel.tensor_parallel import shard_adapter, tensor_parallel_

pytestmark = pytest.mark.slow

PAGE_SIZE = 4
STEPS = 8
# name -> (rank, alpha, targets, use_rslora); every projection is covered, o and down included
ADAPTERS = {
    "attn": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    "mlp_rs": (16, 8, ("gate_proj", "up_proj", "down_proj"), True),
    "mixed": (4, 12, ("v_proj", "o_proj", "up_proj", "down_proj"), False),
}


def step(model, kv, requests, free_pages, all_logits=False):
    """requests: list of (tokens, pages, slot, is_prefill), prefills first. Returns logits."""
    query_lens, context_lens, tables, slots, ids = [], [], [], [], []
    for tokens, pages, slot, is_prefill in requests:
        while len(pages) * PAGE_SIZE < len(tokens):
            pages.append(free_pages.pop())
        q = len(tokens) if is_prefill else 1
        query_lens.append(q)
        context_lens.append(len(tokens))
        tables.append(pages)
        slots.append(slot)
        ids.extend(tokens[-q:])
    num_prefills = sum(r[3] for r in requests)
    attn = AttnBatch.build(query_lens, context_lens, tables, PAGE_SIZE, num_prefills, all_logits=all_logits)
    return model(torch.tensor(ids), ForwardBatch(attn, LoraBatch.build(slots, query_lens), kv))


def scenario(group, base_dir, adapter_paths, prompts, kv_cache_dtype="auto"):
    """Build the model and pool, shard them when `group` is given, run a mixed batch and greedy decoding."""
    torch.set_num_threads(1)
    model = load_hf_dir(base_dir, dtype=torch.float32)
    full_config = model.config
    adapters = [load_adapter(path, full_config, name=name) for name, path in adapter_paths.items()]
    pool = LoraPool(full_config, max_loras=len(adapters), max_rank=16, dtype=torch.float32, device="cpu")
    for slot, adapter in enumerate(adapters[:-1]):
        pool.write(slot, adapter)
    last = adapters[-1]
    if group is not None:
        tensor_parallel_(model, pool, group)  # shards the adapters already in the pool
        last = shard_adapter(last, full_config, group.rank(), group.size())  # and one written after
    pool.write(len(adapters) - 1, last)
    attach_pool(model, pool)
    row_slots = list(range(len(adapters))) + [-1]  # every adapter, then a base-model row

    # 1. one mixed prefill batch, every position's logits
    kv = model.new_kv_cache(num_pages=64, page_size=PAGE_SIZE, kv_cache_dtype=kv_cache_dtype)
    free = list(range(64))
    random.Random(0).shuffle(free)
    with torch.no_grad():
        prefill = step(model, kv, [(list(prompts[0][:8]), [], s, True) for s in row_slots], free,
                       all_logits=True)

    # 2. greedy decoding with requests joining every other step: fused prefill + decode batches
    kv = model.new_kv_cache(num_pages=96, page_size=PAGE_SIZE, kv_cache_dtype=kv_cache_dtype)
    free = list(range(96))
    random.Random(1).shuffle(free)
    seqs, pages = [list(p) for p in prompts], [[] for _ in prompts]
    start = [2 * i for i in range(len(prompts))]
    decode_logits = []
    for t in range(STEPS + start[-1]):
        active = sorted((i for i in range(len(prompts)) if start[i] <= t < start[i] + STEPS),
                        key=lambda i: start[i] != t)  # prefills first
        with torch.no_grad():
            logits = step(model, kv, [(seqs[i], pages[i], row_slots[i % len(row_slots)], start[i] == t)
                                      for i in active], free)
        decode_logits.append(logits)
        for i, row in zip(active, logits):
            seqs[i].append(int(row.argmax()))
    return {"prefill": prefill, "decode": decode_logits, "tokens": seqs, "kv_heads": kv.pages.shape[-2],
            "kv_dtype": kv.pages.dtype}


# Llama; Qwen2 with its q/k/v bias split with the heads, tied embeddings and a sliding-window layer;
# Qwen3 with its per-head q/k norms replicated, over an fp8 KV cache (each rank's pages and scales
# of its kv heads: a scale per (token, kv head) quantizes a shard's rows as the whole model's);
# Gemma 2 with its sandwich norms, softcaps and local layers
@pytest.mark.parametrize("tp_family,kv_cache_dtype", [("llama", "auto"), ("qwen2-sliding", "auto"), ("qwen3", "fp8"),
                                                      ("gemma2", "auto")])
def test_tensor_parallel_2_ranks_match_1(tmp_path, make_peft_adapter, tiny_family_model, tp_family, kv_cache_dtype):
    hf_model = tiny_family_model(tp_family, seed=3)  # 4 heads, 2 kv heads, intermediate 96
    hf_model.save_pretrained(tmp_path / "base")
    paths = {name: make_peft_adapter(hf_model, tmp_path / name, r=r, alpha=alpha, targets=targets,
                                     use_rslora=rs, seed=i + 1)
             for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(8, 15))] for _ in range(5)]  # past window 8

    expect = scenario(None, tmp_path / "base", paths, prompts, kv_cache_dtype)
    got = run_parallel(scenario, 2, tmp_path / "base", paths, prompts, kv_cache_dtype, backend="gloo", timeout_s=120)

    assert (expect["kv_heads"], got["kv_heads"]) == (2, 1)  # each rank caches its own kv head
    assert got["kv_dtype"] == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
    torch.testing.assert_close(got["prefill"], expect["prefill"], rtol=1e-5, atol=1e-5)
    for got_step, expect_step in zip(got["decode"], expect["decode"], strict=True):
        torch.testing.assert_close(got_step, expect_step, rtol=1e-5, atol=1e-5)
    assert got["tokens"] == expect["tokens"]
    # the adapters are not no-ops: each adapted row differs from the base row
    rows = expect["prefill"].reshape(len(ADAPTERS) + 1, 8, -1)
    for adapted in rows[:-1]:
        assert not torch.allclose(adapted, rows[-1], atol=1e-3)


def fail_on_rank_1(group):
    if group.rank() == 1:
        raise ValueError("rank 1 fails")
    time.sleep(600)  # rank 0 would outlive the run unless the launcher terminates it


def test_failing_rank_raises_and_ranks_are_cleaned_up():
    with pytest.raises(Exception, match="rank 1 fails"):
        run_parallel(fail_on_rank_1, 2, backend="gloo", timeout_s=60)
    assert mp.active_children() == []


def sleep_forever(group):
    time.sleep(600)


def test_hung_ranks_time_out_and_are_terminated():
    with pytest.raises(TimeoutError):
        run_parallel(sleep_forever, 2, backend="gloo", timeout_s=5)
    assert mp.active_children() == []
