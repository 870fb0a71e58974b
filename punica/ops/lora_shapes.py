"""What the LoRA references (punica.ops.lora), their Triton launches (punica.ops.lora_triton) and
the per-step index metadata (punica.lora.batch) share: the slice bounds of a sliced expand, which
kernel family a batch shape runs faster with, and SGMV's tile height for it.
"""

from __future__ import annotations


def check_slice_bounds(slice_bounds, h_out):
    """(slice_bounds or (0, h_out)), checked: non-decreasing from 0 to h_out."""
    bounds = tuple(slice_bounds) if slice_bounds is not None else (0, h_out)
    assert len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == h_out, (bounds, h_out)
    assert all(lo <= hi for lo, hi in zip(bounds, bounds[1:])), bounds
    return bounds


def prefer_bgmv(num_tokens: int, num_segments: int) -> bool:
    """Whether a batch runs faster with BGMV than with SGMV (measured: docs/benchmarks.md).

    Up to 64 tokens, or with segments under 16 tokens on average, SGMV runs the same
    one-program-per-token schedule as BGMV plus a search of the segment bounds, so BGMV
    wins; with longer segments SGMV's tensor-core tiles win. H200, bf16, h=4096, r=16,
    shrink+expand under graph replay: decode batches 1..64, BGMV 3.0-8.4 us vs SGMV
    3.5-9.6 us; 16 requests of 16 tokens, SGMV 8.4-11.3 us vs BGMV 10.9-11.9 us; of 256
    tokens, SGMV 39-41 us vs BGMV 129-137 us.
    """
    return num_tokens <= 64 or num_tokens < 16 * num_segments


def sgmv_block_m(num_tokens: int, num_segments: int) -> int:
    """Tokens per SGMV program: 1 selects the row-wise schedule, else the tile height.

    Row-wise exactly where BGMV is preferred (`prefer_bgmv`): short segments,
    where a tile would hold several segments and load each one's weights for a few rows.
    """
    if prefer_bgmv(num_tokens, num_segments):
        return 1
    mean_len = num_tokens // max(num_segments, 1)
    return 16 if mean_len < 32 else 32 if mean_len < 64 else 64
