"""The fp8 x fp8 GEMM (punica.ops.fp8_w8a8_triton) against its spec: x quantized per token, the
e4m3 product accumulated in fp32, times the token's and the output feature's scales, plus bias.

Without a GPU the kernel runs under the interpreter (tests/conftest.py) at tiny fp32 shapes, its
product taken from the quantization kernel's own bytes (whose rounding the interpreter does its
own way: tests/ops/test_fp8_quant_triton.py); tests marked `cuda` run bf16 at real shapes through
punica.ops.fp8.fp8_linear, against the bf16 reference and _scaled_mm on the same quantized input.
"""

import pytest
import torch

from punica.ops import fp8
from punica.ops import fp8_w8a8_triton as kernels
from punica.ops.fp8_quant_triton import quantize_per_token_triton


def spec(x, weight, scales, bias):
    """x8 @ W8^T in fp32, scaled per token and per output feature, plus bias, in x's dtype."""
    x8, x_scales = quantize_per_token_triton(x)
    out = (x8.float() @ weight.float().T) * x_scales * scales[None, :]
    return (out if bias is None else out + bias.float()).to(x.dtype)


def random_weight(n, k, gen, device="cpu"):
    weight, scales = fp8.quantize_per_channel(torch.randn(n, k, generator=gen) * 0.02)
    return weight.to(device), scales.to(device)


@pytest.mark.parametrize("num_tokens,n,k", [(1, 40, 72), (17, 70, 300), (70, 33, 130)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_kernel_matches_spec(num_tokens, n, k, with_bias, split_k):
    """Ragged M, N and K tails (K steps of 128), two M tiles, a split into slices whose last is ragged."""
    gen = torch.Generator().manual_seed(num_tokens * n + k)
    weight, scales = random_weight(n, k, gen)
    x = torch.randn(num_tokens, k + 5, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = kernels.fp8_linear_w8a8_triton(x, weight, scales, bias, split_k=split_k)
    torch.testing.assert_close(got, spec(x, weight, scales, bias), rtol=1e-5, atol=1e-5)


def test_split_only_where_the_grid_leaves_sms_idle_and_slices_stay_long(monkeypatch):
    monkeypatch.setattr(kernels, "num_sms", lambda device: 132)  # the H200's
    cpu = torch.device("cpu")
    split = kernels.SPLIT_K
    assert kernels.split_for(64, 4096, 4096, cpu) == split  # 64 tiles: slices of 1024 columns
    assert kernels.split_for(64, 4096, 2048, cpu) == 1  # slices of 512 columns
    assert kernels.split_for(128, 4096, 4096, cpu) == 1  # 128 tiles want slices of 2048 columns
    assert kernels.split_for(128, 4096, 11008, cpu) == split
    assert kernels.split_for(64, 12288, 4096, cpu) == 1  # 192 tiles fill the SMs


def test_no_tokens():
    weight, scales = random_weight(8, 16, torch.Generator().manual_seed(0))
    assert kernels.fp8_linear_w8a8_triton(torch.empty(0, 16), weight, scales).shape == (0, 8)


COMPILE_SCRIPT = """
from punica.ops import fp8_w8a8_triton as k

POINTERS = {"x8": "*fp8e4nv", "w": "*fp8e4nv", "x_scales": "*fp32", "w_scales": "*fp32", "partial": "*fp32",
            "bias": "*bf16", "out": "*bf16"}
for split_k, has_bias in ((1, True), (4, False)):
    compile_ttir(k._w8a8_gemm_kernel, dict(HAS_BIAS=has_bias, UPCAST=False, BLOCK_M=k.BLOCK_M, BLOCK_N=k.BLOCK_N,
                                           BLOCK_K=k.BLOCK_K, SPLIT_K=split_k),
                 lambda name, consts: POINTERS.get(name, "i32"))
"""


@pytest.mark.slow
def test_kernel_compiles_for_cuda(compile_for_cuda):
    compile_for_cuda(COMPILE_SCRIPT)


def bf16_error(got, expect):
    return ((got.float() - expect.float()).norm() / expect.float().norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [fp8.WEIGHT_ONLY_MAX_TOKENS + 1, 64, fp8.W8A8_MAX_TOKENS])
@pytest.mark.parametrize("n,k", [(4096, 4096), (12288, 4096), (4096, 11008), (1024, 3584)])
def test_w8a8_path_real_shapes(num_tokens, n, k):
    """fp8_linear takes this kernel; within 4% of the bf16 reference (x's rounding to e4m3), and within
    bf16 rounding of _scaled_mm, which multiplies the same quantized operands."""
    gen = torch.Generator().manual_seed(n + k + num_tokens)
    weight, scales = random_weight(n, k, gen, "cuda")
    x = torch.randn(num_tokens, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    assert fp8.gemm_path(x, weight, None) == "w8a8"
    got = fp8.fp8_linear(x, weight, scales, None, bias)
    assert bf16_error(got, fp8.fp8_linear_ref(x, weight, scales, None, bias)) < 4e-2
    assert bf16_error(got, fp8.fp8_linear_scaled_mm(x, weight, scales, bias)) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens,beside_lora,path", [
    (fp8.WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA, True, "weight_only"),
    (fp8.WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA + 1, True, "w8a8"),
    (fp8.WEIGHT_ONLY_MAX_TOKENS, True, "w8a8"),
    (fp8.WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA + 1, False, "weight_only"),
])
def test_path_beside_lora(num_tokens, beside_lora, path):
    """Beside LoRA's side stream the W8A8 GEMM takes over from fewer tokens; fp8_linear runs the path
    gemm_path names (its output is the W8A8 kernel's exactly where that is the path)."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight, scales = random_weight(4096, 4096, gen, "cuda")
    x = torch.randn(num_tokens, 4096, generator=gen).to("cuda", torch.bfloat16)
    assert fp8.gemm_path(x, weight, None, beside_lora) == path
    got = fp8.fp8_linear(x, weight, scales, None, beside_lora=beside_lora)
    assert torch.equal(got, kernels.fp8_linear_w8a8_triton(x, weight, scales)) == (path == "w8a8")
    assert bf16_error(got, fp8.fp8_linear_ref(x, weight, scales, None)) < 4e-2
