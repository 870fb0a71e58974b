"""Steps as CUDA graphs: a padded static batch equals the eager step (CPU), and an engine
replaying graphs generates exactly what an eager engine does (GPU)."""

from __future__ import annotations

import pytest
import torch

from punica.config import ceil_div
from punica.engine.cuda_graphs import Bucket, CudaGraphs, StaticBatch, buckets, decode_batch_sizes
from punica.engine.request import PENDING, Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.step_input import StepInput
from punica.ops.lora_shapes import sgmv_block_m


def test_decode_batch_sizes():
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert decode_batch_sizes(3) == [1, 2, 3]
    assert decode_batch_sizes(1) == [1]


def prefill(num_tokens: int, num_cached: int = 0) -> Request:
    request = Request("r", list(range(num_tokens)), SamplingParams())
    request.num_cached = num_cached
    return request


def step_of(prefills: list[Request], decodes: list[Request]) -> StepInput:
    for request in prefills + decodes:
        request.pages = list(range(ceil_div(request.num_tokens, 4)))
    num_scheduled = [r.num_tokens - r.num_cached for r in prefills + decodes]
    return StepInput.from_requests(prefills + decodes, num_scheduled, len(prefills), page_size=4)


def test_bucket_fits_and_order():
    decodes = [prefill(9, 8)] * 3
    assert Bucket(0, 0, 4).fits(step_of([], decodes)) and not Bucket(0, 0, 2).fits(step_of([], decodes))
    assert not Bucket(0, 0, 4).fits(step_of([prefill(5)], decodes))
    mixed = Bucket(4, 32, 8)
    assert mixed.fits(step_of([prefill(29)], decodes))          # 29 tokens + 3 padding requests of one token
    assert not mixed.fits(step_of([prefill(30)], decodes))
    assert mixed.fits(step_of([prefill(30, 20)] * 3, decodes))  # only uncached tokens count: 30 + 1 padding
    assert not mixed.fits(step_of([prefill(5)] * 4, decodes))   # the padding request needs a place
    assert not mixed.fits(step_of([], decodes))
    all_buckets = buckets(32, 2048)
    assert all_buckets == sorted(all_buckets, key=lambda b: (b.num_prefills > 0, b.num_tokens))
    mixed = {b.prefill_tokens: b.num_prefills for b in all_buckets if b.num_prefills}
    assert mixed == {35: 4, 68: 5, 136: 9, 272: 17, 544: 33, 800: 33, 1056: 33, 1568: 33, 2080: 33}
    assert any(b.fits(step_of([prefill(64)] * 32, [])) for b in all_buckets), "a whole batch of 64-token prompts"
    assert max(b.prefill_tokens for b in buckets(32, 600)) == 544  # a padding request fits a context


def test_a_mixed_bucket_runs_the_lora_kernels_of_its_prompt_tokens():
    """A mixed bucket's prompt rows run SGMV's tiles only where its prompt tokens would outside a
    graph (punica.ops.lora_shapes): the 64-token chunk's bucket (68 prefill rows with its padding
    requests' tokens) runs every row on BGMV, as an eager step of a 64-token chunk does."""
    by_chunk = {b.prompt_tokens: StaticBatch(b, 4, 16, 0, torch.device("cpu")).sgmv_block_m
                for b in buckets(32, 2048) if b.num_prefills}
    assert sgmv_block_m(64, 1) == by_chunk[64] == by_chunk[32] == 1
    assert sorted(by_chunk) == [32, 64, 128, 256, 512, 768, 1024, 1536, 2048]
    assert all(block_m > 1 for chunk, block_m in by_chunk.items() if chunk >= 128)


@pytest.fixture
def scheduled_step(workload, greedy, load_adapters):
    """The function `scheduled_step(engine, num_decodes, new_prompts)`: requests of mixed adapters
    until `num_decodes` run; then add `new_prompts`: the next batch, and the rows of its decodes'
    last tokens among the tokens the engine's last step sampled, and the tokens each request runs."""
    def scheduled_step(engine, num_decodes, new_prompts):
        load_adapters(engine, ["a", "b", "c"])  # resident: every request is admitted at its first chance
        for prompt, adapter, _ in workload(max(num_decodes, 4), seed=3)[:num_decodes]:
            engine.add_request(prompt, greedy(30), adapter)
        for _ in range(20):
            engine.step()
            if len(engine.scheduler.running) == num_decodes:
                break
        for i, length in enumerate(new_prompts):
            adapter = [None, "a", "c"][i % 3] if num_decodes >= 4 else None
            engine.add_request(list(range(3, 3 + length)), greedy(30), adapter)
        output = engine.scheduler.schedule()
        rows = list(engine.scheduler.requests_of(output))
        prefills, decodes = rows[:output.num_prefills], rows[output.num_prefills:]
        assert len(prefills) == len(new_prompts) and len(decodes) == num_decodes
        assert [r.slot for r in prefills] == sorted(r.slot for r in prefills), "in adapter-slot order"
        assert [r.slot for r in decodes] == sorted(r.slot for r in decodes), "in adapter-slot order"
        in_flight = engine.requests_in_flight()
        fed = [in_flight.index(r) for r in decodes] if in_flight else None
        assert all(r.output_token_ids[-1] == PENDING for r in decodes), "their last tokens are on the device only"
        return prefills, decodes, fed, output.num_scheduled

    return scheduled_step


