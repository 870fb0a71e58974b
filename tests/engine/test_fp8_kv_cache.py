"""The engine with an fp8 KV cache (kv_cache_dtype "fp8"): mixed adapters and preemption over the
tiny Llama, and the KV budget in tokens for the same bytes."""

import pytest
import torch

from punica.config import EngineConfig, preset_config
from punica.engine.worker import kv_cache_pages
from punica.factory import engine_on_model
from punica.models.loader import load_hf_dir
from punica.ops.fp8 import FP8_DTYPE
from punica.ops.kv_cache import kv_bytes_per_token


@pytest.mark.slow
def test_fp8_cache_with_mixed_adapters_and_preemption(setup, greedy, make_engine, run_all, workload):
    """Every request of a mixed workload finishes under preemption, and the pages all come back.

    Greedy tokens against the fp32 cache: e4m3 perturbs each cached K and V element by up to
    2^-4 relative, so a step whose top two logits lie closer than that perturbation moves them
    may pick the other token, and a request that diverges once continues differently. So: most
    requests' first tokens agree, and most of all tokens agree. A model whose logits are
    near-ties (random weights have some) can fail it with a faithful cache; the bounds leave room
    for the tiny model's (here 23 of 24 first tokens and 82% of all tokens agree). Preemption
    itself changes nothing: an fp8 request recomputed after preemption rewrites the same e4m3
    values and scales (each row's quantization depends only on its own K or V), so the tight run
    equals the ample one token for token.
    """
    requests = workload(24, seed=1)
    exact = run_all(make_engine(setup, max_batch_size=8, page_size=4), requests, greedy)
    ample = run_all(make_engine(setup, max_batch_size=8, page_size=4, kv_cache_dtype="fp8"), requests, greedy)
    tight = make_engine(setup, max_batch_size=8, page_size=4, kv_cache_tokens=96, kv_cache_dtype="fp8")
    assert tight.executor.worker.runner.kv_cache.pages.dtype == FP8_DTYPE
    outs = run_all(tight, requests, greedy)
    assert tight.stats().num_preemptions > 0
    assert all(o.finish_reason == "length" and len(o.token_ids) == m for o, (_, _, m) in zip(outs, requests))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    assert tight.allocator.num_free == tight.allocator.num_pages
    first = sum(o.token_ids[0] == e.token_ids[0] for o, e in zip(outs, exact)) / len(requests)
    pairs = [(a, b) for o, e in zip(outs, exact) for a, b in zip(o.token_ids, e.token_ids)]
    assert first >= 0.9 and sum(a == b for a, b in pairs) / len(pairs) >= 0.75, (first, pairs)


@pytest.mark.cuda
def test_fp8_cache_on_the_gpu_follows_the_bf16_cache(setup, greedy, make_engine, run_all, workload):
    """bf16 on the GPU (the Triton append and attention kernels, CUDA graphs): fp8 against the bf16
    cache, under preemption, with the bounds of the CPU test above and for the same reason."""
    requests = workload(24, seed=1)
    exact = run_all(make_engine(setup, device="cuda", dtype=torch.bfloat16, max_batch_size=8, page_size=4), requests,
                    greedy)
    tight = make_engine(setup, device="cuda", dtype=torch.bfloat16, max_batch_size=8, page_size=4, kv_cache_tokens=96,
                        kv_cache_dtype="fp8")
    outs = run_all(tight, requests, greedy)
    assert tight.stats().num_preemptions > 0 and tight.allocator.num_free == tight.allocator.num_pages
    assert all(len(o.token_ids) == m for o, (_, _, m) in zip(outs, requests))
    first = sum(o.token_ids[0] == e.token_ids[0] for o, e in zip(outs, exact)) / len(requests)
    pairs = [(a, b) for o, e in zip(outs, exact) for a, b in zip(o.token_ids, e.token_ids)]
    assert first >= 0.9 and sum(a == b for a, b in pairs) / len(pairs) >= 0.75, (first, pairs)


def test_fp8_cache_holds_about_twice_the_tokens_in_the_same_bytes(setup):
    """Same kv_cache_bytes: the fp8 cache's pages = bytes // (page_size * (2 L Hkv (D + 4))), the
    bf16 cache's bytes // (page_size * 2 L Hkv 2D); the tensors the runner allocates stay within
    the budget (plus the one scratch page). D = 128 (7B): 1.94x the tokens; the tiny model's D = 16: 1.6x."""
    model = load_hf_dir(setup[0], dtype=torch.bfloat16)
    budget, page_size = 1 << 20, 4
    pages = {}
    for dtype in ("auto", "fp8"):
        config = EngineConfig(kv_cache_bytes=budget, page_size=page_size, kv_cache_dtype=dtype)
        pages[dtype] = kv_cache_pages(model, config)
    layers, kv_heads, head_dim = model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
    assert pages["auto"] == budget // (page_size * 2 * layers * kv_heads * head_dim * 2)
    assert pages["fp8"] == budget // (page_size * 2 * layers * kv_heads * (head_dim + 4))
    assert pages["fp8"] / pages["auto"] >= 1.59
    engine = engine_on_model(model, EngineConfig(kv_cache_bytes=budget, page_size=page_size, kv_cache_dtype="fp8"))
    cache = engine.executor.worker.runner.kv_cache
    assert engine.allocator.num_pages == pages["fp8"] and cache.pages.shape[1] == pages["fp8"] + 1
    allocated = cache.pages.numel() * cache.pages.element_size() + cache.scales.numel() * cache.scales.element_size()
    assert allocated <= budget * (pages["fp8"] + 1) / pages["fp8"]
    seven_b = preset_config("llama-2-7b")
    ratio = (kv_bytes_per_token(seven_b.num_layers, seven_b.num_kv_heads, seven_b.head_dim, torch.bfloat16, "auto")
             / kv_bytes_per_token(seven_b.num_layers, seven_b.num_kv_heads, seven_b.head_dim, torch.bfloat16, "fp8"))
    assert 1.93 < ratio < 1.95


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
