"""Per-request sampling inside one batch: logit bias, grammar masks, penalties, temperature,
top-k/top-p/min-p, seeds, and the log-probabilities of the chosen and the most likely tokens.

The rows that sample (temperature > 0) are filtered and drawn together, whatever their settings
and seeds: a batch's ops do not grow with its rows (each launch costs the host several
microseconds on a GPU, and a step that looped over its rows launched ~20 a row)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.structured import apply_bitmasks
from punica.ops.transfer import to_device

MASK_64 = (1 << 64) - 1
# on a CPU, a top-p row's nucleus is first looked for among this many of its largest logits
# (filter_probs): a language model's usually lies well within them
NUCLEUS_CANDIDATES = 1024


def _mix_64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers in which every input bit flips each
    output bit with probability about 1/2."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    return z ^ (z >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's token at `position` (its count of output tokens so
    far): the same whatever the batch, even after a preemption or a migration. Every bit of the
    64-bit seed (taken modulo 2**64) reaches every bit of the result, the low 32 bits included,
    which are all that torch's CPU generator (mt19937) keeps of a seed."""
    return _mix_64((_mix_64(seed & MASK_64) + position) & MASK_64)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition penalty (HF: over prompt and output), frequency and presence (OpenAI: output), for
    every row in one set of ops: the (row, token) pairs each penalty touches, and what it does to
    each, are found on the host (numpy) and copied once. A token seen before gets logit / p where
    its logit is > 0, logit x p otherwise (p its request's repetition_penalty); then one that the
    output holds c times loses frequency_penalty x c + presence_penalty (float32 on the host)."""
    params = [r.params for r in requests]
    repeated = [row for row, p in enumerate(params) if p.repetition_penalty != 1]
    if repeated:
        rows, ids, which, _ = _distinct_tokens(requests, repeated, output_only=False)
        index = _to(logits.device, rows, ids)
        by = to_device(torch.tensor([params[row].repetition_penalty for row in repeated],
                                    dtype=logits.dtype)[which], logits.device)
        values = logits[index]
        logits = logits.index_put(index, torch.where(values > 0, values / by, values * by))
    counted = [row for row, (r, p) in enumerate(zip(requests, params))
               if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids]
    if counted:
        rows, ids, which, counts = _distinct_tokens(requests, counted, output_only=True)
        index = _to(logits.device, rows, ids)
        frequency, presence = torch.tensor([[params[row].frequency_penalty for row in counted],
                                            [params[row].presence_penalty for row in counted]],
                                           dtype=logits.dtype)[:, which]
        penalty = frequency * counts.to(logits.dtype) + presence
        logits = logits.index_put(index, logits[index] - to_device(penalty, logits.device))
    return logits


def _distinct_tokens(requests: list[Request], rows: list[int], output_only: bool):
    """(batch row, token id, which of `rows`, count), int64 tensors on the host with one entry per
    distinct token of each of requests[row] for row in rows (of its output alone with output_only)."""
    parts = []
    for which, row in enumerate(rows):
        request = requests[row]
        ids, counts = np.unique(np.asarray(request.output_token_ids if output_only else request.token_ids,
                                           dtype=np.int64), return_counts=True)
        parts.append((np.full(len(ids), row), ids, np.full(len(ids), which), counts))
    return tuple(torch.from_numpy(np.concatenate(column).astype(np.int64)) for column in zip(*parts))


def _to(device: torch.device, rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rows, ids) index on `device`, in one copy."""
    return tuple(to_device(torch.stack([rows, ids]), device))


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The probabilities [N, V] of logits [N, V] that each row's temperature, top-k, top-p (nucleus)
    and min-p keep (params[row]; temperature > 0), the others 0, not renormalized (a row sums to at
    most 1: draw from it as weights), in one set of ops for the batch:

        logits = logits / temperature
        top-k:  logits below the row's k-th largest become -inf (ties with it stay)
        probs = softmax(logits)
        top-p:  with the tokens in order of decreasing logit (ties by id), a token whose preceding
                tokens' probability mass is already >= top_p gets 0
        min-p:  a probability below min_p x the row's largest gets 0

    The order (one for the batch, where some row has top-k or top-p) is of the logits, not of the
    probabilities after top-k: softmax keeps it, and the masked tokens stay at the end. Only a
    row's largest logits are ordered where that suffices (`_order_count`; torch.topk, then ties put
    by id), not the whole vocabulary (a stable sort of 32 rows of 32,000 took 32 ms on a 2-core
    CPU): where every row has a top-k, the largest max(k); on a CPU, NUCLEUS_CANDIDATES first, and
    the whole row only where some row's top-p needs more. The tokens kept are those that ordering
    the whole row keeps, but for ties with a row's k-th largest logit past those ordered, which its
    top-p keeps all or none of. Which steps run is decided from `params` on the host (and on a CPU
    from the candidates' mass): nothing waits for a GPU."""
    vocab = logits.shape[-1]
    uses_k = [0 < p.top_k < vocab for p in params]
    uses_p = [p.top_p < 1 for p in params]
    knobs = to_device(torch.tensor([[p.temperature for p in params],
                                    [p.top_k if k else math.inf for p, k in zip(params, uses_k)],
                                    [p.top_p if u else math.inf for p, u in zip(params, uses_p)],
                                    [p.min_p for p in params]], dtype=torch.float32), logits.device)
    temperature, top_k, top_p, min_p = knobs[:, :, None]
    logits = logits / temperature
    if any(uses_k) or any(uses_p):
        count = _order_count(params, uses_k, vocab, logits.device)
        ordered, order = _ordered(logits, count)
        if any(uses_k):
            kth = torch.where(top_k <= count, ordered.gather(1, top_k.clamp(max=count).long() - 1), -math.inf)
            logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if any(uses_p):
        ordered_probs = probs.gather(1, order)
        mass = ordered_probs.cumsum(-1)
        if not all(uses_k) and count < vocab and not bool(((mass[:, -1:] >= top_p) | (top_p > 1)).all()):
            order = _ordered(logits, vocab)[1]  # some row's nucleus reaches past the candidates (a CPU)
            ordered_probs = probs.gather(1, order)
            mass = ordered_probs.cumsum(-1)
        # a token past those ordered is dropped where its row's nucleus closed before it
        past = (mass[:, -1:] >= top_p).expand(probs.shape)
        drop = past.scatter(1, order, (mass - ordered_probs) >= top_p)  # by the mass before each token
        probs = probs.masked_fill(drop, 0)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0)
    return probs


