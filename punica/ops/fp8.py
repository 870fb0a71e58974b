"""FP8 (e4m3) base weights: quantization, dequantization and the GEMM over them.

A quantized projection holds `weight` [N, K] float8_e4m3fn and float32 `scales` in one of two
layouts (`block_size` says which):

    per output channel  block_size None     scales [N]:
                            W[n, k] = float32(weight[n, k]) * scales[n]
    blocks of B0 x B1   block_size (B0, B1) scales [ceil(N / B0), ceil(K / B1)]:
                            W[n, k] = float32(weight[n, k]) * scales[n // B0, k // B1]

(HF's fine-grained fp8 `weight_block_size` is (B0, B1), typically (128, 128); a per-tensor
scale is a per-channel one repeated over the rows it covers, which the loader does.)

`fp8_linear(x, weight, scales, block_size, bias)` = x @ W^T + bias in x's dtype. Its reference
(`fp8_linear_ref`, the spec, the CPU path) dequantizes W to x's dtype and runs F.linear. On CUDA:

  * token counts up to WEIGHT_ONLY_MAX_TOKENS (WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA where LoRA's side
    stream runs beside the GEMM: `beside_lora`), and block scales at any count: the weight-only
    Triton GEMM (punica.ops.fp8_triton), which streams the 1-byte weight, widens it to x's dtype
    in registers, and applies the scales to the fp32 accumulator (per K tile for block scales);
  * more tokens with per-channel scales (bf16 activations; N and K multiples of 16): the fp8
    tensor cores, x quantized per token on the fly by one Triton kernel (punica.ops.fp8_quant_triton;
    `quantize_per_token`: scale_t = amax(|x[t]|) / 448) and the token's and the weight's
    per-channel scales applied to the fp32 accumulator: up to W8A8_MAX_TOKENS by a Triton GEMM
    (punica.ops.fp8_w8a8_triton), more by torch._scaled_mm (rowwise scaling).

Every path allocates only its outputs, never syncs, and picks its kernel and launch grid from
shapes alone, so a captured CUDA graph replays the same choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from punica.ops.fp8_format import FP8_DTYPE, FP8_MAX, MIN_ACTIVATION_AMAX

# The paths by token count (per-channel scales, bf16 activations), summed over a 7B layer's four
# projections (docs/benchmarks.md; CUDA graphs, weights read from memory). benchmarks.decode_gemm
# --weights fp8 on the H200: at 32-128 tokens the W8A8 Triton GEMM takes 99.7-116.9 us, against
# 125.9-135.7 for torch._scaled_mm. A chain of 32 such layers on the H100: at 24 and 32 tokens the
# weight-only GEMM takes 101.4 and 102.2 us a layer against the W8A8 GEMM's 108.0 and 109.5
# (activations quantized included), at 48 and 64 tokens 136.2 and 141.9 against 111.2 and 114.1.
WEIGHT_ONLY_MAX_TOKENS = 32
W8A8_MAX_TOKENS = 128
# Beside LoRA's side stream (punica.lora.layers.LoraLinear, steps where some token has an adapter)
# the weight-only GEMM loses to the W8A8 GEMM from 17 tokens: benchmarks.textgen --workloads
# distinct --quantizations fp8 (96 requests, 7B shape) on the H100 serves 3,040.0 tokens/s with
# 17-32 such tokens on the W8A8 GEMM against 2,773.5 with them on the weight-only GEMM, and 3,030.3
# with 1-32 on the W8A8 GEMM (docs/benchmarks.md#fp8-beside-lora).
WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA = 16


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [N, K] e4m3fn, scales [N] float32) of a full-precision w [N, K]:
    scales[n] = amax(|w[n]|) / 448 (1 where the row is all zeros), weight = clamp(w / scales[n], +-448)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w32 / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def expand_scales(scales: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int] | None) -> torch.Tensor:
    """The scale of every weight element [N, K] float32 (module docstring's layouts)."""
    n, k = shape
    if block_size is None:
        return scales[:, None].expand(n, k)
    b0, b1 = block_size
    return scales.repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]


