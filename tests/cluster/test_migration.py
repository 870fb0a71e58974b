"""Migration, as the cluster worker uses it: a request handed back after preemption
(Engine.take_preempted) resumes elsewhere (add_request with output_token_ids) with exactly the
tokens it would have produced where it started (greedy and seeded sampling)."""

import random

import pytest
import torch

from punica.config import EngineConfig
from punica.engine.engine import Engine
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.models.loader import load_hf_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("migratable") / "base"
    tiny_llama(seed=3).save_pretrained(path)
    return path


def engine(model_dir, **config) -> Engine:
    return engine_on_model(load_hf_dir(model_dir, dtype=torch.float32), EngineConfig(**config))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(4, 14))] for _ in range(n)]


def params_for(i):
    if i % 2:
        return SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=i, ignore_eos=True)
    return SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def run_alone(model_dir, requests):
    e = engine(model_dir, page_size=4)
    for i, p in enumerate(requests):
        e.add_request(p, params_for(i), request_id=str(i))
    outs = {}
    while e.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in e.step() if o.finished)
    return outs


@pytest.mark.slow
def test_preempted_requests_resume_on_another_engine_with_identical_tokens(model_dir):
    requests = prompts(10)
    expected = run_alone(model_dir, requests)
    tight, spare = engine(model_dir, page_size=4, kv_cache_tokens=64), engine(model_dir, page_size=4)
    for i, p in enumerate(requests):
        tight.add_request(p, params_for(i), request_id=str(i))
    outs, moved = {}, 0
    while tight.has_unfinished() or spare.has_unfinished():
        for e in (tight, spare):
            outs.update((o.request_id, o.token_ids) for o in e.step() if o.finished)
        for request_id, output_token_ids in tight.take_preempted():
            assert request_id not in tight.requests and output_token_ids
            i = int(request_id)
            spare.add_request(requests[i], params_for(i), None, request_id, output_token_ids)
            moved += 1
    assert moved > 0 and tight.stats().num_preemptions == moved
    assert outs == expected
    assert tight.allocator.num_used == 0 and spare.allocator.num_used == 0


def test_resumed_output_counts_earlier_tokens_toward_max_tokens(model_dir):
    e = engine(model_dir, page_size=4)
    e.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), None, "r", [9, 10, 11])
    outs = e.step() or e.step()  # the first step's token reaches the host during the second
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
    assert outs[0].token_ids[:3] == [9, 10, 11] and len(outs[0].token_ids) == 4 and len(outs[0].new_token_ids) == 1
