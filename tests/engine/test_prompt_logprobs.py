"""Prompt logprobs in the engine (fp32, CPU): the model's log_softmax over each prompt position, as
a full-sequence forward of transformers + PEFT gives it, for mixed adapters, over chunked prefill,
beside a warm prefix cache and with preemption; only the requests that ask pay for logits."""

import random

import numpy as np
import pytest
import torch

from punica.config import EngineConfig
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams, SamplingParamsError
from punica.engine.step_input import StepInput
from punica.engine.worker import ModelWorker
from punica.models.loader import load_hf_dir


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_out_of_range_prompt_logprobs_name_their_field(value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.field == "prompt_logprobs"


def test_only_requests_owed_prompt_logprobs_get_logits_of_more_rows():
    """A chunk gets the logits of its rows from the first missing logprob to its last; a request
    whose logprobs are all counted (recomputed after a preemption) gets its last row's only."""
    owed = Request("a", list(range(10)), SamplingParams(prompt_logprobs=2))
    owed.num_prompt_logprobs, owed.num_cached = 4, 3                            # 4 scheduled: positions 3..6
    done = Request("b", list(range(10)), SamplingParams(prompt_logprobs=2))
    done.num_prompt_logprobs = 10                                               # 6 scheduled
    plain = Request("c", list(range(10)), SamplingParams())                     # 10 scheduled
    assert owed.prompt_rows(4) == (3, 4) and owed.num_logits(4) == 4
    assert done.prompt_rows(6) == (0, 0) and done.num_logits(6) == 1
    owed.num_cached = 7                                                         # the prompt's last chunk: 3
    assert owed.prompt_rows(3) == (7, 2) and owed.num_logits(3) == 3            # token 9 has no row: it samples
    owed.pages = done.pages = plain.pages = [0, 1, 2]
    step = StepInput.from_requests([owed, done, plain], (3, 6, 10), 3, page_size=4)
    assert step.num_logits.tolist() == [3, 1, 1] and not step.only_last_logits
    assert step.logits_rows.tolist() == [0, 1, 2, 8, 18]


def test_a_step_with_prompt_rows_runs_eagerly(setup):
    """The CUDA graphs compute each request's last row only: a step with more rows skips them."""
    model = load_hf_dir(setup[0], dtype=torch.float32)
    runner = ModelWorker(model, EngineConfig(max_batch_size=2), num_pages=4).runner

    class LastRowsOnly:
        def run(self, step):
            assert step.only_last_logits, "a step with prompt rows reached the CUDA graphs"

    runner.graphs = LastRowsOnly()
    step = StepInput.build([[5, 6, 7, 8]], [0], [[0]], [-1], 1, page_size=4, num_logits=[3])
    assert runner.run(step).shape == (3, model.config.vocab_size)


def chat_workload(seed):
    """Prompts whose first 8 to 20 tokens each adapter (and the base model) shares."""
    rng = random.Random(seed)
    systems = {name: [rng.randrange(3, 128) for _ in range(rng.randint(8, 20))] for name in (None, "a", "b", "c")}
    return [(systems[name] + [rng.randrange(3, 128) for _ in range(rng.randint(1, 14))], name, rng.randint(2, 12))
            for name in (None, "a", "b", "c") * 3]


def test_prompt_logprobs_match_a_full_forward_with_chunks_cache_and_preemption(setup, make_engine, run_all,
                                                                               load_adapters):
    _, _, peft_model = setup
    engine = make_engine(setup, max_batch_size=6, page_size=4, kv_cache_tokens=128, max_num_batched_tokens=12)
    load_adapters(engine, ["a", "b", "c"])  # the steps, and so the preemptions, never follow the reads' speed
    workload = chat_workload(seed=2)
    run_all(engine, [(prompt[:16], name, 1) for prompt, name, _ in workload], lambda n: SamplingParams(max_tokens=n))
    ks = [3, None, 0, 5, 20, None] * 2
    chosen = iter(ks)
    outs = run_all(engine, workload, lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                              prompt_logprobs=next(chosen)))
    assert engine.stats().num_preemptions > 0 and engine.stats().num_chunked_steps > 0
    for (prompt, adapter, _), out, k in zip(workload, outs, ks):
        with torch.no_grad():
            logits = peft_model(torch.tensor([prompt + out.token_ids]), adapter_names=[adapter or "__base__"]).logits
        reference = torch.log_softmax(logits[0].float(), -1)
        assert out.token_ids == reference[len(prompt) - 1:-1].argmax(-1).tolist()
        if k is None:
            assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
            continue
        assert out.num_cached_tokens == 0, "a prompt-logprobs request reads no cached pages"
        assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        expected = reference[np.arange(len(prompt) - 1), prompt[1:]]
        assert out.prompt_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
        for position, top in enumerate(out.prompt_top_logprobs[1:]):
            best = reference[position].topk(k)
            assert [t for t, _ in top] == best.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert sum(o.num_cached_tokens for o, k in zip(outs, ks) if k is None) > 0, "the others read the cache"
    assert any(o.num_preemptions for o, k in zip(outs, ks) if k is not None)


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_one_token_chunks_beside_a_decode_give_every_prompt_logprob(setup, make_engine, overlap_steps):
    """With a budget of two tokens a step, a prompt beside a decoding stream runs in one-token chunks:
    each chunk's one row is its last, the only row a step without prompt logprobs keeps, and its
    logits still give the prompt logprob. (After a preemption the same happens to a chunk whose rows
    but its last had their logprobs computed before.)"""
    _, _, peft_model = setup
    engine = make_engine(setup, max_itl_ratio=0, overlap_steps=overlap_steps)
    engine.scheduler.max_num_batched_tokens = 2  # the config refuses fewer than a batch's decodes
    engine.add_request(list(range(5, 9)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    prompt = [3 + (11 * i) % 120 for i in range(9)]
    request = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    out = None
    while out is None or not out.finished:
        out = next((o for o in engine.step() if o.request_id == request), out)
    assert engine.stats().num_chunked_steps >= len(prompt) - 1
    with torch.no_grad():
        logits = peft_model(torch.tensor([prompt]), adapter_names=["__base__"]).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[np.arange(len(prompt) - 1), prompt[1:]]
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(expected.tolist(), abs=1e-4)
