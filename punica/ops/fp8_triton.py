"""The weight-only fp8 GEMM in Triton; semantics: punica.ops.fp8.fp8_linear.

One program per (BLOCK_M tokens, BLOCK_N output features) tile loops over K in BLOCK_K steps:
it loads x's tile in its dtype and the weight's [BLOCK_K, BLOCK_N] tile as e4m3 (one byte per
element: decode is bound by these bytes), widens the weight to x's dtype (exact: every e4m3
value is a bf16/fp16 value) and accumulates the tile product in fp32. Per-channel scales
multiply the accumulator once at the end; block scales multiply each K step's partial product
by the scales of its K block (BLOCK_K divides B1, so a K step lies in one block), one per output
feature of the tile. Bias and the rounding to x's dtype come last.

The tile shape depends only on the token count and N, the grid only on shapes: no syncs, safe
under CUDA-graph capture. Under the interpreter the operands are upcast to fp32 before tl.dot
(it multiplies bf16 operands as raw bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.triton_env import interpreting

MAX_BLOCK_K = 128
DECODE_BLOCK_K = 256  # the K step of decode tiles with per-channel scales (see tile_shape)


@triton.jit
def _fp8_gemm_kernel(x, w, scales, bias, out, M, N, K, stride_xm, stride_xk, stride_wn, stride_om,
                     stride_sn, stride_sk, scale_rows, scale_cols,
                     PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = scales + (offs_n // scale_rows) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b.to(a.dtype), input_precision=PRECISION)
        if PER_CHANNEL:
            acc += part
        else:
            s = tl.load(s_ptrs + (k0 // scale_cols) * stride_sk, mask=n_mask, other=0.0)
            acc += part * s[None, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    if PER_CHANNEL:
        acc *= tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


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


def tile_shape(num_tokens: int, block_k: int, per_channel: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a token count; block_k: block_k_for's K step. Up
    to 16 tokens (decode): 16 x 32 tiles, and with per-channel scales K steps of DECODE_BLOCK_K, the
    best single shape over a 7B layer's four projections in a sweep on the H200 (docs/benchmarks.md):
    136 us a layer at 1 token and 121 at 16, against 179 and 190 with K steps of 128 (and 16 x 64
    tiles where N > 8192), and 151 for bf16. More tokens: 32 x 64, then 64 x 64 tiles."""
    if num_tokens <= 16:
        return 16, 32, DECODE_BLOCK_K if per_channel else block_k, 4
    if num_tokens <= 64:
        return 32, 64, block_k, 4
    return 64, 64, block_k, 4


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      block_size: tuple[int, int] | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """punica.ops.fp8.fp8_linear by the weight-only kernel; x [T, K] with any row stride."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.is_contiguous() and scales.dtype == torch.float32, (weight.stride(), scales.dtype)
    block_k = block_k_for(block_size)
    assert block_k is not None, f"no K step divides the scale blocks {block_size}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per_channel = block_size is None
    block_m, block_n, block_k, num_warps = tile_shape(m, block_k, per_channel)
    scale_rows, scale_cols = (1, k) if per_channel else block_size
    stride_sn, stride_sk = (scales.stride(0), 0) if per_channel else scales.stride()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](
        x, weight, scales, bias if bias is not None else scales, out, m, n, k, x.stride(0), x.stride(1),
        weight.stride(0), out.stride(0), stride_sn, stride_sk, scale_rows, scale_cols,
        PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, UPCAST=interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
