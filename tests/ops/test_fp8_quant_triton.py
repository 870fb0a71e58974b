"""The per-token fp8 activation quantization kernel (punica.ops.fp8_quant_triton) against its spec,
punica.ops.fp8.quantize_per_token: the same scales and the same e4m3 bytes.

Without a GPU the kernel runs under the interpreter (tests/conftest.py), whose fp32 -> e4m3
conversion rounds ties away from zero and does not carry a rounding up into the next power of two
(-125.9 becomes -64, not -128): there the bytes are compared wherever torch rounded toward zero
and not from a tie (about half of them). The CUDA test compares every byte at real shapes.
"""

import pytest
import torch

from punica.ops import fp8
from punica.ops.fp8_quant_triton import BLOCK, MAX_ROW_BLOCK, MAX_WHOLE_ROWS_TOKENS, quantize_per_token_triton


def activations(num_tokens, k, gen, dtype, device="cpu"):
    """Rows over twelve orders of magnitude, one row of zeros, and a strided view."""
    x = torch.randn(num_tokens, k + 3, generator=gen) * torch.logspace(-6, 6, num_tokens)[:, None]
    x[num_tokens // 2] = 0.0
    return x.to(device, dtype)[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "k"), [(6, 7), (6, BLOCK), (6, 2 * BLOCK + 5),
                                               (6, MAX_ROW_BLOCK + 5), (MAX_WHOLE_ROWS_TOKENS + 1, 2 * BLOCK + 5)],
                         ids=["whole", "whole-block", "whole-odd", "pieces-long-row", "pieces-many-rows"])
def test_kernel_matches_quantize_per_token(dtype, num_tokens, k):
    gen = torch.Generator().manual_seed(k)
    x = activations(num_tokens, k, gen, dtype)
    want8, want_scales = fp8.quantize_per_token(x)
    got8, got_scales = quantize_per_token_triton(x)
    assert got8.dtype == fp8.FP8_DTYPE and got8.shape == x.shape and got_scales.shape == (num_tokens, 1)
    assert torch.equal(got_scales, want_scales)
    want = want8.float()
    q = (x.float() / want_scales).abs()  # what was rounded
    exponent = torch.floor(torch.log2(want.abs().clamp(min=2 ** -9)))
    spacing = torch.exp2(exponent.clamp(min=-6) - 3)  # between e4m3 values at |want|
    rounded_down = (want.abs() <= q) & (q - want.abs() < spacing / 2)  # toward zero, not a tie
    compared = rounded_down | (q >= fp8.FP8_MAX)
    assert compared.float().mean() > 0.4
    assert torch.equal(got8.float()[compared], want[compared])


def test_no_tokens():
    got8, got_scales = quantize_per_token_triton(torch.empty(0, 16))
    assert got8.shape == (0, 16) and got_scales.shape == (0, 1)


COMPILE_SCRIPT = """
from punica.ops.fp8_quant_triton import BLOCK, MAX_ROW_BLOCK, _quantize_rows_kernel as fn

POINTERS = {"x": "*bf16", "out": "*fp8e4nv", "scales": "*fp32"}
for block, whole in ((MAX_ROW_BLOCK, True), (BLOCK, False)):
    compile_ttir(fn, dict(FP8_MAX=448.0, MIN_AMAX=1e-12, BLOCK=block, ROW_IN_REGISTERS=whole),
                 lambda name, consts: POINTERS.get(name, "i32"))
"""


@pytest.mark.slow
def test_kernel_compiles_for_cuda(compile_for_cuda):
    compile_for_cuda(COMPILE_SCRIPT)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 257, 2048])
@pytest.mark.parametrize("k", [4096, 11008, 3584, 28672])
def test_kernel_matches_quantize_per_token_byte_for_byte_on_cuda(num_tokens, k):
    gen = torch.Generator().manual_seed(num_tokens + k)
    x = activations(num_tokens, k, gen, torch.bfloat16, "cuda")
    want8, want_scales = fp8.quantize_per_token(x)
    got8, got_scales = quantize_per_token_triton(x)
    assert torch.equal(got_scales, want_scales)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8))


def test_a_view_strided_along_k_is_quantized_as_its_copy():
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(2)).T  # [5, 16], K's stride 5
    got8, got_scales = quantize_per_token_triton(x)
    want8, want_scales = quantize_per_token_triton(x.contiguous())
    assert torch.equal(got_scales, want_scales) and torch.equal(got8.float(), want8.float())
