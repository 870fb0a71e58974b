"""The weight-only fp8 GEMM in Triton; semantics: punica.ops.fp8.fp8_linear.

One program per (BLOCK_M tokens, BLOCK_N output features) tile loops over K in BLOCK_K steps: it
loads x's tile in its dtype and the weight's [BLOCK_K, BLOCK_N] tile as e4m3 (one byte per element:
decode is bound by these bytes), widens the weight to x's dtype (exact: every e4m3 value is a
bf16/fp16 value; to bf16 by integer ops, punica.ops.fp8_widen_triton) and accumulates the tile
product in fp32. Per-channel scales multiply the accumulator once at the end; block scales multiply
each K step's partial product by the scales of its K block (BLOCK_K divides B1, so a K step lies in
one block), one per output feature of the tile. Bias and the rounding to x's dtype come last. With
a split over K (for grids too small to fill the SMs), each program covers one K slice and writes
its fp32 partial; a second kernel sums the slices in order (no atomics: the same result on every
run), then applies the per-channel scales, the bias and the rounding.

The tile depends only on shapes, and so does the grid: no syncs, safe under CUDA-graph capture.
Under the interpreter the operands are upcast to fp32 before tl.dot (it multiplies bf16 operands
as raw bits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from punica.ops.fp8_widen_triton import widen_e4m3
from punica.ops.linear_triton import split_k_sum, split_k_tile
from punica.ops.triton_env import interpreting, num_sms

MAX_BLOCK_K = 128
DECODE_BLOCK_K = 256  # the K step of decode tiles with per-channel scales (see fp8_tile)
SPLIT_K = 4  # K slices of a tile up to 64 tokens (see fp8_tile)


@triton.jit
def _fp8_gemm_kernel(x, w, scales, bias, out, partial, M, N, K, k_per_split, stride_xm, stride_xk, stride_wn,
                     stride_om, stride_sn, stride_sk, scale_rows, scale_cols,
                     PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    """out's (BLOCK_M, BLOCK_N) tile over K, or with SPLIT_K > 1 the fp32 partial of K slice
    program_id(2) (columns k_per_split * slice ..) into partial[slice]: block-scaled, but without
    the per-channel scales and the bias, which the sum applies."""
    offs_m, offs_n, offs_k, m_mask, n_mask, k_lo, k_hi = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
    pid_k = tl.program_id(2)
    x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    w_ptrs = w + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None]
    s_ptrs = scales + (offs_n // scale_rows) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + offs_k < k_hi
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, widen_e4m3(b, a.dtype), input_precision=PRECISION)
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_ptrs + (k0 // scale_cols) * stride_sk, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    if SPLIT_K > 1:
        p_ptrs = partial + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
        return
    if PER_CHANNEL:
        acc *= tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


class Fp8Tile(NamedTuple):
    """A launch of the weight-only kernel: token rows and output features of a program, K columns
    per step, K slices (split_k > 1: fp32 partials summed by a second kernel), warps, pipeline stages."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def block_k_for(block_size: tuple[int, int] | None) -> int | None:
    """The K step: MAX_BLOCK_K, or for block scales the largest power of two <= MAX_BLOCK_K (and >= 16,
    tl.dot's least) dividing B1; None where there is none (fp8_linear then runs the reference)."""
    if block_size is None:
        return MAX_BLOCK_K
    step = MAX_BLOCK_K
    while step >= 16:
        if block_size[1] % step == 0:
            return step
        step //= 2
    return None


def fp8_tile(num_tokens: int, n: int, k: int, per_channel: bool, sms: int) -> Fp8Tile:
    """The tile for x [num_tokens, k] @ W^T (W [n, k]) on a device of `sms` SMs, from
    benchmarks.decode_gemm --weights fp8 on the H200 and a chain of a 7B's layers on the H100
    (docs/benchmarks.md; CUDA graphs reading the weights from memory).

    Up to 16 tokens 16 x 32 tiles, K steps of DECODE_BLOCK_K with per-channel scales; 17-32 tokens
    32 x 64 tiles; 33-64 and over 64 tokens 64 x 64 tiles (the weight-only path runs over 32 tokens
    only for block scales and what the fp8 tensor cores do not take: punica.ops.fp8's paths). Up
    to 64 tokens K is split into SPLIT_K slices where it holds SPLIT_K x 1,024 columns; up to 32
    tokens only where the grid has fewer tiles than SMs. A 4096 x 4096 weight has only 128 tiles
    of 32 outputs for 132 SMs and gains from the split; qkv (384 tiles) and gate_up (688) of a 7B
    take 19.6-19.8 and 33.4-33.8 us unsplit at 1-16 tokens against 21.3-22.0 and 35.1-35.5 split
    (H200), and a layer at 32 tokens takes 102.2 us with the split on o and down alone against
    110.9 with every GEMM split (H100)."""
    split_k = SPLIT_K if k >= SPLIT_K * 1024 else 1
    if num_tokens <= 32:
        block_m, block_n, block_k, stages = ((16, 32, DECODE_BLOCK_K if per_channel else MAX_BLOCK_K, 3)
                                             if num_tokens <= 16 else (32, 64, MAX_BLOCK_K, 4))
        if triton.cdiv(n, block_n) >= sms:
            split_k = 1
        return Fp8Tile(block_m, block_n, block_k, split_k, 4, stages)
    if num_tokens <= 64:
        return Fp8Tile(64, 64, MAX_BLOCK_K, split_k, 4, 4)
    return Fp8Tile(64, 64, MAX_BLOCK_K, 1, 4, 3)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      block_size: tuple[int, int] | None, bias: torch.Tensor | None = None,
                      tile: Fp8Tile | None = None) -> torch.Tensor:
    """punica.ops.fp8.fp8_linear by the weight-only kernel; x [T, K] with any row stride. `tile`:
    fp8_tile's by default; with block scales its K step is cut to block_k_for's where larger."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.is_contiguous() and scales.dtype == torch.float32, (weight.stride(), scales.dtype)
    max_block_k = block_k_for(block_size)
    assert max_block_k is not None, f"no K step divides the scale blocks {block_size}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per_channel = block_size is None
    tile = tile or fp8_tile(m, n, k, per_channel, num_sms(x.device))
    block_k = tile.block_k if per_channel else min(tile.block_k, max_block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, tile.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    scale_rows, scale_cols = (1, k) if per_channel else block_size
    stride_sn, stride_sk = (scales.stride(0), 0) if per_channel else scales.stride()
    grid = (triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n), split_k)
    _fp8_gemm_kernel[grid](
        x, weight, scales, bias if bias is not None else scales, out, partial, m, n, k, k_per_split, x.stride(0),
        x.stride(1), weight.stride(0), out.stride(0), stride_sn, stride_sk, scale_rows, scale_cols,
        PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, UPCAST=interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    if split_k > 1:
        split_k_sum(partial, out, scales if per_channel else None, bias)
    return out
