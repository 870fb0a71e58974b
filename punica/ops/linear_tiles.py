"""Which tile the skinny GEMM (punica.ops.linear_triton) runs a shape with, and which shapes it
leaves to cuBLAS: shapes and dtypes only, no Triton (punica.ops.linear picks its path from here).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_SKINNY_TOKENS = 16
MIN_SKINNY_WEIGHT = 1 << 24  # elements: smaller weights (unmeasured) stay on cuBLAS


class Tile(NamedTuple):
    """A launch of the skinny kernel: output features and K columns per step of one program, K
    slices (split_k > 1: fp32 partials summed by a second kernel), warps, pipeline stages."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def skinny_tile(num_tokens: int, n: int, k: int, dtype: torch.dtype) -> Tile | None:
    """The skinny kernel's tile for x [num_tokens, k] @ W [n, k]^T, or None where cuBLAS runs it.

    From benchmarks.decode_gemm on the H200 (docs/results/decode_gemm_tiles_2026-12-03_h200.json):
    a 7B model's weights at 1 and 8 tokens, each GEMM in a CUDA graph reading its weight from
    memory, best tile against cuBLAS: o (4096 x 4096) 13.1 against 14.5 us, qkv (12288 x 4096)
    30.1 / 31.4, gate_up (22016 x 4096) 50.0 / 53.1, down (4096 x 11008, two K slices) 29.2 / 31.3,
    lm_head (32000 x 4096) 74.5 / 76.7; these tiles at 16 tokens: 30.5 / 31.8, 13.2 / 14.7,
    51.1 / 51.7, 29.9 / 31.7, 74.8 / 78.5. At 32 tokens cuBLAS is as fast (down faster), so from
    MAX_SKINNY_TOKENS + 1 rows it runs them.
    """
    if num_tokens > MAX_SKINNY_TOKENS or dtype not in (torch.bfloat16, torch.float16) or n * k < MIN_SKINNY_WEIGHT:
        return None
    if k >= 8192:
        return Tile(32, 256, 2, 4, 4)
    if n <= 8192:
        return Tile(32, 256, 1, 4, 4)
    if n <= 24576:
        return Tile(64, 128, 1, 4, 4)
    return Tile(128, 128, 1, 8, 3)
