"""Mixture-of-experts operators: the router's top-k, tokens grouped by expert, the grouped GEMM of
the experts' projections and the weighted sum of their outputs: references (the spec), which run
on any device, the routing and the grouped GEMM dispatched to Triton on CUDA.

A token routed to k experts makes k (token, expert) pairs; `route` sorts the pairs by expert
(stably, so that within an expert they keep the tokens' order, and so their adapter slots'
order: punica.lora.experts adds each (slot, expert) segment's LoRA delta), and the experts'
projections run over the pairs' rows (`grouped_matmul`: a reference, and on CUDA one Triton launch
per projection, punica.ops.moe_triton):

    rows      = x[routing.pair_tokens]                       [P, H]   P = T * k
    gate_up   = grouped_matmul(rows, w_gate_up, routing)      [P, 2I]  w_gate_up [E, 2I, H]
    down      = grouped_matmul(act(gate_up), w_down, routing) [P, H]   w_down [E, H, I]
    out       = combine(down, routing, T)                     [T, H]   sum over a token's pairs of
                                                                       its router weight * down
"""

from __future__ import annotations

import torch

from punica.ops.moe_routing import ExpertRouting


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    """router_logits [T, E]  ->  the pairs of each token's top_k experts by softmax probability
    (float32; of equal probabilities the lower expert first), their weights renormalised to sum 1
    per token if `renormalize` (Mixtral's, and Qwen3-MoE's with norm_topk_prob), sorted by expert.
    On CUDA two Triton launches (punica.ops.moe_route_triton), else the reference."""
    if router_logits.is_cuda:
        from punica.ops.moe_route_triton import route_triton
        return route_triton(router_logits, top_k, renormalize)
    return route_ref(router_logits, top_k, renormalize)


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> ExpertRouting:
    num_tokens, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    # the top_k by a stable sort: of equal probabilities (equal bf16 logits are common) the lower expert
    weights, experts = (t[:, :top_k] for t in torch.sort(probs, dim=-1, descending=True, stable=True))
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat_experts = experts.reshape(-1)
    order = torch.sort(flat_experts, stable=True).indices
    tokens = torch.arange(num_tokens, device=router_logits.device).repeat_interleave(top_k)
    # counted by a scatter (bincount syncs with the host on CUDA to size its output)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=router_logits.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
    indptr = torch.zeros(num_experts + 1, dtype=torch.int64, device=router_logits.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    token_pairs = torch.empty_like(order)
    token_pairs[order] = torch.arange(order.numel(), device=order.device)
    return ExpertRouting(pair_tokens=tokens[order], pair_experts=flat_experts[order],
                         pair_weights=weights.reshape(-1)[order], expert_indptr=indptr, token_pairs=token_pairs)


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
    """rows [P, h_in] (sorted by expert), weights [E, h_out, h_in]  ->  [P, h_out]: each pair's row
    times its expert's weight, rows[p] @ weights[pair_experts[p]].T. On CUDA one Triton launch
    (punica.ops.moe_triton), else the reference."""
    if rows.is_cuda:
        from punica.ops.moe_triton import grouped_matmul_triton
        return grouped_matmul_triton(rows, weights, routing)
    return grouped_matmul_ref(rows, weights, routing)


def grouped_matmul_ref(rows: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    bounds = routing.expert_indptr.tolist()
    for expert, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if lo < hi:
            torch.matmul(rows[lo:hi], weights[expert].T, out=out[lo:hi])
    return out


def combine(down: torch.Tensor, routing: ExpertRouting, num_tokens: int) -> torch.Tensor:
    """down [P, H]  ->  [T, H]: each token's sum of its pairs' rows times their router weights, the
    products and the sum (over its experts in rank order) in float32, rounded once to down's dtype.
    On CUDA one Triton launch (punica.ops.moe_route_triton), else the reference."""
    if down.is_cuda:
        from punica.ops.moe_route_triton import combine_triton
        return combine_triton(down, routing, num_tokens)
    return combine_ref(down, routing, num_tokens)


def combine_ref(down: torch.Tensor, routing: ExpertRouting, num_tokens: int) -> torch.Tensor:
    top_k = routing.num_pairs // max(1, num_tokens)
    weighted = down.float() * routing.pair_weights[:, None]
    by_token = weighted[routing.token_pairs].view(num_tokens, top_k, down.shape[1])
    out = down.new_zeros(num_tokens, down.shape[1], dtype=torch.float32)
    for j in range(top_k):
        out += by_token[:, j]
    return out.to(down.dtype)
