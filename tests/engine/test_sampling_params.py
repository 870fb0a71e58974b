"""SamplingParams range checks: every value it accepts samples without NaN or overflow; every
value outside the ranges is a SamplingParamsError naming its field."""

import math

import pytest
import torch

from punica.engine.request import Request
from punica.engine.sampler import sample
from punica.engine.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_TEMPERATURE,
    SamplingParams,
    SamplingParamsError,
    offset_seed,
)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -1), ("temperature", 1e-38), ("temperature", 1e-300), ("temperature", MIN_TEMPERATURE / 2),
    ("temperature", 101), ("temperature", math.inf), ("temperature", math.nan), ("temperature", True),
    ("temperature", "1"),
    ("top_k", -2), ("top_k", 1.0), ("top_k", True),
    ("top_p", 0), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.inf),
    ("repetition_penalty", 0), ("repetition_penalty", 1e-300), ("repetition_penalty", 0.009),
    ("repetition_penalty", 101), ("repetition_penalty", math.nan),
    ("frequency_penalty", 2.5), ("frequency_penalty", -math.inf), ("presence_penalty", -3),
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("seed", 1.0), ("seed", True), ("seed", "7"),
    ("stop", [""]), ("stop", [3]), ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ("include_stop_str_in_output", 1), ("ignore_eos", "yes"), ("logprobs", None),
    ("lora_scale", -0.1), ("lora_scale", 10.5), ("lora_scale", math.nan), ("lora_scale", True), ("lora_scale", "1"),
])
def test_out_of_range_names_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and isinstance(e.value, ValueError)


EXTREMES = [
    dict(temperature=MIN_TEMPERATURE, repetition_penalty=0.01),
    dict(temperature=MIN_TEMPERATURE, repetition_penalty=100),
    dict(temperature=100, repetition_penalty=100, frequency_penalty=2, presence_penalty=2),
    dict(temperature=MIN_TEMPERATURE, frequency_penalty=-2, presence_penalty=-2, top_p=1e-9, min_p=1),
    dict(temperature=1, top_k=1, seed=1 << 40),
    dict(temperature=0.7, top_k=10**9, seed=-12345),
    dict(temperature=0, repetition_penalty=0.01),
]


@pytest.mark.parametrize("kwargs", EXTREMES)
def test_accepted_extremes_sample_in_one_batch(kwargs):
    """The bounds' reason: at their ends, on logits as large as a model's, sampling stays finite
    and a request at the bounds samples beside an ordinary one."""
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(2, vocab) * 40
    requests = [Request("edge", [1, 2, 3, 3], SamplingParams(max_tokens=4, logprobs=True, **kwargs)),
                Request("plain", [4, 5], SamplingParams(max_tokens=4, temperature=0.8, logprobs=True))]
    for r in requests:
        r.output_token_ids = [3, 7, 7]
    tokens, ok, logprobs, _ = sample(logits, requests)
    assert tokens.shape == (2,) and all(0 <= t < vocab for t in tokens.tolist())
    assert torch.isfinite(logprobs).all() and ok.all()


@pytest.mark.parametrize("seed", [-(1 << 63), (1 << 64) - 1, 1 << 45])
def test_every_accepted_seed_samples(seed):
    logits = torch.randn(1, 16)
    tokens, ok, _, _ = sample(logits, [Request("r", [1], SamplingParams(seed=seed))])
    assert 0 <= tokens.item() < 16 and ok.item()


@pytest.mark.parametrize("bit", [32, 48, 63])
def test_seeds_differing_in_one_high_bit_sample_differently(bit):
    """Every bit of a 64-bit seed counts, also on CPU, whose generator keeps a seed's low 32 bits only."""
    logits = torch.zeros(1, 1000)

    def tokens(seed: int) -> list[int]:
        request = Request("r", [1], SamplingParams(seed=seed))
        sampled = []
        for position in range(8):
            request.output_token_ids = sampled[:position]
            sampled.append(sample(logits, [request]).tokens.item())
        return sampled

    seed = 12345
    assert tokens(seed) == tokens(seed)
    assert tokens(seed) != tokens(seed ^ (1 << bit))


def test_accepted_values_and_conversions():
    p = SamplingParams(max_tokens=1, temperature=0, top_k=-1, top_p=1, min_p=0, seed=(1 << 64) - 1,
                       stop="end", stop_token_ids=[0, 5], repetition_penalty=1)
    assert p.greedy and p.stop == ("end",) and p.stop_token_ids == (0, 5)
    assert SamplingParams(temperature=3, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS).temperature == 3
    assert SamplingParams(seed=-(1 << 63), stop=None, stop_token_ids=None).stop == ()


def test_offset_seed_wraps_into_range_and_keeps_bad_seeds_bad():
    top = (1 << 64) - 1
    assert [offset_seed(top - 1, j) for j in range(3)] == [top - 1, top, 0]
    assert offset_seed(-(1 << 63), 2) == -(1 << 63) + 2 and offset_seed(7, 0) == 7
    for bad in (1 << 64, -(1 << 63) - 1, True):
        assert offset_seed(bad, 1) is bad
        with pytest.raises(SamplingParamsError, match="seed"):
            SamplingParams(seed=offset_seed(bad, 1))
