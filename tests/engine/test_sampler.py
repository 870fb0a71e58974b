"""punica.engine.sampler: the rows that sample are filtered and drawn together, each as the
per-row spec below filters it; seeded rows draw the same token whatever the batch; a row that
cannot be sampled fails alone; the batch's ops do not grow with its rows."""

import math

import pytest
import torch

from punica.engine import sampler
from punica.engine.request import Request
from punica.engine.sampler import draw, filter_probs, sample
from punica.engine.sampling_params import SamplingParams


def filter_row(logits, temperature, top_k, top_p, min_p):
    """The spec of one row (normalized): temperature, top-k, softmax, top-p in order of decreasing
    probability (ties by id), min-p."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        ordered, order = probs.sort(descending=True, stable=True)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, ordered.cumsum(-1) - ordered >= top_p)
        probs = probs.masked_fill(drop, 0)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0)
    return probs / probs.sum()


def assert_filtered_as_spec(got, logits, p):
    """One row of filter_probs (not renormalized) against the spec of its logits and params."""
    want = filter_row(logits, p.temperature, p.top_k, p.top_p, p.min_p)
    torch.testing.assert_close(got / got.sum(), want, rtol=1e-5, atol=1e-7)
    assert torch.equal(got > 0, want > 0)


def requests(params):
    return [Request(str(i), [1, 2, 3], p) for i, p in enumerate(params)]


SETTINGS = [dict(temperature=1.0), dict(temperature=0.3, top_k=5), dict(temperature=2.0, top_p=0.5),
            dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02), dict(temperature=1.0, min_p=0.1),
            dict(temperature=1.0, top_k=-1), dict(temperature=1.0, top_k=1000), dict(temperature=1.5, top_p=0.999),
            dict(temperature=1.0, top_k=1)]


def test_each_row_is_filtered_as_the_per_row_spec_filters_it():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(SETTINGS), 200, generator=gen) * 3
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie at the top: top-k keeps both
    params = [SamplingParams(max_tokens=1, **kw) for kw in SETTINGS]
    got = filter_probs(logits, params)
    assert got[1, 7] > 0 and got[1, 9] > 0
    for row, p in enumerate(params):
        assert_filtered_as_spec(got[row], logits[row], p)


def test_rows_that_all_have_a_top_k_are_filtered_as_the_spec_filters_them():
    """Then only the largest max(k) logits are ordered (torch.topk), ties at the top by id."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen) * 2
    logits[2, 11] = logits[2, 40] = logits[2].max() + 0.5
    params = [SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=p)
              for t, k, p in ((1.0, 20, 0.8), (0.5, 3, 1.0), (1.2, 50, 0.6), (2.0, 1, 0.9))]
    got = filter_probs(logits, params)
    for row, p in enumerate(params):
        assert_filtered_as_spec(got[row], logits[row], p)


