"""Prefix caching and chunked prefill in the engine (fp32, CPU): greedy outputs do not change with
either on or off, for mixed-adapter batches with preemption; KV never crosses adapters or reloads."""

import random

import pytest

from punica.engine.sampling_params import SamplingParams


def chat_workload(seed):
    """Two waves of requests: each adapter (and the base model) has its own system prompt, and the
    second wave resends first-wave prompts with more turns, so it can hit the cache."""
    rng = random.Random(seed)
    systems = {name: [rng.randrange(3, 128) for _ in range(rng.randint(9, 20))] for name in (None, "a", "b", "c")}
    first = [(systems[name] + [rng.randrange(3, 128) for _ in range(rng.randint(1, 12))], name, rng.randint(2, 16))
             for name in (None, "a", "b", "c") * 3]
    second = [(prompt + [rng.randrange(3, 128) for _ in range(rng.randint(1, 8))], name, max_tokens)
              for prompt, name, max_tokens in first[::2]]
    return first, second


@pytest.mark.slow
def test_outputs_match_with_prefix_caching_and_chunked_prefill_on_and_off(setup, greedy, make_engine, run_all):
    first, second = chat_workload(seed=4)
    outputs, engines = {}, {}
    for chunked in (False, True):
        for caching in (False, True):
            engine = make_engine(setup, max_batch_size=6, page_size=4, kv_cache_tokens=112,
                                 max_num_batched_tokens=20 if chunked else 4096, chunked_prefill=chunked,
                                 prefix_caching=caching)
            # adapters resident first: batches then do not depend on when a load finishes
            run_all(engine, [([2], name, 1) for name in "abc"], greedy)
            outs = run_all(engine, first, greedy) + run_all(engine, second, greedy)
            outputs[chunked, caching] = [o.token_ids for o in outs]
            engines[chunked, caching] = engine, outs
    for key, tokens in outputs.items():
        assert tokens == outputs[False, False], key
    for (chunked, caching), (engine, outs) in engines.items():
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert (stats.num_chunked_steps > 0) == chunked
        hits = sum(counts.hit_tokens for counts in stats.prefix_cache.values())
        assert (hits > 0) == caching
        assert (sum(o.num_cached_tokens for o in outs) > 0) == caching
        assert engine.allocator.num_used == 0


def test_the_same_prompt_under_other_adapters_or_a_reload_never_reads_its_kv(setup, greedy, hf_greedy, make_engine,
                                                                            run_all):
    base, paths, peft_model = setup
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    prompt = list(range(5, 29))                                      # 6 pages

    def hit_tokens(adapter):
        out, = run_all(engine, [(prompt, adapter, 3)], greedy)
        return out.num_cached_tokens, out.token_ids

    assert hit_tokens("a")[0] == 0
    assert hit_tokens("a")[0] == 20, "the same adapter reads the 5 full pages short of the last token"
    assert hit_tokens("b")[0] == 0 and hit_tokens(None)[0] == 0
    assert hit_tokens(None)[0] == 20
    cached = engine.allocator.num_cached
    engine.unload_adapter("a")
    assert engine.allocator.num_cached == cached - 6, "the 6 full pages of a's KV leave the cache with it"
    engine.load_adapter("a", paths["c"])                             # new weights under the old name
    hit, tokens = hit_tokens("a")
    assert hit == 0 and tokens == hf_greedy(peft_model, prompt, "c", 3)
    assert engine.stats().prefix_cache["a"].hit_tokens == 20


def test_chunked_prefill_needs_a_budget_beyond_the_batch():
    from punica.config import EngineConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_batch_size=32, max_num_batched_tokens=32)
    assert EngineConfig(max_batch_size=32, max_num_batched_tokens=32, chunked_prefill=False)


def test_a_request_whose_whole_prompt_is_cached_samples_as_before(setup, make_engine, run_all):
    engine = make_engine(setup, max_batch_size=2, page_size=4)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=7, ignore_eos=True)
    prompt = list(range(3, 19))                                      # exactly 4 pages
    first, = run_all(engine, [(prompt, "b", 5)], lambda n: params)
    again, = run_all(engine, [(prompt, "b", 5)], lambda n: params)
    assert again.num_cached_tokens == 12 and again.token_ids == first.token_ids


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_chunks_and_the_prefix_cache_generate_what_eager_steps_do(setup, dtype, greedy, make_engine,
                                                                              run_all):
    """CUDA graphs (mixed buckets replaying prompt chunks beside decodes, over cached pages) against
    eager steps, with preemption: in fp32 against the plain eager engine (no chunks, no cache); in
    bf16, where other batch shapes round differently, against eager steps of the same schedule."""
    import torch

    first, second = chat_workload(seed=6)
    outputs, stats = {}, {}
    for eager in (True, False):
        plain = eager and dtype == "float32"
        engine = make_engine(setup, device="cuda", dtype=getattr(torch, dtype), max_batch_size=6, page_size=4,
                             kv_cache_tokens=128, max_num_batched_tokens=4096 if plain else 20,
                             chunked_prefill=not plain, prefix_caching=not plain, enforce_eager=eager)
        run_all(engine, [([2], name, 1) for name in "abc"], greedy)
        outputs[eager] = [o.token_ids for o in run_all(engine, first, greedy) + run_all(engine, second, greedy)]
        stats[eager] = engine.stats()
    assert outputs[False] == outputs[True]
    graphs = stats[False]
    assert graphs.num_preemptions > 0 and graphs.num_chunked_steps > 0
    assert sum(c.hit_tokens for c in graphs.prefix_cache.values()) > 0
