"""punica.ops.fp8_widen_triton: e4m3 -> bf16 by integer ops gives torch's bf16 of every finite
e4m3 value, bit for bit (signed zeros and subnormals included); other dtypes take the plain cast."""

import pytest
import torch
import triton
import triton.language as tl

from punica.ops.fp8_widen_triton import widen_e4m3


@triton.jit
def _widen_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(src + offs, mask=ok, other=0.0)
    tl.store(dst + offs, widen_e4m3(x, dst.dtype.element_ty), mask=ok)


def finite_e4m3(device) -> torch.Tensor:
    """Every e4m3fn bit pattern but the two NaNs (0x7f, 0xff), repeated in a shuffled order so each
    value sits at every position of a group of four (the PTX widens four at a time)."""
    bits = torch.arange(256, dtype=torch.int32)
    bits = bits[(bits & 0x7F) != 0x7F].to(torch.uint8)
    gen = torch.Generator().manual_seed(0)
    bits = torch.cat([bits[torch.randperm(len(bits), generator=gen)] for _ in range(8)] + [bits[:3]])
    return bits.view(torch.float8_e4m3fn).to(device)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_widen_matches_torch_bit_for_bit(dtype):
    x = finite_e4m3("cuda")
    got = torch.empty(x.shape, dtype=dtype, device="cuda")
    block = 512
    _widen_kernel[(triton.cdiv(x.numel(), block),)](x, got, x.numel(), BLOCK=block)
    expect = x.to(dtype)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    mismatch = (got.view(int_dtype) != expect.view(int_dtype)).nonzero().flatten()
    assert mismatch.numel() == 0, [(x[i].view(torch.uint8).item(), expect[i].item(), got[i].item())
                                   for i in mismatch[:8].tolist()]