def _order_count(params: list[SamplingParams], uses_k: list[bool], vocab: int, device: torch.device) -> int:
    """How many of each row's largest logits filter_probs orders first: max(k) where every row has a
    top-k (what lies past it is masked), on a CPU NUCLEUS_CANDIDATES (at least every row's k: a
    nucleus found past them is ordered again over the whole row, which costs the CPU nothing to
    find out), else the whole row."""
    if all(uses_k):
        return max(p.top_k for p in params)
    if device.type == "cpu":
        return min(vocab, max([NUCLEUS_CANDIDATES] + [p.top_k for p, k in zip(params, uses_k) if k]))
    return vocab


def _ordered(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [N, count] of each row's `count` largest logits, in decreasing order, ties by id."""
    if count == logits.shape[-1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    values, ids = logits.topk(count, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token [N] int64 from each row of weights [N, V] (>= 0, each row's sum finite and > 0), with
    probability weight / the row's sum, by the inverse of its distribution: the first token whose
    cumulative weight (float64) exceeds uniform [N, 1] (float64 in [0, 1), on weights' device) times
    the row's sum. A token of weight 0 is never drawn, and none past the last of weight: for u < 1
    and a normal s > 0, u x s rounds below s (exactly, u x s is more than half a unit of s's last
    place below it). torch.multinomial draws a random number per token (on the CPU 18 ms for 32
    rows of 32,000), this one per row."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0]


class Sampled(NamedTuple):
    tokens: torch.Tensor               # [N] int64
    ok: torch.Tensor                   # [N] bool
    logprobs: torch.Tensor | None      # [N, 1 + K] float32: of the chosen token, then of the K most likely
    top_ids: torch.Tensor | None       # [N, K] int64: the K most likely tokens, most likely first


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each request's logit_bias added to its row, in one op for the batch. A request's bias is made
    into tensors once, at its first step: up to 1024 biases of 32 rows, read from Python tuples at
    every step, cost about 30 ms a step on a CPU core."""
    biased = [(row, _bias_tensors(r)) for row, r in enumerate(requests) if r.params.logit_bias]
    if not biased:
        return logits
    rows = torch.cat([torch.full_like(ids, row) for row, (ids, _) in biased])
    cols = torch.cat([ids for _, (ids, _) in biased])
    values = torch.cat([values for _, (_, values) in biased])
    index = to_device(torch.stack([rows, cols]), logits.device)
    bias = to_device(values.to(logits.dtype), logits.device)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


def _bias_tensors(request: Request) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64, biases float32) of the request's logit_bias, on the host, made once."""
    if request.logit_bias_tensors is None:
        ids, values = zip(*request.params.logit_bias)
        request.logit_bias_tensors = torch.tensor(ids, dtype=torch.int64), torch.tensor(values, dtype=torch.float32)
    return request.logit_bias_tensors


def sample(logits: torch.Tensor, requests: list[Request],
           masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> Sampled:
    """One token per row of logits [N, V] float32, whether the row could be sampled (its logits
    finite and, when it samples, its filtered probabilities a distribution), and, when a request
    asks for them, log-probabilities under the model (its logits before bias, grammar and
    penalties) of the chosen token and of the K most likely tokens (K: the most any request asks).
    `masks`: (rows, bitmask) of the rows under a grammar (punica.engine.structured.apply_bitmasks).

    A row that fails gets some token, computed as if its logits were zeros, so that nothing of it
    reaches another row (multinomial on NaN would fail the whole batch, on CUDA the whole process);
    the engine fails that request alone. Everything stays on the logits' device: nothing here
    waits for the device, so the engine can schedule its next step while this one runs."""
    ok = torch.isfinite(logits).all(-1)
    logits = torch.where(ok[:, None], logits, 0.0)
    logprobs_all = logits.log_softmax(-1) if any(r.params.wants_logprobs for r in requests) else None
    logits = apply_logit_bias(logits, requests)
    if masks is not None:
        logits = apply_bitmasks(logits, *masks)
    if any(r.params.uses_penalties for r in requests):
        logits = apply_penalties(logits, requests)
    tokens = logits.argmax(-1)
    drawing = [row for row, request in enumerate(requests) if not request.params.greedy]
    if drawing:
        tokens, ok = _draw(logits, tokens, ok, drawing, [requests[row] for row in drawing])
    if logprobs_all is None:
        return Sampled(tokens, ok, None, None)
    chosen = logprobs_all.gather(1, tokens[:, None])
    k = max(r.params.top_logprobs for r in requests)
    if not k:
        return Sampled(tokens, ok, chosen, None)
    top = logprobs_all.topk(k, dim=-1)
    return Sampled(tokens, ok, torch.cat([chosen, top.values], 1), top.indices)


def _draw(logits: torch.Tensor, tokens: torch.Tensor, ok: torch.Tensor, rows: list[int],
          requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, ok) with the rows that sample (not greedy) drawn from their filtered probabilities,
    all rows in one set of ops. The uniform numbers are drawn on the host, by torch's default
    generator, or for a seeded request by a generator of its own (position_seed): its token does
    not depend on the batch, nor on the device, only on its probabilities."""
    device = logits.device
    params = [r.params for r in requests]
    every_row = len(rows) == logits.shape[0]  # the common case: no rows to pick out and put back
    index = None if every_row else to_device(torch.tensor(rows), device)
    probs = filter_probs(logits if every_row else logits.index_select(0, index), params)
    total = probs.sum(-1)  # NaN where softmax met a row of -inf, 0 where nothing was kept
    valid = torch.isfinite(total) & (total > 0)
    probs = torch.where(valid[:, None], probs, 1.0)
    uniform = torch.rand(len(params), 1, dtype=torch.float64)
    for i, (p, request) in enumerate(zip(params, requests)):
        if p.seed is not None:
            generator = torch.Generator()
            generator.manual_seed(position_seed(p.seed, len(request.output_token_ids)))
            uniform[i] = torch.rand(1, dtype=torch.float64, generator=generator)
    drawn = draw(probs, to_device(uniform, device))
    if every_row:
        return drawn, ok & valid
    return tokens.index_copy(0, index, drawn), ok.index_copy(0, index, ok.index_select(0, index) & valid)
