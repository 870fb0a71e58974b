"""Overlapped steps (step t+1 launched before step t's tokens reach the host) give exactly
what one step at a time gives, and lose nothing when requests stop or are aborted mid-flight."""

from __future__ import annotations

import argparse

import pytest
import torch

from punica.config import EngineConfig
from punica.engine.request import PENDING
from punica.engine.runner import ModelRunner
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.flags import add_arguments
from punica.models.loader import load_hf_dir


def generate(engine, requests):
    """Outputs of (prompt, adapter, params) requests, in order, and the fed rows of every step."""
    ids = [engine.add_request(prompt, params, adapter) for prompt, adapter, params in requests]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert PENDING not in out.token_ids
            if out.finished:
                outs[out.request_id] = out
    return [outs[i] for i in ids]


@pytest.fixture
def fed_rows(monkeypatch):
    """Every fed row (>= 0) that a step's decodes read from the previous step's sampled tokens."""
    rows = []
    run = ModelRunner.run

    def spy(self, step):
        rows.extend(r for r in step.fed_rows.tolist() if r >= 0)
        return run(self, step)

    monkeypatch.setattr(ModelRunner, "run", spy)
    return rows


@pytest.fixture
def mixed_requests(make_engine, run_all, workload, greedy):
    """The function `mixed_requests(setup)`: greedy requests that stop at a token they produce, with
    logprobs; seeded sampling; one request that runs into the model's context (256) and one of each
    that ends by max_tokens."""
    def mixed_requests(setup):
        plain = run_all(make_engine(setup), workload(12, seed=7), greedy)
        requests = []
        for (prompt, adapter, max_tokens), out in zip(workload(12, seed=7), plain):
            stop = out.token_ids[len(out.token_ids) // 2]
            requests.append((prompt, adapter, SamplingParams(max_tokens=max_tokens + 4, temperature=0, logprobs=True,
                                                             stop_token_ids=[stop], ignore_eos=True)))
        for i, (prompt, adapter, max_tokens) in enumerate(workload(8, seed=8)):
            requests.append((prompt, adapter, SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9,
                                                             seed=i, ignore_eos=True)))
        requests.append(([3 + i % 120 for i in range(250)], "c", greedy(20)))
        return requests

    return mixed_requests


@pytest.mark.slow
def test_overlapped_steps_give_what_one_step_at_a_time_gives(setup, fed_rows, make_engine, mixed_requests):
    requests = mixed_requests(setup)
    fed_rows.clear()
    one_at_a_time = make_engine(setup, max_batch_size=6, page_size=4, overlap_steps=False)
    assert not one_at_a_time.overlaps_steps
    expected = generate(one_at_a_time, requests)
    assert not fed_rows, "a synchronous engine reads every token from the host"
    engine = make_engine(setup, max_batch_size=6, page_size=4)
    outs = generate(engine, requests)
    assert fed_rows, "steps ran ahead"
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
        # the same tokens; their logprobs may differ in the last bits, as requests join the batch
        # a step later when steps overlap (fp32 GEMMs of other batch sizes round differently)
        assert (out.logprobs is None) == (want.logprobs is None)
        if want.logprobs is not None:
            assert out.logprobs == pytest.approx(want.logprobs, rel=1e-5, abs=1e-6)
    assert sum(o.finish_reason == "stop" for o in outs) >= 10
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 256 - 250
    assert engine.allocator.num_used == 0 and not engine.has_step_in_flight


def test_a_request_aborted_in_flight_returns_only_tokens_the_host_has(setup, greedy, make_engine, run_all):
    engine = make_engine(setup, max_batch_size=4, page_size=4)
    kept = engine.add_request([5, 6, 7], greedy(6), None)
    dropped = engine.add_request([8, 9], greedy(6), None)
    first = engine.step()
    assert first == [] and engine.has_step_in_flight, "no output yet, but a step in flight"
    engine.step()
    assert engine.has_step_in_flight
    out = engine.abort(dropped)
    assert out.finish_reason == "abort" and len(out.token_ids) == 1, "the first token; the second is in flight"
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {kept, dropped} - {dropped}
    alone = run_all(make_engine(setup), [([5, 6, 7], None, 6)], greedy)[0]
    assert [o.token_ids for o in outs if o.finished] == [alone.token_ids]
    assert engine.allocator.num_used == 0
    assert engine.step() == [] and not engine.has_unfinished(), "nothing queued, nothing in flight"


def test_on_the_cpu_steps_do_not_overlap_unless_asked(setup):
    """On the CPU the model runs inside `step`, so nothing overlaps it: by default each step returns
    its own tokens (a request's first token comes from the step that prefilled it); asked to, the
    engine overlaps there too, and from the command line the flag is on, off or left to the device."""
    model = load_hf_dir(setup[0], dtype=torch.float32)
    for overlap, tokens_of_the_first_step in ((None, [1]), (True, [])):
        engine = engine_on_model(model, EngineConfig(overlap_steps=overlap), setup[1])
        assert engine.overlaps_steps == bool(overlap)
        engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert [len(out.new_token_ids) for out in engine.step()] == tokens_of_the_first_step
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig, only=("overlap_steps",))
    flags = [parser.parse_args(args).overlap_steps for args in ([], ["--overlap-steps"], ["--no-overlap-steps"])]
    assert flags == [None, True, False]
