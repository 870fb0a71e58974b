"""The experts' LoRA delta in Triton; semantics: punica.ops.lora_moe.add_expert_lora.

One program per (token, expert) pair, as BGMV runs one per token: it reads its pair's slot and
expert, shrinks the pair's row by A[slot, expert] ([R, h_in], BLOCK_K columns at a time, into R
fp32 values), then expands by B[slot, expert] BLOCK_N output features at a time and adds the
scaled delta to the pair's output row. Pairs of slot -1 do nothing. The grid is the pair count:
no host syncs, safe under CUDA-graph capture. Under the interpreter the operands are upcast to
fp32 (it multiplies bf16 operands as raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _expert_lora_kernel(y, rows, lora_a, lora_b, pair_slots, pair_experts, pair_scales, h_in, h_out, rank,
                        stride_y, stride_rows, stride_as, stride_ae, stride_ar, stride_bs, stride_be, stride_bn,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pair = tl.program_id(0)
    slot = tl.load(pair_slots + pair)
    if slot >= 0:
        expert = tl.load(pair_experts + pair).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        a = lora_a + slot.to(tl.int64) * stride_as + expert * stride_ae
        v = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, h_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < h_in
            x = tl.load(rows + pair.to(tl.int64) * stride_rows + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            a_tile = tl.load(a + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                             other=0.0).to(tl.float32)
            v += tl.sum(a_tile * x[None, :], axis=1)
        v *= tl.load(pair_scales + pair)
        b = lora_b + slot.to(tl.int64) * stride_bs + expert * stride_be
        for n0 in range(0, h_out, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < h_out
            b_tile = tl.load(b + offs_n[:, None] * stride_bn + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                             other=0.0).to(tl.float32)
            delta = tl.sum(b_tile * v[None, :], axis=1)
            y_ptrs = y + pair.to(tl.int64) * stride_y + offs_n
            y_row = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (y_row + delta).to(y.dtype.element_ty), mask=n_mask)


def add_expert_lora_triton(y: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                           pair_slots: torch.Tensor, pair_experts: torch.Tensor, pair_scales: torch.Tensor) -> None:
    """punica.ops.lora_moe.add_expert_lora in one launch of one program per pair."""
    num_pairs, h_in = rows.shape
    h_out, rank = lora_b.shape[2], lora_b.shape[3]
    assert lora_a.shape[2:] == (rank, h_in) and lora_a.stride(3) == 1 and lora_b.stride(3) == 1, (
        lora_a.shape, lora_b.shape)
    assert rows.stride(1) == 1 and y.stride(1) == 1 and pair_scales.dtype == torch.float32
    if num_pairs == 0:
        return
    _expert_lora_kernel[(num_pairs,)](
        y, rows, lora_a, lora_b, pair_slots, pair_experts, pair_scales, h_in, h_out, rank, y.stride(0),
        rows.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_b.stride(0), lora_b.stride(1),
        lora_b.stride(2), BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=64, BLOCK_N=64)
