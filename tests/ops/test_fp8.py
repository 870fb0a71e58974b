"""FP8 weights (punica.ops.fp8): quantization and dequantization semantics, and the weight-only
Triton kernel and torch._scaled_mm (per-token activation scales) against the reference on fresh
random inputs (the W8A8 Triton GEMM: test_fp8_w8a8_triton.py).

Without a GPU the Triton kernel runs under the interpreter (tests/conftest.py) at tiny fp32 shapes;
tests marked `cuda` run bf16 at real shapes on the GPU, through the public function.
"""


import pytest
import torch

from punica.ops import fp8
from punica.ops import fp8_triton as kernels

FP8_STEP = 2 ** -3  # e4m3 keeps 3 mantissa bits: a normal value rounds within half of this, relative


def random_fp8(n, k, block_size, gen, device="cpu"):
    """(weight e4m3 [n, k], float32 scales) of the layout `block_size`, over e4m3's whole range."""
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(fp8.FP8_DTYPE)
    shape = (n,) if block_size is None else (-(-n // block_size[0]), -(-k // block_size[1]))
    scales = torch.rand(shape, generator=gen) * 1e-3 + 1e-4
    return weight.to(device), scales.to(device)


def test_quantize_per_channel_maps_each_row_amax_to_448_and_rounds_within_e4m3():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 50, generator=gen) * torch.logspace(-4, 2, 6)[:, None]
    w[3] = 0.0
    weight, scales = fp8.quantize_per_channel(w.to(torch.bfloat16))
    assert weight.dtype == fp8.FP8_DTYPE and scales.dtype == torch.float32 and scales.shape == (6,)
    expect_scales = w.to(torch.bfloat16).float().abs().amax(dim=1) / 448
    expect_scales[3] = 1.0
    torch.testing.assert_close(scales, expect_scales, rtol=0, atol=0)
    assert torch.equal(weight.float().abs().amax(dim=1), torch.tensor([448.0] * 3 + [0.0] + [448.0] * 2))
    back = fp8.dequantize(weight, scales, None, torch.float32)
    err = (back - w.to(torch.bfloat16).float()).abs()
    # normal e4m3 values round within half a step; values below 2^-6 * scale are subnormal (absolute step 2^-9)
    assert (err <= w.abs() * FP8_STEP / 2 + scales[:, None] * 2 ** -10).all()


def test_block_scales_cover_their_blocks_with_ragged_edges():
    gen = torch.Generator().manual_seed(1)
    weight, scales = random_fp8(5, 7, (2, 3), gen)
    got = fp8.dequantize(weight, scales, (2, 3), torch.float32)
    for n in range(5):
        for k in range(7):
            assert got[n, k] == weight[n, k].float() * scales[n // 2, k // 3]
    x = torch.randn(4, 7, generator=gen)
    torch.testing.assert_close(fp8.fp8_linear(x, weight, scales, (2, 3)), x @ got.T)


def test_quantize_per_token():
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0]])
    x8, scales = fp8.quantize_per_token(x)
    torch.testing.assert_close(scales, torch.tensor([[3.0 / 448], [1e-12 / 448]]))
    assert torch.equal(x8.float()[1], torch.zeros(3)) and x8.float()[0, 1] == -448.0