def dequantize(weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype`: float32(weight) * its scale, rounded once to `dtype`."""
    return (weight.float() * expand_scales(scales, tuple(weight.shape), block_size)).to(dtype)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize(weight, scales, block_size, x.dtype), bias)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, K] e4m3fn, scales [T, 1] float32) of activations x [T, K]: scale_t = amax(|x[t]|) / 448."""
    x32 = x.float()
    scales = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_ACTIVATION_AMAX) / FP8_MAX
    return (x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) on the fp8 tensor cores: per-token activation scales times per-channel
    weight scales, applied by torch._scaled_mm to its fp32 accumulator; output in bf16 (x's dtype).
    Fast accumulation: cuBLASLt leaves the sums in the fp8 tensor cores' accumulator instead of
    adding them into a full fp32 one at intervals, 8% faster over a 7B layer's four GEMMs at 2,048
    tokens on an H100 (1.65x bf16 against 1.52x), with the same error against bf16 to three digits,
    which the activations' rounding to e4m3 sets
    (docs/benchmarks.md#fp8-prefill-gemms-fast-accumulation)."""
    from punica.ops.fp8_quant_triton import quantize_per_token_triton
    x8, x_scales = quantize_per_token_triton(x)
    out = torch._scaled_mm(x8, weight.t(), scale_a=x_scales, scale_b=scales[None, :], out_dtype=x.dtype,
                           use_fast_accum=True)
    return out if bias is None else out.add_(bias)


def gemm_path(x: torch.Tensor, weight: torch.Tensor, block_size: tuple[int, int] | None,
              beside_lora: bool = False) -> str:
    """Which GEMM fp8_linear runs (module docstring), from shapes, dtypes and `beside_lora` only:
    "reference", "weight_only", "w8a8" or "scaled_mm"."""
    from punica.ops.fp8_triton import block_k_for
    if not x.is_cuda:
        return "reference"
    n, k = weight.shape
    tensor_cores = block_size is None and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
    if tensor_cores and x.shape[0] > W8A8_MAX_TOKENS:
        return "scaled_mm"
    if tensor_cores and x.shape[0] > (WEIGHT_ONLY_MAX_TOKENS_BESIDE_LORA if beside_lora else WEIGHT_ONLY_MAX_TOKENS):
        return "w8a8"
    if block_k_for(block_size) is None:  # scale blocks of no power-of-two width: dequantized (slow, exact)
        return "reference"
    return "weight_only"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int] | None,
               bias: torch.Tensor | None = None, beside_lora: bool = False) -> torch.Tensor:
    """A linear layer over fp8 weights.

        x: [T, K] (bf16, fp16 or fp32), weight: [N, K] float8_e4m3fn, scales: float32 [N] (block_size
        None) or [ceil(N / B0), ceil(K / B1)] (block_size (B0, B1)), bias: None or [N] in x's dtype
        out[t, n] = sum_k x[t, k] * W[n, k] + bias[n]   in x's dtype, W as in the module docstring
        beside_lora: whether LoRA's side stream runs beside this GEMM (picks the kernel, gemm_path)
    """
    assert weight.dtype == FP8_DTYPE and x.shape[-1] == weight.shape[1], (x.shape, weight.shape, weight.dtype)
    path = gemm_path(x, weight, block_size, beside_lora)
    if path == "scaled_mm":
        return fp8_linear_scaled_mm(x, weight, scales, bias)
    if path == "w8a8":
        from punica.ops.fp8_w8a8_triton import fp8_linear_w8a8_triton
        return fp8_linear_w8a8_triton(x, weight, scales, bias)
    if path == "weight_only":
        from punica.ops.fp8_triton import fp8_linear_triton
        return fp8_linear_triton(x, weight, scales, block_size, bias)
    return fp8_linear_ref(x, weight, scales, block_size, bias)
