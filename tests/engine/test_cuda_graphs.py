"""Decode steps as CUDA graphs: the padded static batch equals the eager step (CPU), and an
engine replaying graphs generates exactly what an eager engine does (GPU)."""

from __future__ import annotations

import pytest
import torch

from punica.config import EngineConfig, ceil_div
from punica.engine.engine import Engine
from punica.engine.cuda_graphs import DecodeGraphs, StaticDecodeBatch, graph_batch_sizes
from punica.models.loader import load_hf_dir
from test_engine import greedy, make_engine, run_all, setup, workload  # noqa: F401  (setup: fixture)


def test_graph_batch_sizes():
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def decode_batch(engine, num_requests):
    """Run requests of mixed adapters until a step schedules only decodes; that step's batch."""
    for prompt, adapter, _ in workload(num_requests, seed=3):
        engine.add_request(prompt, greedy(30), adapter)
    for _ in range(20):  # adapters load off the engine thread; their requests join when ready
        engine.step()
        if len(engine.scheduler.running) == num_requests:
            break
    batch = engine.scheduler.schedule()
    assert not batch.prefills and len(batch.decodes) == num_requests
    assert {r.slot for r in batch.decodes} >= {-1, 0, 1, 2}, "a base row and every adapter in the batch"
    assert max(len(r.pages) for r in batch.decodes) > 1
    return batch.decodes


@pytest.mark.parametrize("num_requests,size", [(6, 8), (8, 8), (1, 4)])
def test_static_batch_matches_eager_step(setup, num_requests, size):
    engine = make_engine(setup, max_batch_size=16, kv_cache_tokens=1024)
    decodes = decode_batch(engine, max(num_requests, 4))[:num_requests]
    runner, page_size = engine.runner, engine.config.page_size
    num_pages = engine.allocator.num_pages
    assert runner.kv_cache.shape[1] == num_pages + 1, "one scratch page beyond the allocator's"
    before = runner.kv_cache.clone()
    eager = runner.run([], decodes)
    eager_cache = runner.kv_cache.clone()

    runner.kv_cache.copy_(before)
    runner.kv_cache[:, num_pages] = 1e3  # garbage in the scratch page is never read by real rows
    static = StaticDecodeBatch(size, ceil_div(engine.max_model_len, page_size), page_size, num_pages,
                               runner.device)
    static.fill(decodes)
    with torch.inference_mode():
        logits = static.forward(engine.model, runner.kv_cache, with_lora=True)
    assert logits.shape == (size, eager.shape[1])
    torch.testing.assert_close(logits[:num_requests], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv_cache[:, :num_pages], eager_cache[:, :num_pages], rtol=1e-5, atol=1e-5)
    if num_requests < size:
        assert torch.isfinite(logits[num_requests:]).all()


@pytest.mark.cuda
def test_graph_engine_generates_what_eager_engine_does(setup, monkeypatch):
    replays = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, decodes: replays.append(
        (len(decodes), any(r.slot >= 0 for r in decodes))) or run(self, decodes))
    mixed = workload(28, seed=11)
    base_only = [(prompt, None, max_tokens) for prompt, _, max_tokens in workload(6, seed=12)]
    base, paths, _ = setup
    outputs = {}
    for eager in (True, False):
        model = load_hf_dir(base, dtype=torch.float32, device="cuda")
        engine = Engine(model, None, EngineConfig(max_batch_size=12, kv_cache_tokens=4096, enforce_eager=eager),
                        adapters=paths)
        assert (engine.runner.graphs is None) == eager
        outputs[eager] = [[o.token_ids for o in run_all(engine, requests, greedy)] for requests in (mixed, base_only)]
    assert outputs[False] == outputs[True]
    sizes = {n for n, _ in replays}
    assert len(sizes) > 3 and max(sizes) == 12, replays
    assert {with_lora for _, with_lora in replays} == {True, False}, "both graphs of a bucket replayed"
