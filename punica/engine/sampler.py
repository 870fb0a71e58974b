"""Per-request sampling inside one batch: logit bias, grammar masks, penalties, temperature,
top-k/top-p/min-p, seeds, and the log-probabilities of the chosen and the most likely tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch

from punica.engine.request import Request
from punica.engine.structured import apply_bitmasks
from punica.ops.transfer import to_device

MASK_64 = (1 << 64) - 1


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
    """Repetition penalty (HF: over prompt and output), frequency and presence (OpenAI: output)."""
    for row, request in enumerate(requests):
        p = request.params
        if not p.uses_penalties:
            continue
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(request.token_ids)), device=logits.device)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and request.output_token_ids:
            counts = torch.bincount(torch.tensor(request.output_token_ids, device=logits.device),
                                    minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k, top-p (nucleus) and min-p."""
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, mass_before >= top_p)
        probs = probs.masked_fill(drop, 0)
    if min_p > 0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0)
    return probs / probs.sum()


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
    for row, request in enumerate(requests):
        p = request.params
        if p.greedy:
            continue
        probs = filter_probs(logits[row], p.temperature, p.top_k, p.top_p, p.min_p)
        valid = torch.isfinite(probs).all() & (probs.sum() > 0)
        ok[row] &= valid
        probs = torch.where(valid, probs, 1.0)
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(position_seed(p.seed, len(request.output_token_ids)))
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    if logprobs_all is None:
        return Sampled(tokens, ok, None, None)
    chosen = logprobs_all.gather(1, tokens[:, None])
    k = max(r.params.top_logprobs for r in requests)
    if not k:
        return Sampled(tokens, ok, chosen, None)
    top = logprobs_all.topk(k, dim=-1)
    return Sampled(tokens, ok, torch.cat([chosen, top.values], 1), top.indices)
