"""Triton launches of the LoRA operators (the kernels: punica.ops.lora_kernels); semantics and
weight layout: punica.ops.lora.

Two schedules, both sync-free and allocation-free beyond the returned `v`:

* row-wise (every BGMV call, and SGMV when segments are short): one program per token and
  slice of the output (ranks for shrink, columns for expand), reduction by broadcast and sum.
  Tokens sharing an adapter re-read its weights from L2, so DRAM sees each adapter once, and
  even a decode batch of 64 tokens launches hundreds of programs to fill the SMs.
* tiled (SGMV with long segments): one program per tile of BLOCK_M tokens, `tl.dot` on tensor
  cores. A tile loops over the segments it overlaps, found by a FAN-ary search of seg_indptr.
  Shrink splits h_in across programs when tiles alone cannot fill the GPU, and the ranks into
  blocks of at most 128 (a group's stacked A has n*R rows); it adds into a zeroed fp32 `v` with
  atomics, split or not, so that every launch runs one variant.

A mixed batch's expand (a prompt chunk's rows tiled, decodes' row-wise) runs both schedules'
programs in one launch (mixed_expand_triton): the decodes' programs need not wait for the tiles'
launch to end, and the step launches one kernel fewer a projection.

A sliced expand (a projection group, punica.ops.lora) passes the starts of slices 1 and 2 as
plain ints (h_out for slices that do not exist; at most MAX_SLICES slices). A program's column
block may straddle a slice boundary: it loops over the slices its columns touch (almost
always one), each time with that slice's ranks of v and its columns of B.

The row-wise expand and add_delta launch without floating-point contraction: an accumulating
expand then rounds delta * scale before adding it to y, exactly as bgmv_delta + add_delta do
(with contraction the compiler would fuse the expand's multiply and add into one FMA).

A DoRA expand (`dora`) multiplies each output row of a DoRA slot by its out_scales as it stores
it; the slot's flag (dora_slots) masks that load, so plain-LoRA slots read no out_scales.

Every per-batch quantity the kernels read (slots, segment bounds, token scales) is a device tensor; the
launch configuration depends only on tensor shapes, so the calls are safe under CUDA-graph
capture.

On Hopper and newer the kernels launch with programmatic dependent launch (PDL): a kernel
may start while the previous kernel in the stream still runs, reads the slot metadata, the
segment bounds and (row-wise) its first weight tile, then waits for the previous kernel
before touching x, v or y. So the metadata, weights and scales must not be written by the
kernel launched immediately before a LoRA op (host copies and earlier kernels are fine);
set ENABLE_PDL = False where that cannot be promised.
"""

from __future__ import annotations

import torch
import triton

from punica.ops.lora_kernels import (
    add_delta_rowwise_kernel,
    expand_rowwise_kernel,
    mixed_expand_kernel,
    sgmv_expand_tile_kernel,
    sgmv_shrink_tile_kernel,
    shrink_rowwise_kernel,
)
from punica.ops.lora_shapes import check_slice_bounds, sgmv_block_m  # noqa: F401 (sgmv_block_m: re-exported)
from punica.ops.triton_env import interpreting, num_sms

FAN = 64              # probes per step of the segment search
# row-wise programs: elements multiplied per loop step, and warps (benchmarks.rowwise_sweep)
SHRINK_ROWWISE_TILE, SHRINK_ROWWISE_WARPS = 8192, 4
EXPAND_ROWWISE_TILE, EXPAND_ROWWISE_WARPS = 8192, 4
ADD_DELTA_BLOCK_N = 512  # add_delta: columns per program (a rank-16 expand's block)
TILE_BLOCK_K = 64      # shrink tiles: h_in per loop step
TILE_BLOCK_N = 128     # expand tiles: h_out columns per program
TILE_WARPS = 4
TILE_STAGES = 3
# shrink splits h_in until tiles x splits reach this many per SM: on an H100 a 7B layer's four
# shrinks over 512-2,048 tokens took 14-22% less than at 8 a SM in one prompt, 12-20% in 8-16 up
# to 1,024 tokens, the same at 2,048 in 16 (docs/benchmarks.md, LoRA operators)
TILE_PROGRAMS_PER_SM = 2
TILE_MAX_BLOCK_R = 128  # shrink tiles: ranks per program (a group's n*R ranks may take several)
ENABLE_PDL = True      # programmatic dependent launch on Hopper+ (see the module docstring)
MAX_SLICES = 3         # slices of one sliced expand (q/k/v)


