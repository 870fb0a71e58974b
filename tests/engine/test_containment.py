"""A request whose activations go non-finite fails alone: an adapter slot poisoned after loading
(NaN, or weights huge enough to overflow) makes its requests fail with finish_reason "error",
while requests co-batched with them, and later requests on the KV pages they freed, get exactly
the tokens of a clean engine. On a GPU the same runs through CUDA graphs."""

import pytest
import torch

from punica.config import EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.models.loader import load_hf_dir

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 40, 2], [7] * 9, [100, 101]]


@pytest.fixture(scope="module")
def poisonable(tmp_path_factory, make_peft_adapter, tiny_llama):
    tmp = tmp_path_factory.mktemp("containment")
    hf = tiny_llama(seed=6)
    hf.save_pretrained(tmp / "base")
    paths = {name: str(make_peft_adapter(hf, tmp / name, r=8, alpha=16, seed=i)) for i, name in enumerate("ab")}
    return tmp / "base", paths


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def make(poisonable, device):
    base, paths = poisonable
    config = EngineConfig(max_batch_size=8, page_size=4, kv_cache_tokens=160, max_loras=3)
    return engine_on_model(load_hf_dir(base, dtype=torch.float32, device=device), config, paths)


def drain(engine):
    outs = {}
    for outputs in engine.steps():
        outs |= {o.request_id: o for o in outputs if o.finished}
    return outs


def poison(engine, adapter: str, value: float) -> None:
    """Overwrite the GPU slot of a resident adapter, as if its weights had passed every check."""
    slot = engine.adapters.resident[engine.adapters.current[adapter]]
    engine.executor.adapter_slots.buffer[slot] = value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), 1e30])
def test_a_poisoned_adapter_fails_its_requests_alone(poisonable, device, value):
    clean = make(poisonable, device)
    want = drain_ids(clean, [(p, a, 8) for p in PROMPTS for a in (None, "a")])
    want_later = drain_ids(clean, [(p, None, 6) for p in PROMPTS])

    engine = make(poisonable, device)
    warm = engine.add_request([1, 2], greedy(2), "b")  # makes "b" resident
    drain(engine)
    assert warm not in engine.requests
    poison(engine, "b", value)
    mixed = [(p, a, 8) for p in PROMPTS for a in (None, "a")]
    ids = [engine.add_request(p, greedy(n, logprobs=True), a) for p, a, n in mixed]
    bad = [engine.add_request(p, greedy(8), "b") for p in PROMPTS]
    sampled_bad = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=1.0, seed=3), "b")
    outs = drain(engine)
    for request_id in bad + [sampled_bad]:
        assert outs[request_id].finish_reason == "error" and "not finite" in outs[request_id].error
    assert [outs[i].token_ids for i in ids] == want
    assert all(lp is not None and lp == lp for i in ids for lp in outs[i].logprobs)  # no NaN logprob
    assert engine.allocator.num_used == 0 and not engine.adapters.refs
    # the failed requests' pages (NaN in their K/V) now serve others: nothing of them is read
    assert drain_ids(engine, [(p, None, 6) for p in PROMPTS]) == want_later


def drain_ids(engine, requests):
    ids = [engine.add_request(p, greedy(n), a) for p, a, n in requests]
    outs = drain(engine)
    assert all(outs[i].finish_reason == "length" for i in ids)
    return [outs[i].token_ids for i in ids]
