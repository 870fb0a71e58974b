"""The decoder's base projections (qkv, o, gate_up, down, lm_head): `Linear` in the activation
dtype, or FP8 base weights for the fused four.

`Fp8Format` says how a model's projections are stored: e4m3 weights with per-output-channel
scales (block_size None: `--quantization fp8`, and checkpoints with per-tensor or per-channel
scales, which become per-row scales of the fused weight exactly) or with block scales
(block_size (B0, B1): HF's fine-grained fp8, compressed-tensors' block strategy). Embeddings,
norms and lm_head stay in the activation dtype.

`Fp8Linear` replaces nn.Linear for a projection: parameters `weight` [N, K] float8_e4m3fn and
`weight_scale` (float32 [N], or [ceil(N / B0), ceil(K / B1)]), an optional bias in the
activation dtype, and a forward through punica.ops.fp8.fp8_linear. The model's LoRA deltas are
added as for Linear (punica.lora.layers.LoraLinear wraps either): the shrink reads the same bf16
input, the expand adds into this output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from punica.config import ceil_div
from punica.ops.fp8 import FP8_DTYPE, dequantize, fp8_linear
from punica.ops.linear import PackedWeight, linear


@dataclass(frozen=True)
class Fp8Format:
    block_size: tuple[int, int] | None = None  # (B0 rows, B1 columns) of a weight scale block; None: per channel

    def __post_init__(self):
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise ValueError(f"fp8 weight block size must be two positive integers, got {self.block_size}")

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.block_size is None:
            return (out_features,)
        return ceil_div(out_features, self.block_size[0]), ceil_div(in_features, self.block_size[1])


class Linear(nn.Linear):
    """nn.Linear whose forward is punica.ops.linear.linear: a decode step's few rows run the skinny
    Triton GEMM where it beats cuBLAS; on a CPU, after `pack_cpu`, rows from 3 run on the weight's
    packed copy (punica.ops.linear.PackedWeight)."""

    packed: PackedWeight | None = None

    def pack_cpu(self) -> None:
        """Keep a copy of the (CPU fp32) weight in oneDNN's blocked layout for steps of many rows."""
        self.packed = PackedWeight(self.weight)

    def forward(self, x: torch.Tensor, beside_lora: bool = False) -> torch.Tensor:
        """beside_lora: LoRA's side stream runs beside this GEMM (Fp8Linear's GEMM depends on it;
        this one's does not)."""
        return linear(x, self.weight, self.bias, self.packed)


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: Fp8Format,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.in_features, self.out_features, self.block_size = in_features, out_features, fmt.block_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(fmt.scale_shape(out_features, in_features), dtype=torch.float32,
                                                    device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None
        self.dtype = dtype  # the activations': what `dequantized` rounds to

    def forward(self, x: torch.Tensor, beside_lora: bool = False) -> torch.Tensor:
        """beside_lora: LoRA's side stream runs beside this GEMM (punica.ops.fp8.gemm_path)."""
        return fp8_linear(x, self.weight, self.weight_scale, self.block_size, self.bias, beside_lora)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in the activation dtype, as the reference path computes with it."""
        return dequantize(self.weight, self.weight_scale, self.block_size, self.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"


def pack_cpu_linears(model: nn.Module, max_bytes: int) -> int:
    """Give every Linear of `model` with a CPU fp32 weight its packed copy (Linear.pack_cpu) if
    those weights come to at most `max_bytes`; the bytes packed (0: none)."""
    linears = [module for module in model.modules() if isinstance(module, Linear)
               and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32]
    size = sum(module.weight.nbytes for module in linears)
    if size > max_bytes:
        return 0
    for module in linears:
        module.pack_cpu()
    return size


def packed_linears(model: nn.Module) -> list[tuple[torch.Tensor, PackedWeight]]:
    """(weight, packed copy) of every Linear of `model` that has one (pack_cpu_linears)."""
    return [(module.weight, module.packed) for module in model.modules()
            if isinstance(module, Linear) and module.packed is not None]


def projection(in_features: int, out_features: int, bias: bool, fmt: Fp8Format | None, dtype: torch.dtype,
               device: torch.device | str) -> Linear | Fp8Linear:
    """One of a layer's fused projections: Linear in `dtype`, or Fp8Linear in format `fmt`."""
    if fmt is None:
        return Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return Fp8Linear(in_features, out_features, bias, fmt, dtype, device)
