"""Per-token fp8 (e4m3) quantization of activations in one Triton kernel; semantics:
punica.ops.fp8.quantize_per_token, bit for bit.

The torch form is a chain of kernels over x (to fp32, abs, amax, clamp, divide, clamp, convert),
each reading and writing [T, K]; before torch._scaled_mm of a 2,048-token prefill that chain cost
more than the GEMM saves over bf16. Here one program per token takes its row's amax, then divides
the row by the scale (an IEEE division, as torch's), clamps to +-448 and rounds to e4m3 (round to
nearest even), writing one byte per element and the row's float32 scale.

In a launch of at most MAX_WHOLE_ROWS_TOKENS rows (the W8A8 GEMM's decode-sized inputs), a row of
at most MAX_ROW_BLOCK elements is loaded once and held in registers (ROW_IN_REGISTERS): there each
program's chain of dependent loads is what the launch takes. Otherwise a row is read in
BLOCK-element pieces, twice (the second time mostly from L2). On an H100, in a CUDA graph
(`python -m benchmarks.layers_ops`, docs/benchmarks.md#fp8-activation-quantization): rows of 4,096
took 3.0-3.5 us a launch at 1-128 tokens held whole against 4.3-4.9 in pieces, rows of 11,008
5.4-6.5 against 10.0-10.9; at 2,048 tokens rows of 11,008 took 49.9 us held whole against 42.7.
The grid depends only on T: safe under CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_ACTIVATION_AMAX

BLOCK = 1024            # the elements of a row a program loads at once, where the row is read in pieces
MAX_ROW_BLOCK = 16384   # the longest row (rounded up to a power of two) held in registers whole
MAX_WHOLE_ROWS_TOKENS = 128  # launches of at most this many rows hold them whole (module docstring)
ROW_ELEMENTS_PER_THREAD = 32  # a row held whole: the warps are sized to give each thread this many


@triton.jit
def _quantize_rows_kernel(x, out, scales, K, stride_xm, stride_om, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                          BLOCK: tl.constexpr, ROW_IN_REGISTERS: tl.constexpr):
    """Row program_id(0) of x quantized; ROW_IN_REGISTERS: BLOCK >= K, the row loaded once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ROW_IN_REGISTERS:
        mask = offs < K
        v = tl.load(x + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), axis=0), MIN_AMAX) / FP8_MAX
        tl.store(scales + row, scale)
        q = tl.clamp(tl.math.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(out + row * stride_om + offs, q.to(out.dtype.element_ty), mask=mask)
        return
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


def row_launch(t: int, k: int) -> tuple[int, bool, int]:
    """(BLOCK, ROW_IN_REGISTERS, num_warps) of t rows of k elements (module docstring)."""
    whole = triton.next_power_of_2(max(k, 1))
    if t <= MAX_WHOLE_ROWS_TOKENS and whole <= MAX_ROW_BLOCK:
        return whole, True, min(16, max(1, whole // (32 * ROW_ELEMENTS_PER_THREAD)))
    return BLOCK, False, 4


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
        block, in_registers, warps = row_launch(t, k)
        _quantize_rows_kernel[(t,)](x, out, scales, k, x.stride(0), out.stride(0), FP8_MAX=FP8_MAX,
                                    MIN_AMAX=MIN_ACTIVATION_AMAX, BLOCK=block, ROW_IN_REGISTERS=in_registers,
                                    num_warps=warps)
    return out, scales
