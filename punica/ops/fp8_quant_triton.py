"""Per-token fp8 (e4m3) quantization of activations in one Triton kernel; semantics:
punica.ops.fp8.quantize_per_token, bit for bit.

The torch form is a chain of kernels over x (to fp32, abs, amax, clamp, divide, clamp, convert),
each reading and writing [T, K]; before torch._scaled_mm of a 2,048-token prefill that chain cost
more than the GEMM saves over bf16. Here one program per token reads its row twice (the second
time mostly from L2): once for amax, once to divide by the scale (an IEEE division, as torch's),
clamp to +-448 and round to e4m3 (round to nearest even), writing one byte per element and the
row's float32 scale. The grid depends only on T: safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_ACTIVATION_AMAX

BLOCK = 1024  # the elements of a row a program loads at once


@triton.jit
def _quantize_rows_kernel(x, out, scales, K, stride_xm, stride_om,
                          FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        v = tl.load(x + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) / FP8_MAX
    tl.store(scales + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        v = tl.load(x + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(out + row * stride_om + start + offs, q.to(out.dtype.element_ty), mask=mask)


def quantize_per_token_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, K] e4m3fn, scales [T, 1] float32) of activations x [T, K]: any row stride; copied first
    where K's stride is not 1."""
    assert x.dim() == 2, x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    t, k = x.shape
    out = torch.empty(t, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        _quantize_rows_kernel[(t,)](x, out, scales, k, x.stride(0), out.stride(0),
                                    FP8_MAX=FP8_MAX, MIN_AMAX=MIN_ACTIVATION_AMAX, BLOCK=BLOCK)
    return out, scales
