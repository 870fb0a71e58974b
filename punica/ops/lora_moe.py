"""LoRA on a mixture-of-experts layer's experts: each (token, expert) pair's delta by its adapter
slot and expert. The reference (the spec), on any device."""

from __future__ import annotations

import torch


def add_expert_lora(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    pair_slots: torch.Tensor, pair_experts: torch.Tensor, pair_scales: torch.Tensor) -> None:
    """Add each pair's expert LoRA delta to an expert projection's output, in place.

        y:            [P, h_out]           the projection's output of the pairs (punica.ops.moe)
        rows:         [P, h_in]            its input
        lora_a:       [S, E, R, h_in]      every slot's A of every expert
        lora_b:       [S, E, h_out, R]
        pair_slots:   [P] int              each pair's adapter slot (-1: none)
        pair_experts: [P] int              its expert
        pair_scales:  [P] float32          its scale (the slot's lora_alpha / r times the request's)

        for p with pair_slots[p] = s >= 0, e = pair_experts[p]:
            y[p] += pair_scales[p] * (rows[p] @ lora_a[s, e].T) @ lora_b[s, e].T

    On CUDA one Triton launch of one program per pair (punica.ops.lora_moe_triton); else the
    reference, for which pairs sorted by expert, and within an expert by slot, make few runs of
    equal (slot, expert): one shrink and one expand each.
    """
    if rows.is_cuda:
        from punica.ops.lora_moe_triton import add_expert_lora_triton
        add_expert_lora_triton(y, rows, lora_a, lora_b, pair_slots, pair_experts, pair_scales)
        return
    add_expert_lora_ref(y, rows, lora_a, lora_b, pair_slots, pair_experts, pair_scales)


def add_expert_lora_ref(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        pair_slots: torch.Tensor, pair_experts: torch.Tensor, pair_scales: torch.Tensor) -> None:
    if rows.shape[0] == 0:
        return
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
