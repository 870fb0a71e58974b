"""Tensor parallelism of mixture-of-experts models: 2 gloo ranks, each holding every expert's half of
the intermediate dimension (and half of each expert LoRA), give one process's logits and tokens
(fp32, CPU)."""

import random

import pytest
import torch

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
STEPS = 6
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# name -> (rank, alpha, use_rslora, target_modules, target_parameters)
ADAPTERS = {
    "both": (8, 16, False, ["q_proj", "o_proj"], EXPERTS),
    "experts": (4, 8, True, None, ["mlp.experts.down_proj"]),
}


def scenario(group, base_dir, adapter_paths, prompts):
    """Greedy decoding of `prompts` (one per adapter and one on the base model), requests joining at
    different steps; sharded when `group` is given, the last adapter written after sharding."""
    torch.set_num_threads(1)
    model = load_hf_dir(base_dir, dtype=torch.float32)
    full_config = model.config
    adapters = [load_adapter(path, full_config, name=name) for name, path in adapter_paths.items()]
    pool = LoraPool(full_config, max_loras=len(adapters), max_rank=16, dtype=torch.float32, device="cpu")
    pool.write(0, adapters[0])
    last = adapters[-1]
    if group is not None:
        tensor_parallel_(model, pool, group)
        last = shard_adapter(last, full_config, group.rank(), group.size())
    pool.write(len(adapters) - 1, last)
    attach_pool(model, pool)
    row_slots = list(range(len(adapters))) + [-1]
    kv = model.new_kv_cache(num_pages=64, page_size=PAGE_SIZE)
    free = list(range(64))
    random.Random(1).shuffle(free)
    seqs, pages, all_logits = [list(p) for p in prompts], [[] for _ in prompts], []
    for t in range(len(prompts) - 1 + STEPS):
        active = sorted((i for i in range(len(prompts)) if i <= t < i + STEPS), key=lambda i: i != t)
        query_lens, context_lens, tables, slots, ids = [], [], [], [], []
        for i in active:
            while len(pages[i]) * PAGE_SIZE < len(seqs[i]):
                pages[i].append(free.pop())
            q = len(seqs[i]) if i == t else 1
            query_lens.append(q)
            context_lens.append(len(seqs[i]))
            tables.append(pages[i])
            slots.append(row_slots[i])
            ids.extend(seqs[i][-q:])
        attn = AttnBatch.build(query_lens, context_lens, tables, PAGE_SIZE, int(t < len(prompts)))
        with torch.no_grad():
            logits = model(torch.tensor(ids), ForwardBatch(attn, LoraBatch.build(slots, query_lens), kv))
        all_logits.append(logits)
        for i, row in zip(active, logits):
            seqs[i].append(int(row.argmax()))
    return {"logits": all_logits, "tokens": seqs}


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_tensor_parallel_2_ranks_match_1(tmp_path, name, tiny_moe_model, make_moe_adapter):
    hf = tiny_moe_model(name, seed=3)
    hf.save_pretrained(tmp_path / "base")
    paths = {a: make_moe_adapter(hf, tmp_path / a, *spec, seed=i + 1) for i, (a, spec) in enumerate(ADAPTERS.items())}
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(5, 12))] for _ in range(len(ADAPTERS) + 1)]
    expect = scenario(None, tmp_path / "base", paths, prompts)
    got = run_parallel(scenario, 2, tmp_path / "base", paths, prompts, backend="gloo", timeout_s=120)
    for got_step, expect_step in zip(got["logits"], expect["logits"], strict=True):
        torch.testing.assert_close(got_step, expect_step, rtol=1e-5, atol=1e-5)
    assert got["tokens"] == expect["tokens"]