def _pdl(device: torch.device) -> bool:
    """Launch with programmatic dependent launch (Hopper and newer)."""
    return ENABLE_PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _search_steps(num_segments: int) -> int:
    steps, width = 0, num_segments
    while width > 1:
        width = triton.cdiv(width, FAN)
        steps += 1
    return steps


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply exactly; bf16/fp16 weights are exact in tf32 (only `v` rounds)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _rowwise_shrink_blocks(h_in: int, max_rank: int) -> tuple[int, int]:
    block_k = min(triton.next_power_of_2(h_in), SHRINK_ROWWISE_TILE // 2)
    block_r = min(triton.next_power_of_2(max_rank), max(1, SHRINK_ROWWISE_TILE // block_k))
    return block_r, block_k


def _rowwise_expand_blocks(h_out: int, max_rank: int) -> tuple[int, int]:
    block_r = triton.next_power_of_2(max_rank)
    block_n = min(triton.next_power_of_2(h_out), max(16, EXPAND_ROWWISE_TILE // block_r))
    return block_n, block_r


def _tile_expand_blocks(h_out: int, max_rank: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_R) of the tiled expand's programs, whichever launch runs them."""
    return max(16, min(TILE_BLOCK_N, triton.next_power_of_2(h_out))), max(16, triton.next_power_of_2(max_rank))


def _shrink_out(x: torch.Tensor, max_rank: int, out: torch.Tensor | None) -> torch.Tensor:
    shape = (x.shape[0], max_rank)
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=x.device)
    assert out.shape == shape and out.dtype == torch.float32, (out.shape, out.dtype)
    return out


def _check_shrink(x: torch.Tensor, lora_a: torch.Tensor) -> None:
    assert x.dim() == 2 and lora_a.dim() == 3 and x.shape[1] == lora_a.shape[2], (x.shape, lora_a.shape)


def _check_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor,
                  slice_bounds: tuple[int, ...] | None) -> tuple[int, int]:
    """Check the shapes; return the starts of slices 1 and 2 (h_out where there is none)."""
    assert lora_b.dim() == 3 and y.shape[1] == lora_b.shape[1], (y.shape, lora_b.shape)
    assert lora_b.shape[2] <= 128, f"max_rank {lora_b.shape[2]} above 128"
    bounds = check_slice_bounds(slice_bounds, y.shape[1])
    num_slices = len(bounds) - 1
    assert num_slices <= MAX_SLICES, f"{num_slices} slices, above {MAX_SLICES}"
    assert v.dtype == torch.float32 and v.shape == (y.shape[0], num_slices * lora_b.shape[2]), (
        v.dtype, v.shape, bounds)
    starts = list(bounds[1:-1]) + [y.shape[1]] * (MAX_SLICES - num_slices)
    return starts[0], starts[1]


def _shrink_rowwise(x, lora_a, v, token_slots, seg_indptr, seg_slots, segmented):
    num_tokens, h_in = x.shape
    max_rank = lora_a.shape[1]
    block_r, block_k = _rowwise_shrink_blocks(h_in, max_rank)
    num_segments = seg_slots.numel()
    grid = (num_tokens, triton.cdiv(max_rank, block_r))
    shrink_rowwise_kernel[grid](
        x, lora_a, v, token_slots, seg_indptr, seg_slots, num_segments, _search_steps(num_segments),
        h_in, max_rank, *x.stride(), *lora_a.stride(), *v.stride(),
        SEGMENTED=segmented, FAN=FAN, BLOCK_R=block_r, BLOCK_K=block_k, PDL=_pdl(x.device),
        num_warps=SHRINK_ROWWISE_WARPS, launch_pdl=_pdl(x.device),
    )
    return v


def _check_token_scales(token_scales: torch.Tensor | None, num_tokens: int) -> tuple[torch.Tensor | None, bool]:
    """(the pointer to pass, whether the kernel reads it): a [T] float32 tensor, or None for 1."""
    if token_scales is None:
        return None, False
    assert token_scales.shape == (num_tokens,) and token_scales.dtype == torch.float32, (
        token_scales.shape, token_scales.dtype)
    return token_scales, True


def check_dora(dora: tuple[torch.Tensor, torch.Tensor] | None, num_slots: int | None, h_out: int) -> tuple:
    """(out_scales, dora_slots, its two strides, whether the kernel reads them) for a launch;
    num_slots: the pool's slots (None: out_scales' rows)."""
    if dora is None:
        return None, None, 0, 0, False
    out_scales, dora_slots = dora
    num_slots = out_scales.shape[0] if num_slots is None else num_slots
    assert out_scales.shape == (num_slots, h_out) and out_scales.dtype == torch.float32, (
        out_scales.shape, out_scales.dtype)
    assert dora_slots.shape == (num_slots,) and dora_slots.dtype == torch.int32, dora_slots
    return out_scales, dora_slots, *out_scales.stride(), True


def _expand_rowwise(y, v, lora_b, scales, token_scales, dora, token_slots, seg_indptr, seg_slots, segmented,
                    starts, accumulate=True):
    num_tokens, h_out = y.shape
    max_rank = lora_b.shape[2]
    block_n, block_r = _rowwise_expand_blocks(h_out, max_rank)
    num_segments = seg_slots.numel()
    token_scales, has_token_scales = _check_token_scales(token_scales, num_tokens)
    out_scales, dora_slots, stride_os, stride_on, has_dora = check_dora(dora, lora_b.shape[0], h_out)
    grid = (num_tokens, triton.cdiv(h_out, block_n))
    expand_rowwise_kernel[grid](
        y, v, lora_b, scales, token_scales, out_scales, dora_slots, token_slots, seg_indptr, seg_slots, num_segments,
        _search_steps(num_segments), h_out, max_rank, *starts, *y.stride(), *v.stride(),
        *lora_b.stride(), stride_os, stride_on,
        SEGMENTED=segmented, FAN=FAN, BLOCK_N=block_n, BLOCK_R=block_r, TOKEN_SCALES=has_token_scales,
        DORA=has_dora, ACCUMULATE=accumulate, PDL=_pdl(y.device),
        num_warps=EXPAND_ROWWISE_WARPS, launch_pdl=_pdl(y.device), enable_fp_fusion=False,
    )


def sgmv_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, seg_indptr: torch.Tensor,
                       seg_slots: torch.Tensor, out: torch.Tensor | None = None,
                       block_m: int | None = None) -> torch.Tensor:
    """punica.ops.lora.sgmv_shrink; `out` receives v if given; `block_m` overrides sgmv_block_m."""
    _check_shrink(x, lora_a)
    num_tokens, h_in = x.shape
    max_rank = lora_a.shape[1]
    num_segments = seg_slots.numel()
    block_m = block_m or sgmv_block_m(num_tokens, num_segments)
    v = _shrink_out(x, max_rank, out)
    if num_tokens == 0:
        return v
    if num_segments == 0:
        return v.zero_()
    if block_m == 1:
        return _shrink_rowwise(x, lora_a, v, seg_slots, seg_indptr, seg_slots, segmented=True)
    v.zero_()
    block_r = min(TILE_MAX_BLOCK_R, max(16, triton.next_power_of_2(max_rank)))
    block_k = max(16, min(TILE_BLOCK_K, triton.next_power_of_2(h_in)))
    num_tiles = triton.cdiv(num_tokens, block_m)
    num_rank_blocks = triton.cdiv(max_rank, block_r)
    num_k_blocks = triton.cdiv(h_in, block_k)
    split_k = min(num_k_blocks, max(1, TILE_PROGRAMS_PER_SM * num_sms(x.device)
                                    // (num_tiles * num_rank_blocks)))
    k_per_split = triton.cdiv(num_k_blocks, split_k) * block_k
    grid = (num_tiles, triton.cdiv(h_in, k_per_split), num_rank_blocks)
    sgmv_shrink_tile_kernel[grid](
        x, lora_a, v, seg_indptr, seg_slots, num_tokens, num_segments, _search_steps(num_segments),
        h_in, max_rank, k_per_split, *x.stride(), *lora_a.stride(), *v.stride(),
        FAN=FAN, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        UPCAST=interpreting(), PRECISION=_precision(x.dtype), PDL=_pdl(x.device),
        num_warps=TILE_WARPS, num_stages=TILE_STAGES, launch_pdl=_pdl(x.device),
    )
    return v


def sgmv_expand_triton(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor,
                       seg_indptr: torch.Tensor, seg_slots: torch.Tensor, scales: torch.Tensor,
                       block_m: int | None = None, slice_bounds: tuple[int, ...] | None = None,
                       token_scales: torch.Tensor | None = None,
                       dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """punica.ops.lora.sgmv_expand; `block_m` overrides sgmv_block_m."""
    starts = _check_expand(y, v, lora_b, slice_bounds)
    num_tokens, h_out = y.shape
    max_rank = lora_b.shape[2]
    num_segments = seg_slots.numel()
    if num_tokens == 0 or num_segments == 0:
        return
    block_m = block_m or sgmv_block_m(num_tokens, num_segments)
    if block_m == 1:
        _expand_rowwise(y, v, lora_b, scales, token_scales, dora, seg_slots, seg_indptr, seg_slots, True, starts)
        return
    token_scales, has_token_scales = _check_token_scales(token_scales, num_tokens)
    out_scales, dora_slots, stride_os, stride_on, has_dora = check_dora(dora, lora_b.shape[0], h_out)
    block_n, block_r = _tile_expand_blocks(h_out, max_rank)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(h_out, block_n))
    sgmv_expand_tile_kernel[grid](
        y, v, lora_b, scales, token_scales, out_scales, dora_slots, seg_indptr, seg_slots, num_tokens, num_segments,
        _search_steps(num_segments), h_out, max_rank, *starts, *y.stride(), *v.stride(),
        *lora_b.stride(), stride_os, stride_on, FAN=FAN, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        SLICED=starts[0] < h_out, TOKEN_SCALES=has_token_scales, DORA=has_dora, PRECISION=_precision(lora_b.dtype),
        PDL=_pdl(y.device), num_warps=TILE_WARPS, num_stages=TILE_STAGES, launch_pdl=_pdl(y.device),
    )


def mixed_expand_triton(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, seg_indptr: torch.Tensor,
                        seg_slots: torch.Tensor, token_slots: torch.Tensor, sgmv_tokens: int, scales: torch.Tensor,
                        block_m: int, slice_bounds: tuple[int, ...] | None = None,
                        token_scales: torch.Tensor | None = None,
                        dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """punica.ops.lora.lora_expand of a mixed batch in one launch: sgmv_expand_triton's tiles of
    `block_m` (> 1) rows over tokens [0, sgmv_tokens) (the segments cover exactly them) and
    bgmv_expand_triton's rows over the rest, each by its token_slots."""
    assert TILE_WARPS == EXPAND_ROWWISE_WARPS, "the launch runs both schedules' programs at one warp count"
    starts = _check_expand(y, v, lora_b, slice_bounds)
    num_tokens, h_out = y.shape
    assert 0 < sgmv_tokens < num_tokens and block_m > 1 and token_slots.shape == (num_tokens,), (
        sgmv_tokens, num_tokens, block_m, token_slots.shape)
    max_rank = lora_b.shape[2]
    num_segments = seg_slots.numel()
    token_scales, has_token_scales = _check_token_scales(token_scales, num_tokens)
    out_scales, dora_slots, stride_os, stride_on, has_dora = check_dora(dora, lora_b.shape[0], h_out)
    tile_block_n, tile_block_r = _tile_expand_blocks(h_out, max_rank)
    row_block_n, row_block_r = _rowwise_expand_blocks(h_out, max_rank)
    tile_programs = triton.cdiv(sgmv_tokens, block_m) * triton.cdiv(h_out, tile_block_n)
    grid = (tile_programs + (num_tokens - sgmv_tokens) * triton.cdiv(h_out, row_block_n),)
    mixed_expand_kernel[grid](
        y, v, lora_b, scales, token_scales, out_scales, dora_slots, token_slots, seg_indptr, seg_slots, sgmv_tokens,
        num_segments, _search_steps(num_segments), tile_programs, h_out, max_rank, *starts, *y.stride(), *v.stride(),
        *lora_b.stride(), stride_os, stride_on, FAN=FAN, BLOCK_M=block_m, TILE_BLOCK_N=tile_block_n,
        TILE_BLOCK_R=tile_block_r, ROW_BLOCK_N=row_block_n, ROW_BLOCK_R=row_block_r,
        SLICED=starts[0] < h_out, TOKEN_SCALES=has_token_scales, DORA=has_dora, PRECISION=_precision(lora_b.dtype),
        PDL=_pdl(y.device), num_warps=TILE_WARPS, num_stages=TILE_STAGES, launch_pdl=_pdl(y.device),
        enable_fp_fusion=False,
    )


def bgmv_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """punica.ops.lora.bgmv_shrink; `out` receives v if given."""
    _check_shrink(x, lora_a)
    v = _shrink_out(x, lora_a.shape[1], out)
    if x.shape[0] == 0:
        return v
    return _shrink_rowwise(x, lora_a, v, token_slots, token_slots, token_slots, segmented=False)


def bgmv_expand_triton(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor,
                       token_slots: torch.Tensor, scales: torch.Tensor,
                       slice_bounds: tuple[int, ...] | None = None, token_scales: torch.Tensor | None = None,
                       dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """punica.ops.lora.bgmv_expand."""
    starts = _check_expand(y, v, lora_b, slice_bounds)
    if y.shape[0] == 0:
        return
    _expand_rowwise(y, v, lora_b, scales, token_scales, dora, token_slots, token_slots, token_slots, False, starts)


def bgmv_delta_triton(v: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scales: torch.Tensor,
                      slice_bounds: tuple[int, ...] | None = None,
                      token_scales: torch.Tensor | None = None) -> torch.Tensor:
    """punica.ops.lora.bgmv_delta."""
    d = torch.empty(v.shape[0], lora_b.shape[1], dtype=torch.float32, device=v.device)
    starts = _check_expand(d, v, lora_b, slice_bounds)
    if d.shape[0] > 0:
        _expand_rowwise(d, v, lora_b, scales, token_scales, None, token_slots, token_slots, token_slots, False,
                        starts, accumulate=False)
    return d


def add_delta_triton(y: torch.Tensor, d: torch.Tensor, token_slots: torch.Tensor,
                     dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """punica.ops.lora.add_delta."""
    assert d.shape == y.shape and d.dtype == torch.float32 and token_slots.shape == y.shape[:1], (
        y.shape, d.shape, d.dtype, token_slots.shape)
    num_tokens, h_out = y.shape
    if num_tokens == 0:
        return
    out_scales, dora_slots, stride_os, stride_on, has_dora = check_dora(dora, None, h_out)
    block_n = min(triton.next_power_of_2(h_out), ADD_DELTA_BLOCK_N)
    add_delta_rowwise_kernel[(num_tokens, triton.cdiv(h_out, block_n))](
        y, d, out_scales, dora_slots, token_slots, h_out, *y.stride(), *d.stride(), stride_os, stride_on,
        BLOCK_N=block_n, DORA=has_dora, PDL=_pdl(y.device), num_warps=EXPAND_ROWWISE_WARPS,
        launch_pdl=_pdl(y.device), enable_fp_fusion=False,
    )
