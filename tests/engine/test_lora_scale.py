"""Per-request LoRA strength (SamplingParams.lora_scale): requests of one adapter at different
scales run in one batch, one LoRA segment, each as transformers + PEFT with that adapter's scaling
times its scale."""

import pytest
from peft.tuners.lora import LoraLayer

from punica.engine.sampling_params import SamplingParams, SamplingParamsError


def peft_scaled_greedy(peft_model, hf_greedy, prompt, adapter, scale, steps):
    """hf_greedy with `adapter`'s PEFT scaling (lora_alpha / r) multiplied by `scale`."""
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer) and adapter in m.scaling]
    for layer in layers:
        layer.set_scale(adapter, scale)
    try:
        return hf_greedy(peft_model, prompt, adapter, steps)
    finally:
        for layer in layers:
            layer.set_scale(adapter, 1.0)


def test_mixed_scales_of_one_adapter_match_peft_scaled_per_request(setup, greedy, hf_greedy, make_engine):
    engine = make_engine(setup, max_batch_size=8, page_size=4)
    prompts = [[5, 17, 33, 2, 90, 11], [7, 7, 40, 61], [100, 3, 8, 19, 23, 4, 77], [12, 45, 9]]
    # adapter c at five strengths and a at one, beside the base model, all in one batch
    requests = [(prompts[0], "c", 0.0), (prompts[0], "c", 1.0), (prompts[1], "c", 0.5), (prompts[2], "c", 1.7),
                (prompts[3], "a", 0.3), (prompts[3], None, 1.0), (prompts[2], "c", 1.0), (prompts[1], "c", 0.0)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora_scale=s), a)
           for p, a, s in requests]
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    peft_model = setup[2]
    for (prompt, adapter, scale), request_id in zip(requests, ids):
        base = hf_greedy(peft_model, prompt, None, 8)
        if scale == 0:  # the base model, token for token
            assert outs[request_id] == base, (adapter, scale)
        else:
            expected = peft_scaled_greedy(peft_model, hf_greedy, prompt, adapter, scale, 8) if adapter else base
            assert outs[request_id] == expected, (adapter, scale)
    assert outs[ids[1]] != outs[ids[0]], "adapter c changes this prompt's output: scale 0 is a real test"


def test_lora_scale_without_an_adapter_is_refused_by_name(setup, make_engine):
    engine = make_engine(setup)
    with pytest.raises(SamplingParamsError, match="lora_scale 0.5 needs an adapter") as e:
        engine.add_request([1, 2, 3], SamplingParams(lora_scale=0.5))
    assert e.value.field == "lora_scale" and not engine.has_unfinished()
    engine.add_request([1, 2, 3], SamplingParams(lora_scale=1.0))  # the default is fine without one