@pytest.mark.parametrize("block_size", [None, (16, 32), (32, 16), (8, 48)], ids=str)
@pytest.mark.parametrize("num_tokens,n,k", [(1, 40, 72), (5, 33, 48), (17, 70, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("tile", [None, kernels.Fp8Tile(16, 16, 16, 3, 4, 3)], ids=["default", "split_k"])
def test_weight_only_kernel_matches_reference(block_size, num_tokens, n, k, with_bias, tile):
    """fp32 activations, a strided x, ragged N and K tails; K steps inside scale blocks of 16, 32 and 48;
    the default tile and a split over K into three slices (the last one ragged)."""
    gen = torch.Generator().manual_seed(num_tokens * n + k)
    weight, scales = random_fp8(n, k, block_size, gen)
    x = torch.randn(num_tokens, k + 5, generator=gen)[:, :k]
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = kernels.fp8_linear_triton(x, weight, scales, block_size, bias, tile)
    torch.testing.assert_close(got, fp8.fp8_linear_ref(x, weight, scales, block_size, bias), rtol=1e-5, atol=1e-5)


def test_decode_tiles_split_k_only_for_grids_smaller_than_the_sms():
    """Up to 16 tokens K is split where the tiles of 32 outputs do not fill the SMs (a 7B's o and
    down on 132 SMs), not where they do (qkv, gate_up), and never where K is under 4 x 1,024."""
    splits = {(n, k): kernels.fp8_tile(1, n, k, True, 132).split_k
              for n, k in [(4096, 4096), (4096, 11008), (12288, 4096), (22016, 4096), (4096, 2048)]}
    assert splits == {(4096, 4096): kernels.SPLIT_K, (4096, 11008): kernels.SPLIT_K, (12288, 4096): 1,
                      (22016, 4096): 1, (4096, 2048): 1}
    assert kernels.fp8_tile(16, 12288, 4096, True, 1000).split_k == kernels.SPLIT_K


def test_tiles_of_17_to_32_tokens_split_k_only_for_grids_smaller_than_the_sms():
    """At 17-32 tokens (32 x 64 tiles) likewise: o and down of a 7B split on 132 SMs, qkv and
    gate_up (192 and 344 tiles) not."""
    splits = {(n, k): kernels.fp8_tile(32, n, k, True, 132)
              for n, k in [(4096, 4096), (4096, 11008), (12288, 4096), (22016, 4096)]}
    assert {key: tile.split_k for key, tile in splits.items()} == {
        (4096, 4096): kernels.SPLIT_K, (4096, 11008): kernels.SPLIT_K, (12288, 4096): 1, (22016, 4096): 1}
    assert {(tile.block_m, tile.block_n) for tile in splits.values()} == {(32, 64)}
    assert kernels.fp8_tile(17, 12288, 4096, True, 132).split_k == 1


def test_block_k_divides_the_scale_blocks():
    assert kernels.block_k_for(None) == kernels.MAX_BLOCK_K
    assert [kernels.block_k_for((128, b1)) for b1 in (128, 256, 64, 48, 24)] == [128, 128, 64, 16, None]


COMPILE_SCRIPT = """
import itertools

from punica.ops.fp8_triton import DECODE_BLOCK_K, MAX_BLOCK_K
from punica.ops.fp8_triton import _fp8_gemm_kernel as fn

POINTERS = {"x": "*bf16", "out": "*bf16", "bias": "*bf16", "w": "*fp8e4nv", "scales": "*fp32", "partial": "*fp32"}
for per_channel, has_bias, split_k in itertools.product((False, True), (False, True), (1, 4)):
    consts = dict(PER_CHANNEL=per_channel, HAS_BIAS=has_bias, UPCAST=False, PRECISION="tf32", BLOCK_M=16,
                  BLOCK_N=32, BLOCK_K=DECODE_BLOCK_K if per_channel else MAX_BLOCK_K, SPLIT_K=split_k)
    compile_ttir(fn, consts, lambda name, consts: POINTERS.get(name, "i32"))
"""


@pytest.mark.slow
def test_weight_only_kernel_compiles_for_cuda(compile_for_cuda):
    """Triton's front end (to TTIR, on the CPU) accepts the kernel in every variant: the interpreter
    above accepts code the compiler rejects."""
    compile_for_cuda(COMPILE_SCRIPT)


# ---- CUDA: real shapes, bf16 ----------------------------------------------------------------------

CUDA_SHAPES = [(4096, 4096), (12288, 4096), (4096, 11008), (1024, 3584)]


def bf16_close(got, expect, rel):
    """Relative error of the whole output (Frobenius) within `rel`."""
    err = (got.float() - expect.float()).norm() / expect.float().norm()
    assert err < rel, err.item()


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [None, (128, 128)], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 16, 17, 32, 64, 256, 300])
@pytest.mark.parametrize("n,k", CUDA_SHAPES)
def test_weight_only_kernel_real_shapes(block_size, num_tokens, n, k):
    gen = torch.Generator().manual_seed(n + k + num_tokens)
    weight, scales = random_fp8(n, k, block_size, gen, "cuda")
    x = torch.randn(num_tokens, k, generator=gen).to("cuda", torch.bfloat16)
    got = kernels.fp8_linear_triton(x, weight, scales, block_size)
    bf16_close(got, fp8.fp8_linear_ref(x, weight, scales, block_size), 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [fp8.W8A8_MAX_TOKENS + 1, 1000])
@pytest.mark.parametrize("n,k", CUDA_SHAPES)
def test_scaled_mm_path_real_shapes(num_tokens, n, k):
    """Per-token fp8 activations: the error of rounding x to e4m3 (~2^-5 relative per element) averages
    down over K; the whole output stays within 4% of the bf16 reference."""
    gen = torch.Generator().manual_seed(n + k + num_tokens)
    w = torch.randn(n, k, generator=gen).to("cuda") * 0.02
    weight, scales = fp8.quantize_per_channel(w)
    x = torch.randn(num_tokens, k, generator=gen).to("cuda", torch.bfloat16)
    assert fp8.gemm_path(x, weight, None) == "scaled_mm"
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16)
    bf16_close(fp8.fp8_linear(x, weight, scales, None, bias), fp8.fp8_linear_ref(x, weight, scales, None, bias), 4e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [8, 128])
@pytest.mark.parametrize("block_size", [None, (128, 128)], ids=str)
def test_cuda_graph_replay_equals_eager(num_tokens, block_size, capture_graph):
    gen = torch.Generator().manual_seed(3)
    weight, scales = random_fp8(4096, 4096, block_size, gen, "cuda")
    x = torch.randn(num_tokens, 4096, generator=gen).to("cuda", torch.bfloat16)
    eager = fp8.fp8_linear(x, weight, scales, block_size)
    graph, out = capture_graph(lambda: fp8.fp8_linear(x, weight, scales, block_size))
    x.copy_(torch.randn(num_tokens, 4096, generator=gen).to("cuda", torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8.fp8_linear(x, weight, scales, block_size))
    assert not torch.equal(out, eager)