@pytest.mark.parametrize("bucket,num_decodes,new_prompts", [
    (Bucket(0, 0, 8), 6, []), (Bucket(0, 0, 8), 8, []), (Bucket(0, 0, 4), 1, []),
    (Bucket(4, 64, 8), 5, [17]), (Bucket(4, 128, 8), 8, [5, 40, 30]), (Bucket(4, 32, 4), 0, [2, 3]),
    (Bucket(4, 128, 4), 4, [60, 40]),  # 132 tokens in 8 requests: SGMV, a segment per request
    (Bucket(4, 35, 4), 4, [20, 12]),   # the smallest mixed bucket of `buckets`
])
def test_static_batch_matches_eager_step(setup, bucket, num_decodes, new_prompts, make_engine, scheduled_step):
    # no latency budget: the step holds every new prompt whole, whatever the cost model learned
    engine = make_engine(setup, max_batch_size=16, kv_cache_tokens=1024, max_itl_ratio=0)
    prefills, decodes, fed, num_scheduled = scheduled_step(engine, num_decodes, new_prompts)
    step = StepInput.from_requests(prefills + decodes, num_scheduled, len(prefills), engine.config.page_size, fed)
    assert bucket.fits(step)
    if len(decodes) >= 4:
        assert {r.slot for r in decodes} >= {-1, 0, 1, 2}, "a base row and every adapter in the batch"
        assert max(len(r.pages) for r in decodes) > 1
    worker, page_size = engine.executor.worker, engine.config.page_size
    runner = worker.runner
    num_pages = engine.allocator.num_pages
    pages = runner.kv_cache.pages
    assert pages.shape[1] == num_pages + 1, "one scratch page beyond the allocator's"
    before = pages.clone()
    eager = runner.run(step)
    eager_cache = pages.clone()

    pages.copy_(before)
    pages[:, num_pages] = 1e3  # garbage in the scratch page is never read by real rows
    static = StaticBatch(bucket, ceil_div(engine.max_model_len, page_size), page_size, num_pages, runner.device)
    static.fill(step)
    with torch.inference_mode():
        logits = static.forward(worker.model, runner.kv_cache, runner.sampled, with_lora=True)
    assert logits.shape == (bucket.num_requests, eager.shape[1])
    real_rows = list(range(len(prefills))) + [bucket.num_prefills + i for i in range(len(decodes))]
    torch.testing.assert_close(logits[real_rows], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pages[:, :num_pages], eager_cache[:, :num_pages], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(logits).all()


@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])  # fp8: the pages' scales are static buffers too
def test_graph_engine_generates_what_eager_engine_does(setup, monkeypatch, greedy, make_engine, run_all, workload,
                                                       kv_cache_dtype):
    replays = []
    run = CudaGraphs.run

    def spy(self, step):
        logits = run(self, step)
        if logits is not None:
            replays.append((step.num_prefills, step.num_decodes, step.any_lora))
        return logits

    monkeypatch.setattr(CudaGraphs, "run", spy)
    mixed = workload(28, seed=11)  # the first step admits 12 prompts: too many for a bucket, eager
    base_only = [(prompt, None, max_tokens) for prompt, _, max_tokens in workload(6, seed=12)]
    outputs = {}
    for eager in (True, False):
        engine = make_engine(setup, device="cuda", max_batch_size=12, kv_cache_tokens=4096, enforce_eager=eager,
                             kv_cache_dtype=kv_cache_dtype)
        assert engine.executor.worker.uses_cuda_graphs != eager
        # the adapters resident first: the batches' shapes then do not depend on when a load completes
        run_all(engine, [([5, 6, 7], name, 1) for name in ("a", "b", "c")], greedy)
        replays.clear()
        outputs[eager] = [[o.token_ids for o in run_all(engine, requests, greedy)] for requests in (mixed, base_only)]
    assert outputs[False] == outputs[True]
    sizes = {d for p, d, _ in replays if not p}
    assert len(sizes) > 3 and max(sizes) == 12, replays
    assert any(p for p, _, _ in replays), "steps admitting short prompts replayed mixed graphs"
    assert {with_lora for _, _, with_lora in replays} == {True, False}, "both graphs of a bucket replayed"


@pytest.mark.cuda
def test_graph_engine_applies_each_requests_lora_scale_as_the_eager_engine_does(setup, monkeypatch, make_engine,
                                                                                 workload, run_all, greedy):
    """Requests of one adapter at different lora_scales (0 among them) in graph-replayed steps give
    the eager engine's tokens; scale 0 gives the base model's."""
    replays = []
    run = CudaGraphs.run

    def spy(self, step):
        logits = run(self, step)
        if logits is not None:
            replays.append(sorted(set(step.token_scales.tolist())))
        return logits

    monkeypatch.setattr(CudaGraphs, "run", spy)
    scales = [0.0, 0.5, 1.0, 1.7]
    # the workload cycles base, a, b, c: each run of four takes the next scale, so every adapter
    # runs at every scale
    requests = [(prompt, adapter, max_tokens, scales[i // 4 % 4] if adapter else 1.0)
                for i, (prompt, adapter, max_tokens) in enumerate(workload(16, seed=13))]
    requests += [(prompt, None, max_tokens, 1.0) for prompt, adapter, max_tokens, scale in requests if scale == 0]
    outputs = {}
    for eager in (True, False):
        engine = make_engine(setup, device="cuda", max_batch_size=8, kv_cache_tokens=4096, enforce_eager=eager)
        # the adapters resident first: the batches' shapes then do not depend on when a load completes
        run_all(engine, [([5, 6, 7], name, 1) for name in ("a", "b", "c")], greedy)
        replays.clear()
        ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lora_scale=s), a)
               for p, a, n, s in requests]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        outputs[eager] = [done[i] for i in ids]
    assert outputs[False] == outputs[True]
    zero = [i for i, r in enumerate(requests) if r[3] == 0]
    assert len(zero) == 3
    assert [outputs[False][i] for i in zero] == outputs[False][len(requests) - len(zero):]
    assert any(len(s) > 2 for s in replays), "a replayed step mixed several scales"
