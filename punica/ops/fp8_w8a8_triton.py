"""fp8 x fp8 GEMM in Triton for mid-size batches; semantics: punica.ops.fp8.fp8_linear_scaled_mm.

x is quantized per token (punica.ops.fp8_quant_triton: scale_t = amax(|x[t]|) / 448), then one
program per (BLOCK_M tokens, BLOCK_N output features) tile multiplies e4m3 by e4m3 on the tensor
cores over its K range, accumulating in fp32, and multiplies the accumulator by the token's and
the output feature's scales. cuBLASLt's fp8 GEMM (torch._scaled_mm) leaves most of the H200's
bandwidth unused at 17-128 tokens (a 4096 x 4096 weight: 18.6 us against a 4.0 us floor); this
kernel streams the weight in 128-column K steps through a 4-stage pipeline, and splits K over
several programs where the unsplit grid would leave SMs idle.

With a split over K each program writes its scaled fp32 partial (the scales are per row and per
column, so they apply to each partial alike) and a second kernel sums the slices in order (no
atomics: the same result on every run), adds the bias and rounds. The tile and the split depend
only on shapes and the SM count: no syncs, safe under CUDA-graph capture. Under the interpreter
the operands are upcast to fp32 before tl.dot (it has no fp8 product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.fp8_quant_triton import quantize_per_token_triton
from punica.ops.linear_triton import split_k_sum, split_k_tile
from punica.ops.triton_env import interpreting, num_sms

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 128
NUM_WARPS, NUM_STAGES = 4, 4
SPLIT_K = 4
MIN_SPLIT_COLUMNS = 1024  # K columns a slice keeps at least


@triton.jit
def _w8a8_gemm_kernel(x8, x_scales, w, w_scales, bias, out, partial, M, N, K, k_per_split, stride_xm, stride_wn,
                      stride_om, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """out's (BLOCK_M, BLOCK_N) tile, or with SPLIT_K > 1 the scaled fp32 partial of K slice
    program_id(2) (columns k_per_split * slice ..) into partial[slice]."""
    offs_m, offs_n, offs_k, m_ok, n_ok, k_lo, k_hi = split_k_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N, BLOCK_K)
    pid_k = tl.program_id(2)
    a_ptrs = x8 + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    b_ptrs = w + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = k0 + offs_k < k_hi
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= (tl.load(x_scales + offs_m, mask=m_ok, other=0.0)[:, None]
            * tl.load(w_scales + offs_n, mask=n_ok, other=0.0)[None, :])
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.store(partial + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc, mask=mask)
        return
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty), mask=mask)


def split_for(m: int, n: int, k: int, device: torch.device) -> int:
    """K slices: SPLIT_K where the unsplit grid has fewer tiles than the device has SMs and each slice
    keeps MIN_SPLIT_COLUMNS of K (twice that where the grid already fills half the SMs), else 1.
    From benchmarks.decode_gemm --weights fp8 on the H200 (docs/benchmarks.md): at 64 tokens o
    (4096 x 4096, 64 tiles) and down (4096 x 11008) take 15.0 and 29.5 us split in four; at 96-128
    tokens (128 tiles) o takes 17.8 us unsplit against 19.5 split, down 38.5 split against 42.6
    unsplit; qkv and gate_up (192 and 344 tiles) are fastest unsplit."""
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    sms = num_sms(device)
    if tiles >= sms:
        return 1
    min_columns = MIN_SPLIT_COLUMNS if 2 * tiles <= sms else 2 * MIN_SPLIT_COLUMNS
    return SPLIT_K if k >= SPLIT_K * min_columns else 1


def fp8_linear_w8a8_triton(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) for weight [N, K] e4m3 with per-channel scales [N], x quantized per
    token; out in x's dtype. split_k: split_for's by default."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.is_contiguous() and scales.dtype == torch.float32, (weight.stride(), scales.dtype)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x8, x_scales = quantize_per_token_triton(x)
    split_k = split_k or split_for(m, n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), BLOCK_K) * BLOCK_K
    split_k = triton.cdiv(k, k_per_split)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    _w8a8_gemm_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), split_k)](
        x8, x_scales, weight, scales, bias if bias is not None else out, out, partial, m, n, k, k_per_split,
        x8.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, UPCAST=interpreting(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT_K=split_k, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    if split_k > 1:
        split_k_sum(partial, out, None, bias)
    return out
