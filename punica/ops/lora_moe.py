"""LoRA on a mixture-of-experts layer's experts: each (token, expert) pair's delta by its token's
adapter slot and the pair's expert. The reference (the spec), on any device."""

from __future__ import annotations

import torch


def add_expert_lora(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    pair_tokens: torch.Tensor, pair_experts: torch.Tensor, token_slots: torch.Tensor,
                    token_scales: torch.Tensor, slot_scales: torch.Tensor) -> None:
    """Add each pair's expert LoRA delta to an expert projection's output, in place.

        y:            [P, h_out]           the projection's output of the pairs (punica.ops.moe)
        rows:         [P, h_in]            its input
        lora_a:       [S, E, R, h_in]      every slot's A of every expert
        lora_b:       [S, E, h_out, R]
        pair_tokens:  [P] int              each pair's token
        pair_experts: [P] int              its expert
        token_slots:  [T] int32            each token's adapter slot (-1: none)
        token_scales: [T] float32          its request's lora_scale
        slot_scales:  [S] float32          each slot's lora_alpha / r

        for p with t = pair_tokens[p], s = token_slots[t] >= 0, e = pair_experts[p]:
            scale = token_scales[t] * slot_scales[s]                                  (float32)
            y[p] += scale * (rows[p] @ lora_a[s, e].T) @ lora_b[s, e].T

    The delta is computed in float32. On CUDA two Triton launches, a shrink and an expand, that
    look the slots and scales up themselves (punica.ops.lora_moe_triton); else the reference, for
    which pairs sorted by expert, and within an expert by slot, make few runs of equal (slot,
    expert): one shrink and one expand each.
    """
    if rows.is_cuda:
        from punica.ops.lora_moe_triton import add_expert_lora_triton
        add_expert_lora_triton(y, rows, lora_a, lora_b, pair_tokens, pair_experts, token_slots, token_scales,
                               slot_scales)
        return
    add_expert_lora_ref(y, rows, lora_a, lora_b, pair_tokens, pair_experts, token_slots, token_scales, slot_scales)


def add_expert_lora_ref(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        pair_tokens: torch.Tensor, pair_experts: torch.Tensor, token_slots: torch.Tensor,
                        token_scales: torch.Tensor, slot_scales: torch.Tensor) -> None:
    if rows.shape[0] == 0:
        return
    pair_slots = token_slots[pair_tokens]
    pair_scales = token_scales[pair_tokens] * slot_scales[pair_slots.clamp(min=0)]
    num_experts = lora_a.shape[1]
    key = pair_slots.long() * num_experts + pair_experts
    starts = torch.cat([key.new_zeros(1), torch.nonzero(key[1:] != key[:-1]).flatten() + 1,
                        key.new_full((1,), key.numel())]).tolist()
    for lo, hi in zip(starts, starts[1:]):
        slot, expert = int(pair_slots[lo]), int(pair_experts[lo])
        if slot < 0:
            continue
        v = rows[lo:hi].float() @ lora_a[slot, expert].float().T
        delta = (v @ lora_b[slot, expert].float().T) * pair_scales[lo:hi, None]
        y[lo:hi] += delta.to(y.dtype)
