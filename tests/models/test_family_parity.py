"""Model parity with HuggingFace transformers + PEFT on mixed-adapter batches (fp32), for a tiny
model of every family (tests/conftest.py TINY_FAMILIES, made by transformers' own class for it):
the model on its own, and the engine over a mixed batch with preemption."""

import random

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from punica.config import EngineConfig
from punica.factory import engine_on_model
from punica.lora.adapter import load_adapter
from punica.lora.batch import LoraBatch
from punica.lora.layers import attach_pool
from punica.lora.pool import LoraPool
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import load_hf_dir
from punica.models.sources import resolve_model_dir
from punica.ops.attention import AttnBatch

PAGE_SIZE = 4
STEPS = 16
# name -> (rank, alpha, targets, use_rslora)
ADAPTERS = {
    "all7": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    "qv": (4, 12, ("q_proj", "v_proj"), False),
    "mlp_rs": (16, 8, ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True),
}


@pytest.fixture
def make_adapters(make_peft_adapter):
    """The function `make_adapters(hf_model, tmp_path)`: the PEFT adapters of ADAPTERS, name -> path."""
    def make_adapters(hf_model, tmp_path):
        return {name: make_peft_adapter(hf_model, tmp_path / name, r=r, alpha=alpha, targets=targets,
                                        use_rslora=rs, seed=i + 1)
                for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())}

    return make_adapters


def punica_with_pool(model, paths):
    pool = LoraPool(model.config, max_loras=len(paths), max_rank=16, dtype=torch.float32, device="cpu")
    for slot, (name, path) in enumerate(paths.items()):
        pool.write(slot, load_adapter(path, model.config, name=name))
    attach_pool(model, pool)
    return {name: slot for slot, name in enumerate(paths)}


class PagedRun:
    """Drives the punica model request by request: prefill when a request starts, then decode."""

    def __init__(self, model, num_pages, seed):
        self.model, self.kv = model, model.new_kv_cache(num_pages, PAGE_SIZE)
        free = list(range(num_pages))
        random.Random(seed).shuffle(free)  # pages of a request are scattered through the cache
        self.free = free

    def step(self, requests, all_logits=False):
        """requests: list of (tokens, pages, slot, is_prefill); prefills first. Returns logits."""
        query_lens, context_lens, tables, slots, ids, num_prefills = [], [], [], [], [], 0
        for tokens, pages, slot, is_prefill in requests:
            while len(pages) * PAGE_SIZE < len(tokens):
                pages.append(self.free.pop())
            q = len(tokens) if is_prefill else 1
            num_prefills += is_prefill
            query_lens.append(q)
            context_lens.append(len(tokens))
            tables.append(pages)
            slots.append(slot)
            ids.extend(tokens[-q:])
        attn = AttnBatch.build(query_lens, context_lens, tables, PAGE_SIZE, num_prefills, all_logits=all_logits)
        lora = LoraBatch.build(slots, query_lens)
        return self.model(torch.tensor(ids), ForwardBatch(attn, lora, self.kv))


def hf_greedy(peft_model, prompt, adapter, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = peft_model(torch.tensor([tokens]), adapter_names=[adapter]).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def check_parity(peft_model, model, paths, prompts, logits_tol):
    slots = punica_with_pool(model, paths)
    names = list(paths) + ["__base__"]
    row_slots = [slots.get(n, -1) for n in names]

    # 1. one mixed prefill batch of equal-length prompts: every position's logits
    batch = torch.tensor([prompts[0][:8]] * len(names))
    with torch.no_grad():
        expect = peft_model(batch, adapter_names=names).logits
    run = PagedRun(model, num_pages=64, seed=0)
    got = run.step([(list(row), [], s, True) for row, s in zip(batch.tolist(), row_slots)], all_logits=True)
    torch.testing.assert_close(got, expect.reshape(-1, expect.shape[-1]), rtol=logits_tol, atol=logits_tol)
    # and the base rows really differ from the adapted ones (the adapters are not no-ops)
    assert not torch.allclose(expect[0], expect[-1], atol=1e-3)

    # 2. greedy decoding, requests joining at different steps: fused prefill + decode batches
    run = PagedRun(model, num_pages=128, seed=1)
    seqs = [list(p) for p in prompts]
    pages = [[] for _ in prompts]
    start = [2 * i for i in range(len(prompts))]
    generated = [[] for _ in prompts]
    for t in range(STEPS + start[-1]):
        active = [i for i in range(len(prompts)) if start[i] <= t < start[i] + STEPS]
        order = sorted(active, key=lambda i: start[i] != t)  # prefills first
        logits = run.step([(seqs[i], pages[i], row_slots[i % len(names)], start[i] == t) for i in order])
        for i, row in zip(order, logits):
            token = int(row.argmax())
            seqs[i].append(token)
            generated[i].append(token)
    for i, prompt in enumerate(prompts):
        assert generated[i] == hf_greedy(peft_model, prompt, names[i % len(names)], STEPS), f"request {i}"


@pytest.fixture
def family_setup(tmp_path, family, tiny_family_model, make_adapters, load_peft_model):
    """(checkpoint directory, adapter name -> path, PeftModel) of the tiny model of `family` saved
    with save_pretrained, with the adapters of ADAPTERS."""
    hf_model = tiny_family_model(family, seed=3)
    hf_model.save_pretrained(tmp_path / "base")
    paths = make_adapters(hf_model, tmp_path)
    return tmp_path / "base", paths, load_peft_model(hf_model, paths)


def test_tiny_model_matches_transformers_peft(family_setup):
    """Prompts of 8-19 tokens and 16 generated: past the sliding windows (8) of the families with one."""
    base, paths, peft_model = family_setup
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(8, 19))] for _ in range(6)]
    check_parity(peft_model, load_hf_dir(base, dtype=torch.float32), paths, prompts, logits_tol=1e-4)