@pytest.mark.parametrize("candidates", [4, 12, 64])
def test_on_a_cpu_the_nucleus_looked_for_among_candidates_is_the_specs(monkeypatch, candidates):
    """Among a row's largest logits first (NUCLEUS_CANDIDATES), the whole row where some row's
    nucleus reaches past them: the same probabilities either way."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 200, generator=gen) * 4
    params = [SamplingParams(max_tokens=1, temperature=t, top_k=k, top_p=p)
              for t, k, p in ((1.0, 0, 0.3), (0.6, 0, 0.9), (1.0, 8, 0.95), (3.0, 0, 1.0), (1.0, 0, 0.05))]
    for rows in ([0, 4], [0, 1, 2, 3, 4]):  # nuclei within a few candidates; one that is not
        got = filter_probs(logits[rows], [params[row] for row in rows])
        for i, row in enumerate(rows):
            assert_filtered_as_spec(got[i], logits[row], params[row])


def test_draw_follows_the_weights_and_never_draws_a_zero():
    gen = torch.Generator().manual_seed(0)
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    drawn = torch.stack([draw(weights, torch.rand(2, 1, dtype=torch.float64, generator=gen)) for _ in range(4000)])
    assert set(drawn[:, 0].tolist()) == {1, 3} and set(drawn[:, 1].tolist()) == {0, 5}
    share = (drawn[:, 0] == 3).float().mean().item()
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / 4000) ** 0.5  # four standard deviations


@pytest.mark.parametrize("u", [0.0, math.nextafter(1.0, 0.0)])
@pytest.mark.parametrize("weights", [[0.0, 0.0, 0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 0.0, 0.1, 0.3, 0.7, 0.0, 0.0],
                                     [0.0, 0.0, 3e-38, 1e-30, 7e-3, 0.0, 0.0]])
def test_draw_at_the_ends_of_the_uniform_range_takes_a_token_of_weight(u, weights):
    """The largest u below 1 still lands on the last token of weight, not past it onto the zeros; u =
    0 on the first."""
    weights = torch.tensor([weights])
    assert draw(weights, torch.tensor([[u]], dtype=torch.float64)).tolist() == [4 if u else 2]


def test_seeded_rows_draw_the_same_token_alone_and_in_any_batch():
    """Also a row of other seeds, and whatever torch's default generator does."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen)
    seeded = SamplingParams(max_tokens=1, temperature=1.3, top_p=0.95, seed=42)
    others = [SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=1, temperature=0.8),
              SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=7),
              SamplingParams(max_tokens=1, temperature=1.0, repetition_penalty=1.3)]
    alone = sample(logits[2:3], requests([seeded])).tokens.item()
    for position in range(3):
        torch.manual_seed(position)
        batch = others[:position] + [seeded] + others[position:]
        rows = torch.cat([logits[:position], logits[2:3], logits[position:len(others)]])
        assert sample(rows, requests(batch)).tokens[position].item() == alone


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")  # every token masked
    params = [SamplingParams(max_tokens=1, temperature=t) for t in (1.0, 1.0, 0.9, 0.0)]
    out = sample(logits, requests(params))
    assert out.ok.tolist() == [True, False, False, True]
    assert out.tokens[3].item() == logits[3].argmax().item()
    assert ((out.tokens >= 0) & (out.tokens < 50)).all()


def penalized_row(logits, prompt, output, repetition, frequency, presence):
    """The spec of one row's penalties: HF's repetition penalty over prompt and output, then OpenAI's
    frequency and presence penalties over the output."""
    logits = logits.clone()
    if repetition != 1:
        seen = torch.tensor(sorted(set(prompt + output)))
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if output:
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0]).to(logits.dtype)
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def test_every_rows_penalties_are_the_per_row_specs():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 40, generator=gen) * 3
    rows = [([1, 2, 3], [3, 3, 7, 9, 9, 9], 1.3, 0.5, 0.25), ([5, 6], [], 0.8, 1.0, 1.0),
            ([0, 39], [39, 0, 0], 1.0, -0.7, 0.4), ([4], [8, 8], 1.0, 0.0, 0.0)]
    requests_ = []
    for i, (prompt, output, repetition, frequency, presence) in enumerate(rows):
        request = Request(str(i), prompt, SamplingParams(max_tokens=8, repetition_penalty=repetition,
                                                         frequency_penalty=frequency, presence_penalty=presence))
        request.output_token_ids.extend(output)
        requests_.append(request)
    got = sampler.apply_penalties(logits.clone(), requests_)
    for row, spec in enumerate(rows):
        assert torch.equal(got[row], penalized_row(logits[row], *spec)), row


def op_count(logits, params) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sample(logits, requests(params))
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


def test_the_batch_runs_as_many_ops_for_many_rows_as_for_two():
    """What a GPU host pays is launches: they must not grow with the rows that sample."""
    params = [SamplingParams(max_tokens=1, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01,
                             repetition_penalty=1.1)] * 16
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(3))
    assert op_count(logits[:2], params[:2]) == op_count(logits, params)
