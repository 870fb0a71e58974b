"""The router's top-k and the pairs sorted by expert, and the weighted sum of the experts' outputs
back per token, in Triton; semantics: punica.ops.moe.route_ref and punica.ops.moe.combine_ref.

The reference is ~20 torch launches a layer (softmax, topk, the renormalisation, a stable sort, the
counts and their cumulative sum, three gathers); at decode they cost more than the tiny tensors'
bytes by far. Here they are two launches over blocks of BLOCK_T tokens:

    _route_topk_kernel, grid (token blocks,): each token's softmax over the experts in float32, its
        top_k experts by probability (ties to the lower expert) and their probabilities, in the
        token's rank order, and their sum; and each block's count of pairs per expert
        (`block_counts` [blocks, BLOCK_E]).
    _route_sort_kernel, grid (token blocks,): each block sums the counts of every block (the
        experts' totals, whose cumulative sum is expert_indptr; block 0 writes it) and of the
        blocks before it, and places each of its pairs at its expert's start + the earlier blocks'
        pairs of that expert + the block's own earlier pairs of it (a cumulative sum over a one-hot
        [pairs, experts] tile). That is the order of a stable sort by expert of the pairs in token
        order: within an expert the pairs keep their tokens' order. A pair's weight is its
        probability, divided by its token's sum with `renormalize`. Each pair's place is also
        written at its token's rank (`token_pairs`), for the combine.

    _combine_kernel, grid (T, hidden blocks): each token's pairs' rows times their weights, summed
        over its experts in rank order in float32 and rounded once (the reference's five torch
        launches are one).

The expert choice and the order are the reference's exactly, ties included (the lower expert first);
the probabilities may differ from torch's softmax in the last bits (the exponential).
Every size follows from the shapes: no host syncs, safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.moe_routing import ExpertRouting

BLOCK_PAIRS = 64  # pairs a block holds at most: BLOCK_T = the largest power of two with BLOCK_T * top_k <= it
COUNT_ROWS = 32   # block_counts rows _route_sort_kernel sums at a time
COMBINE_BLOCK_H = 512  # hidden features per _combine_kernel program: 4 a thread of 4 warps


@triton.jit
def _route_topk_kernel(logits, topk_experts, topk_probs, token_totals, block_counts, num_tokens, num_experts,
                       stride_l, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    block = tl.program_id(0)
    offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_mask, e_mask = offs_t < num_tokens, offs_e < num_experts
    x = tl.load(logits + offs_t[:, None].to(tl.int64) * stride_l + offs_e[None, :],
                mask=t_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)
    x = tl.where(e_mask[None, :], x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    probs = tl.where(e_mask[None, :], probs, -1.0)  # below every probability: never chosen
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        total += best
        chosen = tl.min(tl.where(probs == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        hit = offs_e[None, :] == chosen[:, None]
        probs = tl.where(hit, -1.0, probs)
        tl.store(topk_experts + offs_t * TOP_K + j, chosen, mask=t_mask)
        tl.store(topk_probs + offs_t * TOP_K + j, best, mask=t_mask)
        counts += tl.sum((hit & t_mask[:, None]).to(tl.int32), axis=0)
    tl.store(token_totals + offs_t, total, mask=t_mask)
    tl.store(block_counts + block * BLOCK_E + offs_e, counts)


@triton.jit
def _route_sort_kernel(topk_experts, topk_probs, token_totals, block_counts, pair_tokens, pair_experts,
                       pair_weights, expert_indptr, token_pairs, num_pairs, num_blocks, num_experts,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, COUNT_ROWS: tl.constexpr):
    block = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    earlier = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, num_blocks, COUNT_ROWS):
        offs_b = b0 + tl.arange(0, COUNT_ROWS)
        counts = tl.load(block_counts + offs_b[:, None] * BLOCK_E + offs_e[None, :],
                         mask=(offs_b < num_blocks)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where((offs_b < block)[:, None], counts, 0), axis=0)
    ends = tl.cumsum(totals, 0)
    if block == 0:
        tl.store(expert_indptr + 1 + offs_e, ends.to(tl.int64), mask=offs_e < num_experts)
        tl.store(expert_indptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int64), mask=offs_e == 0)
    offs_local = tl.arange(0, BLOCK_P)
    offs_p = block * (BLOCK_T * TOP_K) + offs_local
    p_mask = (offs_local < BLOCK_T * TOP_K) & (offs_p < num_pairs)
    expert = tl.load(topk_experts + offs_p, mask=p_mask, other=-1)
    one_hot = (expert[:, None] == offs_e[None, :]).to(tl.int32)
    place = (ends - totals + earlier)[None, :] + tl.cumsum(one_hot, 0) - one_hot
    position = tl.sum(one_hot * place, axis=1)
    tl.store(pair_tokens + position, (offs_p // TOP_K).to(tl.int64), mask=p_mask)
    tl.store(pair_experts + position, expert.to(tl.int64), mask=p_mask)
    weight = tl.load(topk_probs + offs_p, mask=p_mask)
    if RENORMALIZE:
        weight = weight / tl.load(token_totals + offs_p // TOP_K, mask=p_mask, other=1.0)
    tl.store(pair_weights + position, weight, mask=p_mask)
    tl.store(token_pairs + offs_p, position.to(tl.int64), mask=p_mask)


@triton.jit
def _combine_kernel(out, down, token_pairs, pair_weights, hidden, stride_d, stride_o, TOP_K: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = tl.load(token_pairs + token * TOP_K + j)
        row = tl.load(down + pair * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(pair_weights + pair) * row
    tl.store(out + token * stride_o + offs, acc.to(out.dtype.element_ty), mask=mask)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    """punica.ops.moe.route_ref in two launches."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= num_experts, (router_logits.shape, top_k)
    device, num_pairs = router_logits.device, num_tokens * top_k
    block_t = 1 << max(0, (BLOCK_PAIRS // top_k).bit_length() - 1)
    block_e = triton.next_power_of_2(num_experts)
    num_blocks = triton.cdiv(num_tokens, block_t)
    topk_experts = torch.empty(num_pairs, dtype=torch.int32, device=device)
    topk_probs = torch.empty(num_pairs, dtype=torch.float32, device=device)
    token_totals = torch.empty(num_tokens, dtype=torch.float32, device=device)
    block_counts = torch.empty(num_blocks, block_e, dtype=torch.int32, device=device)
    pair_tokens = torch.empty(num_pairs, dtype=torch.int64, device=device)
    pair_experts = torch.empty(num_pairs, dtype=torch.int64, device=device)
    pair_weights = torch.empty(num_pairs, dtype=torch.float32, device=device)
    expert_indptr = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    token_pairs = torch.empty(num_pairs, dtype=torch.int64, device=device)
    if num_tokens:
        _route_topk_kernel[(num_blocks,)](
            router_logits, topk_experts, topk_probs, token_totals, block_counts, num_tokens, num_experts,
            router_logits.stride(0), TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e)
        _route_sort_kernel[(num_blocks,)](
            topk_experts, topk_probs, token_totals, block_counts, pair_tokens, pair_experts, pair_weights,
            expert_indptr, token_pairs, num_pairs, num_blocks, num_experts, TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_T=block_t,
            BLOCK_P=triton.next_power_of_2(block_t * top_k), BLOCK_E=block_e, COUNT_ROWS=COUNT_ROWS)
    else:
        expert_indptr.zero_()
    return ExpertRouting(pair_tokens=pair_tokens, pair_experts=pair_experts, pair_weights=pair_weights,
                         expert_indptr=expert_indptr, token_pairs=token_pairs)


def combine_triton(down: torch.Tensor, routing: ExpertRouting, num_tokens: int) -> torch.Tensor:
    """punica.ops.moe.combine_ref in one launch."""
    num_pairs, hidden = down.shape
    top_k = num_pairs // max(1, num_tokens)
    assert down.stride(1) == 1 and num_pairs == num_tokens * top_k == routing.token_pairs.numel(), down.shape
    out = down.new_empty(num_tokens, hidden)
    if num_tokens:
        _combine_kernel[(num_tokens, triton.cdiv(hidden, COMBINE_BLOCK_H))](
            out, down, routing.token_pairs, routing.pair_weights, hidden, down.stride(0), out.stride(0),
            TOP_K=top_k, BLOCK_H=COMBINE_BLOCK_H)
    return out