def mixed_requests(n, seed):
    """n (prompt, adapter, max_tokens) requests cycling through the base model and ADAPTERS, prompts
    of 1-30 tokens: many longer than the sliding windows, and contexts up to 46 tokens."""
    rng = random.Random(seed)
    names = [None, *ADAPTERS]
    return [([rng.randrange(3, 128) for _ in range(rng.randint(1, 30))], names[i % len(names)], rng.randint(4, 16))
            for i in range(n)]


def check_engine_parity(engine, peft_model, run_all, greedy, hf_greedy, requests):
    # every adapter resident first: then when a request gets in depends on the KV cache alone, not
    # on how long a load takes, and the preemptions the tests assert happen on every machine
    run_all(engine, [([3], name, 1) for name in ADAPTERS], greedy)
    outs = run_all(engine, requests, greedy)
    for (prompt, adapter, max_tokens), out in zip(requests, outs):
        assert out.token_ids == hf_greedy(peft_model, prompt, adapter, max_tokens), (adapter, prompt)
    return [out.token_ids for out in outs]


@pytest.mark.slow
def test_engine_with_preemption_matches_transformers_peft(family_setup, run_all, greedy, hf_greedy):
    """18 requests over 3 adapter slots and the base model through a KV cache of 96 tokens: requests
    are preempted and recomputed, and every output is transformers + PEFT's greedy one."""
    base, paths, peft_model = family_setup
    config = EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=96)
    engine = engine_on_model(load_hf_dir(base, dtype=torch.float32), config, paths)
    check_engine_parity(engine, peft_model, run_all, greedy, hf_greedy, mixed_requests(18, seed=1))
    assert engine.stats().num_preemptions > 0


@pytest.mark.cuda
def test_cuda_graph_engine_matches_eager_and_transformers_peft(family_setup, run_all, greedy, hf_greedy):
    """On the GPU in fp32 (the Triton attention, rotary, norm and LoRA kernels): an engine replaying
    CUDA graphs and an eager one both give transformers + PEFT's tokens, with preemption."""
    base, paths, peft_model = family_setup
    requests = mixed_requests(20, seed=2)
    outputs = {}
    for eager in (True, False):
        model = load_hf_dir(base, dtype=torch.float32, device="cuda")
        engine = engine_on_model(model, EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=128,
                                                     enforce_eager=eager), paths)
        assert engine.executor.worker.uses_cuda_graphs != eager
        outputs[eager] = check_engine_parity(engine, peft_model, run_all, greedy, hf_greedy, requests)
        assert engine.stats().num_preemptions > 0
    assert outputs[False] == outputs[True]


@pytest.mark.slow
def test_smollm2_matches_transformers_peft(tmp_path, load_peft_model, make_adapters):
    model_dir = resolve_model_dir(None)
    hf_model = HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval()
    paths = make_adapters(hf_model, tmp_path)
    model = load_hf_dir(model_dir, dtype=torch.float32)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 14))] for _ in range(4)]
    check_parity(load_peft_model(hf_model, paths), model, paths, prompts, logits_tol=2e-3)
