"""The experts' LoRA delta in Triton; semantics: punica.ops.lora_moe.add_expert_lora.

At decode a layer has a few hundred (token, expert) pairs, nearly each with its own (slot, expert)
A and B of a few tens of KB: the time is set by how many dependent memory round trips each program
makes, not by the bytes. So the delta runs as two launches whose programs make few of them:

    _expert_shrink_kernel, grid (P, K parts): one program per pair and part of BLOCK_K input
        features looks its token's slot up (token_slots[pair_tokens[p]]; part 0 writes it to
        `pair_slots`); for slot s >= 0 it multiplies its part of the pair's row by the same columns
        of A[s, expert] ([R, h_in]) in one step (BLOCK_R x BLOCK_K = SHRINK_TILE elements: 4 parts
        at h_in 2048 and R 16, all in flight at once), and writes the [BLOCK_R] float32 partial
        vector times the pair's scale (token_scales[t] * slot_scales[s]) to `shrunk`
        [P, parts, BLOCK_R].
    _expert_expand_kernel, grid (P, cdiv(h_out, BLOCK_N)): one program per pair and block of
        BLOCK_N output features reads the pair's slot, then its partial vectors (summed in order),
        B[s, expert]'s [BLOCK_N, R] block and y's block, and adds the delta: one round trip after
        the slot.

Products and sums are float32 (the operands are upcast; the rank is too small for tl.dot), each
shrink program sums its elementwise products once, the expand sums the parts in a fixed order (the
delta does not depend on the timing), and y + delta is rounded once to y's dtype. Pairs of slot -1
only write their slot. Both grids follow from the shapes alone, and the scratch (`shrunk`
[P, parts, BLOCK_R] float32, `pair_slots` [P]) comes from the caching allocator: no host syncs, safe
under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SHRINK_TILE = 8192  # elements of A one shrink program reads: BLOCK_R x BLOCK_K, 32 per thread of 8 warps
EXPAND_BLOCK_N = 128


@triton.jit
def _expert_shrink_kernel(shrunk, pair_slots, rows, lora_a, pair_tokens, pair_experts, token_slots, token_scales,
                          slot_scales, h_in, rank, stride_rows, stride_as, stride_ae, stride_ar,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    token = tl.load(pair_tokens + pair)
    slot = tl.load(token_slots + token)
    if part == 0:
        tl.store(pair_slots + pair, slot)
    if slot >= 0:
        expert = tl.load(pair_experts + pair).to(tl.int64)
        scale = tl.load(token_scales + token) * tl.load(slot_scales + slot)
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = part * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < h_in
        a = lora_a + slot.to(tl.int64) * stride_as + expert * stride_ae
        x = tl.load(rows + pair * stride_rows + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a_tile = tl.load(a + offs_r[:, None] * stride_ar + offs_k[None, :],
                         mask=(offs_r < rank)[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        partial = tl.sum(a_tile * x[None, :], axis=1) * scale
        tl.store(shrunk + (pair * tl.num_programs(1) + part) * BLOCK_R + offs_r, partial)


@triton.jit
def _expert_expand_kernel(y, shrunk, pair_slots, lora_b, pair_experts, h_out, rank, num_parts, stride_y, stride_bs,
                          stride_be, stride_bn, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_PARTS: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(pair_experts + pair).to(tl.int64)
    slot = tl.load(pair_slots + pair)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < h_out
        offs_p = tl.arange(0, BLOCK_PARTS)
        partials = tl.load(shrunk + (pair * num_parts + offs_p[:, None]) * BLOCK_R + offs_r[None, :],
                           mask=(offs_p < num_parts)[:, None], other=0.0)
        v = tl.sum(partials, axis=0)
        b = lora_b + slot.to(tl.int64) * stride_bs + expert * stride_be
        b_tile = tl.load(b + offs_n[:, None] * stride_bn + offs_r[None, :],
                         mask=n_mask[:, None] & (offs_r < rank)[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b_tile * v[None, :], axis=1)
        y_ptrs = y + pair * stride_y + offs_n
        y_block = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y_block + delta).to(y.dtype.element_ty), mask=n_mask)


def add_expert_lora_triton(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                           pair_tokens: torch.Tensor, pair_experts: torch.Tensor, token_slots: torch.Tensor,
                           token_scales: torch.Tensor, slot_scales: torch.Tensor) -> None:
    """punica.ops.lora_moe.add_expert_lora as a shrink of one program per (pair, BLOCK_K input
    features) and an expand of one per (pair, EXPAND_BLOCK_N output features)."""
    num_pairs, h_in = rows.shape
    h_out, rank = lora_b.shape[2], lora_b.shape[3]
    assert lora_a.shape[2:] == (rank, h_in) and lora_a.stride(3) == 1 and lora_b.stride(3) == 1, (
        lora_a.shape, lora_b.shape)
    assert rows.stride(1) == 1 and y.stride(1) == 1
    assert token_scales.dtype == slot_scales.dtype == torch.float32
    if num_pairs == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = min(SHRINK_TILE // block_r, max(16, triton.next_power_of_2(h_in)))
    num_parts = triton.cdiv(h_in, block_k)
    shrunk = torch.empty(num_pairs, num_parts, block_r, dtype=torch.float32, device=rows.device)
    pair_slots = torch.empty(num_pairs, dtype=token_slots.dtype, device=rows.device)
    _expert_shrink_kernel[(num_pairs, num_parts)](
        shrunk, pair_slots, rows, lora_a, pair_tokens, pair_experts, token_slots, token_scales, slot_scales, h_in,
        rank, rows.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), BLOCK_R=block_r,
        BLOCK_K=block_k, num_warps=8)
    _expert_expand_kernel[(num_pairs, triton.cdiv(h_out, EXPAND_BLOCK_N))](
        y, shrunk, pair_slots, lora_b, pair_experts, h_out, rank, num_parts, y.stride(0), lora_b.stride(0),
        lora_b.stride(1), lora_b.stride(2), BLOCK_R=block_r, BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_PARTS=triton.next_power_of_2(num_parts), num_warps=4)
