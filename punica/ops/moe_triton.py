"""The experts' grouped GEMM in Triton; semantics: punica.ops.moe.grouped_matmul.

One launch per projection, over every expert: the pairs (sorted by expert) are laid out in
blocks of BLOCK_M rows that each hold one expert's pairs only (`align_blocks`: each expert's run
padded to a multiple of BLOCK_M with a sentinel row), and one program per (block, BLOCK_N output
features) multiplies its rows by its expert's weight tile by tile over K, accumulating in fp32.
The layout is made on the device from the routing's expert_indptr alone, by one launch
(`_align_blocks_kernel`; the torch ops of `align_blocks_ref` are ~25 launches), once per routing
and BLOCK_M (`block_layout`: a layer's two projections share it), and the grid's size from shapes
alone (P pairs of E experts fill at most P + E * (BLOCK_M - 1) rows): no host syncs, safe under
CUDA-graph capture. Blocks past the last expert's run do nothing. Under the interpreter the
operands are upcast to fp32 before tl.dot (it multiplies bf16 operands as raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.moe_routing import ExpertRouting
from punica.ops.triton_env import interpreting

ALIGN_ROWS = 32  # layout rows per program of _align_blocks_kernel


@triton.jit
def _grouped_gemm_kernel(rows, w, out, block_rows, block_experts, N, K, num_pairs,
                         stride_rm, stride_we, stride_wn, stride_om, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_experts + pid_m)
    if expert >= 0:
        idx = tl.load(block_rows + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask, n_mask = idx < num_pairs, offs_n < N
        a_ptrs = rows + idx[:, None].to(tl.int64) * stride_rm + offs_k[None, :]
        w_ptrs = w + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + offs_k < K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ptrs = out + idx[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _align_blocks_kernel(expert_indptr, block_rows, block_experts, num_experts, num_rows,
                         BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    """Layout rows [pid * BLOCK, +BLOCK): each row's expert is the number of experts whose padded
    run ends at or before it, and its pair that expert's first pair plus the row's offset in the
    run (the sentinel num_pairs past the expert's pairs); a block's first row writes its expert."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    first = tl.load(expert_indptr + offs_e, mask=e_mask, other=0).to(tl.int32)
    counts = tl.load(expert_indptr + offs_e + 1, mask=e_mask, other=0).to(tl.int32) - first
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.sum(((padded_end[None, :] <= offs[:, None]) & e_mask[None, :]).to(tl.int32), axis=1)
    mine = offs_e[None, :] == expert[:, None]
    offset = offs - tl.sum(tl.where(mine, (padded_end - padded)[None, :], 0), axis=1)
    num_pairs = tl.load(expert_indptr + num_experts).to(tl.int32)
    in_run = offset < tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
    pair = tl.where(in_run, tl.sum(tl.where(mine, first[None, :], 0), axis=1) + offset, num_pairs)
    row_mask = offs < num_rows
    tl.store(block_rows + offs, pair, mask=row_mask)
    tl.store(block_experts + offs // BLOCK_M, tl.where(expert < num_experts, expert, -1),
             mask=row_mask & (offs % BLOCK_M == 0))


def num_blocks_of(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of a layout of P pairs over E experts: every expert's run padded to a block fits."""
    return triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)


def align_blocks(expert_indptr: torch.Tensor, num_pairs: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_blocks_ref` of a routing's expert_indptr and its P pairs, in one launch."""
    num_experts = expert_indptr.numel() - 1
    num_rows = num_blocks_of(num_pairs, num_experts, block_m) * block_m
    block_rows = torch.empty(num_rows, dtype=torch.int32, device=expert_indptr.device)
    block_experts = torch.empty(num_rows // block_m, dtype=torch.int32, device=expert_indptr.device)
    _align_blocks_kernel[(triton.cdiv(num_rows, ALIGN_ROWS),)](
        expert_indptr, block_rows, block_experts, num_experts, num_rows, BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=ALIGN_ROWS)
    return block_rows, block_experts


def align_blocks_ref(pair_experts: torch.Tensor, expert_indptr: torch.Tensor, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the pairs of an ExpertRouting (punica.ops.moe): (block_rows [num_blocks * block_m] int32,
    the pair of each row, num_pairs in padding rows; block_experts [num_blocks] int32, each block's
    expert, -1 past the last run), num_blocks = ceil((P + E * (block_m - 1)) / block_m), every
    expert's run starting at a block."""
    indptr, num_pairs = expert_indptr, pair_experts.numel()
    num_experts = indptr.numel() - 1
    num_blocks = num_blocks_of(num_pairs, num_experts, block_m)
    counts = indptr[1:] - indptr[:-1]
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    position = padded_start[pair_experts] + torch.arange(num_pairs, device=indptr.device) - indptr[pair_experts]
    block_rows = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=indptr.device)
    block_rows[position] = torch.arange(num_pairs, dtype=torch.int32, device=indptr.device)
    starts = torch.arange(num_blocks, device=indptr.device) * block_m
    block_experts = torch.searchsorted(padded_end, starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return block_rows, block_experts


def block_layout(routing: ExpertRouting, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_blocks` of a routing, made at its first use per block_m and kept on the routing."""
    if block_m not in routing.layouts:
        routing.layouts[block_m] = align_blocks(routing.expert_indptr, routing.num_pairs, block_m)
    return routing.layouts[block_m]


def tile_shape(num_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): short blocks for decode-sized batches (fewer padding rows per
    expert), small tiles under the interpreter."""
    if interpreting():
        return 16, 32, 32
    return (16 if num_pairs <= 256 else 64), 64, 64


def grouped_matmul_triton(rows: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
    """punica.ops.moe.grouped_matmul in one launch (and the routing's layout at its first use)."""
    num_pairs, k = rows.shape
    num_experts, n, _ = weights.shape
    assert weights.shape[2] == k and rows.stride(1) == 1 and weights.stride(2) == 1, (rows.shape, weights.shape)
    out = torch.empty(num_pairs, n, dtype=rows.dtype, device=rows.device)
    if num_pairs == 0:
        return out
    block_m, block_n, block_k = tile_shape(num_pairs)
    block_rows, block_experts = block_layout(routing, block_m)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        rows, weights, out, block_rows, block_experts, n, k, num_pairs, rows.stride(0), weights.stride(0),
        weights.stride(1), out.stride(0), UPCAST=interpreting(),
        PRECISION="ieee" if rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out
