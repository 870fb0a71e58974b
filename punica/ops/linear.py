"""The base projections' GEMM: x @ W^T + bias, with decode's few-row case on a skinny Triton kernel.

`linear(x, weight, bias)` = F.linear(x, weight, bias), its reference and the path of every case
but one: on CUDA, a bf16/fp16 x of at most MAX_SKINNY_TOKENS rows whose shape gets a tile from
punica.ops.linear_tiles.skinny_tile runs punica.ops.linear_triton's kernel (fp32 accumulation,
one rounding to x's dtype, as cuBLAS's). The choice depends on shapes and dtypes only, so a captured CUDA graph
replays it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from punica.ops.linear_tiles import skinny_tile


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer.

        x: [T, K], weight: [N, K], bias: None or [N], all in one dtype  ->  out: [T, N] in that dtype
        out[t, n] = sum_k x[t, k] * weight[n, k] + bias[n]   accumulated in fp32, rounded once
    """
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous():
        tile = skinny_tile(x.shape[0], weight.shape[0], weight.shape[1], x.dtype)
        if tile is not None:
            from punica.ops.linear_triton import skinny_linear_triton
            return skinny_linear_triton(x, weight, bias, tile)
    return F.linear(x, weight, bias)
