"""e4m3 -> bf16 in the Triton kernels that read fp8 (the weight-only GEMM, the fp8 KV pages).

Triton widens float8e4nv to bf16 through fp16 (cvt.rn.f16x2.e4m3x2, then fp16 -> bf16): three
instructions of the narrow conversion pipe per two values, which held the weight-only fp8 GEMM back
on the H200 (docs/benchmarks.md: 93 -> 86 us over a 7B layer's four projections at 1-16 tokens).
`widen_e4m3` builds the bf16 bits with integer ops instead: a byte's sign goes to bit 15 and its 7
exponent and mantissa bits to bits 10..4, three instructions per two values: one prmt puts byte 0
in bits 15..8 and its sign, replicated, in bits 23..16 (byte 1 in bits 31..24); an arithmetic shift
right by 4 moves each byte to bits 11..4 (27..20) with copies of its sign above it, where bit 15
(31) takes one; an and keeps bits 15 and 10..4 of each half. Those bits read as the e4m3 value
times 2^-120 (the exponent biases are 7 and 127), e4m3 subnormals included (exponent 0 lands on
bf16's subnormals); one bf16x2 FMA by 2^120, adding -0 to keep signed zeros, restores the value
exactly. NaN (0x7f, 0xff) becomes +-480: the weights and the KV cache hold only finite values
(their quantization saturates).

PTX does not run under Triton's interpreter; the kernels' interpreter paths (UPCAST) widen to
fp32 with a plain cast and never reach the bf16 branch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def widen_e4m3(x, dtype: tl.constexpr):
    """x (float8e4nv) as `dtype`: by integer ops for bf16 (module docstring), else a cast. The PTX
    takes four e4m3 bytes in $2 (byte i = element i) and writes four bf16, elements 0 and 1 in $0,
    2 and 3 in $1."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, two120, nzero;
            mov.b32 two120, 0x7B807B80;
            mov.b32 nzero, 0x80008000;
            prmt.b32 lo, $2, 0, 0x1804;
            prmt.b32 hi, $2, 0, 0x3A24;
            shr.s32 lo, lo, 4;
            shr.s32 hi, hi, 4;
            and.b32 lo, lo, 0x87F087F0;
            and.b32 hi, hi, 0x87F087F0;
            fma.rn.bf16x2 $0, lo, two120, nzero;
            fma.rn.bf16x2 $1, hi, two120, nzero;
            }""",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)
    return x.to(dtype)
