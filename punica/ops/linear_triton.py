"""The skinny GEMM in Triton: decode's x @ W^T for a few token rows; semantics: punica.ops.linear.

A decode step's GEMMs read each weight once for a handful of rows: they are bound by the
weight's bytes, and what decides their speed is how evenly and how deeply the SMs stream W.
One program per BLOCK_N output features (and, with SPLIT_K > 1, per K slice) loops over its K
range in BLOCK_K steps: it loads W's [BLOCK_N, BLOCK_K] tile (rows contiguous along K, so the
loads are wide and coalesced) and x's [BLOCK_M, BLOCK_K] tile (all rows: BLOCK_M covers the
token count), and accumulates x @ W^T in fp32 on the tensor cores. Without a split it adds the
bias and writes the output in x's dtype; with one it writes an fp32 partial per K slice, and a
second kernel sums the slices, adds the bias and rounds (a fixed order: no atomics, the same
result on every run).

The tiles and the grid depend only on shapes, never on values: safe under CUDA-graph capture.
Under the interpreter the operands are upcast to fp32 before tl.dot (it multiplies bf16
operands as raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.linear_tiles import Tile
from punica.ops.triton_env import interpreting


@triton.jit
def _skinny_gemm_kernel(x, w, bias, out, partial, M, N, K, k_per_split, stride_xm, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[:, n-tile] = x @ W[n-tile]^T (+ bias), or with SPLIT_K > 1 the fp32 partial of K slice
    program_id(1) (columns k_per_split * slice ..) into partial[slice]. EVEN_K: every K slice is
    whole BLOCK_K steps, and the loads need no K mask (which could keep them from being wide)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < k_hi
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        p_ptrs = partial + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=mask)
        return
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=mask)


@triton.jit
def split_k_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile of a program of a (M tiles, N tiles, K slices) grid: its rows, columns and K step
    offsets, which rows and columns are inside M and N, and its K range [k_lo, k_hi)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * k_per_split
    return offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N, k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def _split_k_sum_kernel(partial, scales, bias, out, M, N, stride_om,
                        HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over the K slices of partial [SPLIT_K, M, N] (times the column's scale) (+ bias), in
    slice order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(partial + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partial + s * M * N + offs, mask=ok, other=0.0)
    row, col = offs // N, offs % N
    if HAS_SCALES:
        acc *= tl.load(scales + col, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + row.to(tl.int64) * stride_om + col, acc.to(out.dtype.element_ty), mask=ok)


def block_m_for(num_tokens: int) -> int:
    """Rows of the tile: every token row at once (tl.dot takes at least 16)."""
    return max(16, triton.next_power_of_2(num_tokens))


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """punica.ops.linear.linear by the skinny kernel with `tile`; x [M, K] (rows may be strided, K
    contiguous), weight [N, K] contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == k, (x.stride(), weight.shape)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, tile.split_k), tile.block_k) * tile.block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    has_bias = bias is not None
    _skinny_gemm_kernel[(triton.cdiv(n, tile.block_n), split_k)](
        x, weight, bias if has_bias else out, out, partial, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=has_bias, UPCAST=interpreting(), EVEN_K=k % k_per_split == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m_for(m), BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, SPLIT_K=split_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if split_k > 1:
        split_k_sum(partial, out, None, bias)
    return out


def split_k_sum(partial: torch.Tensor, out: torch.Tensor, scales: torch.Tensor | None,
                bias: torch.Tensor | None) -> None:
    """out [M, N] = sum of partial [S, M, N] over S in order, times scales [N] fp32 (if given), plus bias
    [N] (if given), rounded once to out's dtype."""
    _, m, n = partial.shape
    block = 1024
    _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
        partial, scales if scales is not None else partial, bias if bias is not None else out, out, m, n,
        out.stride(0), HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, SPLIT_K=partial.shape[0],
        BLOCK=block, num_warps=4)
