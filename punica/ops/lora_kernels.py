"""The @triton.jit code of the LoRA operators: segment search helpers and the row-wise and tiled
shrink/expand kernels. Schedules, launch rules and the PDL contract: punica.ops.lora_triton.

The kernels' token and segment counts (and the shrink's K per split) are not specialized: Triton
would compile a variant the first time one of them is 1 or not a multiple of 16, and an eager step
of a new shape (one prompt past the CUDA graphs' buckets) would compile while others wait on it."""

import triton
import triton.language as tl


@triton.jit
def _find_segment(seg_indptr, num_segments, row, num_steps, FAN: tl.constexpr):
    """Largest s in [0, num_segments) with seg_indptr[s] <= row (0 if none): FAN-ary search."""
    lo = row * 0
    hi = lo + num_segments
    for _ in range(num_steps):
        stride = (hi - lo + FAN - 1) // FAN
        probes = lo + tl.arange(0, FAN) * stride
        starts = tl.load(seg_indptr + probes, mask=probes < hi, other=row + 1)
        count = tl.sum((starts <= row).to(tl.int32), axis=0)
        lo = lo + tl.maximum(count - 1, 0) * stride
        hi = tl.minimum(lo + stride, hi)
    return lo


@triton.jit
def _row_slot(t, token_slots, seg_indptr, seg_slots, num_segments, num_steps,
              SEGMENTED: tl.constexpr, FAN: tl.constexpr):
    """The slot of token t: token_slots[t], or that of the segment holding t (-1 if none)."""
    if SEGMENTED:
        s = _find_segment(seg_indptr, num_segments, t, num_steps, FAN)
        lo = tl.load(seg_indptr + s)
        hi = tl.load(seg_indptr + s + 1)
        slot = tl.load(seg_slots + s, mask=(lo <= t) & (t < hi), other=-1)
    else:
        slot = tl.load(token_slots + t)
    return slot


@triton.jit
def _tile_segments(seg_indptr, num_segments, num_tokens, row0, num_steps, BLOCK_M: tl.constexpr,
                   FAN: tl.constexpr):
    """First and last segment overlapping the tile of rows row0 .. row0 + BLOCK_M - 1."""
    first = _find_segment(seg_indptr, num_segments, row0, num_steps, FAN)
    last = _find_segment(seg_indptr, num_segments, tl.minimum(row0 + BLOCK_M, num_tokens) - 1,
                         num_steps, FAN)
    return first, last


@triton.jit
def _tile_segment(seg_indptr, seg_slots, s, rows, num_tokens):
    """Segment s within a tile: whether it has work (an adapter and rows), its slot, and which
    of the tile's rows it holds."""
    slot = tl.load(seg_slots + s)
    lo = tl.load(seg_indptr + s)
    hi = tl.load(seg_indptr + s + 1)
    return (slot >= 0) & (lo < hi), slot, (rows >= lo) & (rows < hi) & (rows < num_tokens)


@triton.jit
def _slice_of(col, slice1_start, slice2_start):
    """The slice (0, 1 or 2) of a sliced expand that holds column `col`."""
    return (col >= slice1_start).to(tl.int32) + (col >= slice2_start).to(tl.int32)


@triton.jit
def _column_slices(cols, col0, h_out, slice1_start, slice2_start, BLOCK_N: tl.constexpr):
    """For the column block cols = col0 .. col0 + BLOCK_N - 1: each column's slice, and the first
    and last slice the block touches."""
    return (_slice_of(cols, slice1_start, slice2_start), _slice_of(col0, slice1_start, slice2_start),
            _slice_of(tl.minimum(col0 + BLOCK_N, h_out) - 1, slice1_start, slice2_start))


@triton.jit
def _previous_kernel_done(PDL: tl.constexpr):
    """Under programmatic dependent launch: wait until the previous kernel's writes are
    visible, then let the next kernel start its prologue."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_segments", "num_steps"])
def shrink_rowwise_kernel(
    x, lora_a, v, token_slots, seg_indptr, seg_slots, num_segments, num_steps, h_in, max_rank,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_vt, stride_vr,
    SEGMENTED: tl.constexpr, FAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = _row_slot(t, token_slots, seg_indptr, seg_slots, num_segments, num_steps, SEGMENTED, FAN)
    # masks compare with a bound that is 0 for slot -1 (no scalar-bool broadcast: the
    # interpreter turns a splat int1 into int32)
    k_end = tl.where(slot >= 0, h_in, 0)
    x_row = x + t.to(tl.int64) * stride_xt
    a_rows = (lora_a + tl.maximum(slot, 0).to(tl.int64) * stride_as
              + ranks[:, None].to(tl.int64) * stride_ar)
    rank_ok = (ranks < max_rank)[:, None]
    # the first chunk of A is read before the previous kernel has finished (PDL), x after
    cols = tl.arange(0, BLOCK_K)
    ak = tl.load(a_rows + cols[None, :] * stride_ak, mask=rank_ok & (cols < k_end)[None, :], other=0.0)
    _previous_kernel_done(PDL)
    xk = tl.load(x_row + cols * stride_xk, mask=cols < k_end, other=0.0)
    acc = tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    for k in range(BLOCK_K, h_in, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_ok = cols < k_end
        xk = tl.load(x_row + cols * stride_xk, mask=col_ok, other=0.0)
        ak = tl.load(a_rows + cols[None, :] * stride_ak, mask=rank_ok & col_ok[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    tl.store(v + t.to(tl.int64) * stride_vt + ranks * stride_vr, acc, mask=ranks < max_rank)


@triton.jit
def dora_out_scales(out_scales, dora_slots, slot, cols, h_out, stride_os, stride_on):
    """The slot's DoRA out_scales at `cols` if it is a DoRA slot, else 1 (nothing read)."""
    is_dora = tl.load(dora_slots + slot)
    m_end = tl.where(is_dora != 0, h_out, 0)  # a bound, not a scalar-bool mask (see shrink_rowwise_kernel)
    return tl.load(out_scales + slot.to(tl.int64) * stride_os + cols * stride_on, mask=cols < m_end, other=1.0)


@triton.jit(do_not_specialize=["num_segments", "num_steps"])
def expand_rowwise_kernel(
    y, v, lora_b, scales, token_scales, out_scales, dora_slots, token_slots, seg_indptr, seg_slots, num_segments,
    num_steps, h_out, max_rank, slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs,
    stride_bn, stride_br, stride_os, stride_on,
    SEGMENTED: tl.constexpr, FAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    TOKEN_SCALES: tl.constexpr, DORA: tl.constexpr, ACCUMULATE: tl.constexpr, PDL: tl.constexpr,
):
    """y += delta (ACCUMULATE), or y = delta with zeros for tokens of no slot; DoRA only when
    accumulating. One program per token and block of columns."""
    _expand_row(tl.program_id(0), tl.program_id(1), y, v, lora_b, scales, token_scales, out_scales, dora_slots,
                token_slots, seg_indptr, seg_slots, num_segments, num_steps, h_out, max_rank, slice1_start,
                slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs, stride_bn, stride_br, stride_os,
                stride_on, SEGMENTED, FAN, BLOCK_N, BLOCK_R, TOKEN_SCALES, DORA, ACCUMULATE, PDL)


@triton.jit
def _expand_row(
    t, col_block, y, v, lora_b, scales, token_scales, out_scales, dora_slots, token_slots, seg_indptr, seg_slots,
    num_segments, num_steps, h_out, max_rank, slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr,
    stride_bs, stride_bn, stride_br, stride_os, stride_on,
    SEGMENTED: tl.constexpr, FAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    TOKEN_SCALES: tl.constexpr, DORA: tl.constexpr, ACCUMULATE: tl.constexpr, PDL: tl.constexpr,
):
    """expand_rowwise_kernel's program for token t and column block col_block."""
    col0 = col_block * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    slot = _row_slot(t, token_slots, seg_indptr, seg_slots, num_segments, num_steps, SEGMENTED, FAN)
    valid = slot >= 0
    safe_slot = tl.maximum(slot, 0)
    rank_ok = ranks < tl.where(valid, max_rank, 0)  # bounds, not scalar-bool masks: see shrink
    col_ok = cols < tl.where(valid, h_out, 0)
    b = tl.load(lora_b + safe_slot.to(tl.int64) * stride_bs + cols[:, None].to(tl.int64) * stride_bn
                + ranks[None, :] * stride_br,
                mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
    scale = tl.load(scales + safe_slot, mask=valid, other=0.0).to(tl.float32)
    if TOKEN_SCALES:
        scale = scale * tl.load(token_scales + t)
    b = b.to(tl.float32)
    col_slice, first, last = _column_slices(cols, col0, h_out, slice1_start, slice2_start, BLOCK_N)
    _previous_kernel_done(PDL)  # v and y are read after it
    v_row = v + t.to(tl.int64) * stride_vt
    delta = tl.zeros([BLOCK_N], tl.float32)
    for i in range(first, last + 1):  # the slices this block's columns belong to
        vt = tl.load(v_row + (i * max_rank + ranks) * stride_vr, mask=rank_ok, other=0.0)
        delta = tl.where(col_slice == i, tl.sum(b * vt.to(tl.float32)[None, :], axis=1), delta)
    delta = delta * scale
    y_row = y + t.to(tl.int64) * stride_yt + cols * stride_yn
    if ACCUMULATE:
        old = tl.load(y_row, mask=col_ok, other=0.0)
        out = old.to(tl.float32) + delta
        if DORA:
            out = out * dora_out_scales(out_scales, dora_slots, safe_slot, cols, tl.where(valid, h_out, 0),
                                         stride_os, stride_on)
        tl.store(y_row, out.to(y.dtype.element_ty), mask=col_ok)
    else:
        tl.store(y_row, delta.to(y.dtype.element_ty), mask=cols < h_out)


@triton.jit
def add_delta_rowwise_kernel(
    y, d, out_scales, dora_slots, token_slots, h_out, stride_yt, stride_yn, stride_dt, stride_dn, stride_os,
    stride_on, BLOCK_N: tl.constexpr, DORA: tl.constexpr, PDL: tl.constexpr,
):
    """y = y + d, then rows of DoRA slots times their out_scales: the accumulating expand's epilogue
    with the delta precomputed (expand_rowwise_kernel with ACCUMULATE off)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < h_out
    if DORA:
        slot = tl.load(token_slots + t)
        scales = dora_out_scales(out_scales, dora_slots, tl.maximum(slot, 0), cols, tl.where(slot >= 0, h_out, 0),
                                  stride_os, stride_on)
    _previous_kernel_done(PDL)  # y and d are read after it
    y_row = y + t.to(tl.int64) * stride_yt + cols * stride_yn
    out = tl.load(y_row, mask=col_ok, other=0.0).to(tl.float32)
    out = out + tl.load(d + t.to(tl.int64) * stride_dt + cols * stride_dn, mask=col_ok, other=0.0)
    if DORA:
        out = out * scales
    tl.store(y_row, out.to(y.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_segments", "num_steps", "k_per_split"])
def sgmv_shrink_tile_kernel(
    x, lora_a, v, seg_indptr, seg_slots, num_tokens, num_segments, num_steps, h_in, max_rank,
    k_per_split, stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_vt, stride_vr,
    FAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    ranks = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, h_in)
    first, last = _tile_segments(seg_indptr, num_segments, num_tokens, row0, num_steps, BLOCK_M, FAN)
    _previous_kernel_done(PDL)
    for s in range(first, last + 1):
        active, slot, in_seg = _tile_segment(seg_indptr, seg_slots, s, rows, num_tokens)
        if active:
            x_rows = x + rows[:, None].to(tl.int64) * stride_xt
            a_cols = lora_a + slot.to(tl.int64) * stride_as + ranks[None, :] * stride_ar
            acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for k in range(k_lo, k_hi, BLOCK_K):
                ks = k + tl.arange(0, BLOCK_K)
                k_ok = ks < k_hi
                xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=in_seg[:, None] & k_ok[None, :],
                             other=0.0)
                at = tl.load(a_cols + ks[:, None] * stride_ak,
                             mask=k_ok[:, None] & (ranks < max_rank)[None, :], other=0.0)
                if UPCAST:
                    xt = xt.to(tl.float32)
                    at = at.to(tl.float32)
                acc = tl.dot(xt, at, acc, input_precision=PRECISION)
            out = v + rows[:, None].to(tl.int64) * stride_vt + ranks[None, :] * stride_vr
            out_ok = in_seg[:, None] & (ranks < max_rank)[None, :]
            # into v zeroed before the launch, whether h_in is split or not: a launch of one split (a
            # long prompt run eagerly) runs the variant that the CUDA graphs' capture compiled
            tl.atomic_add(out, acc, mask=out_ok, sem="relaxed")  # the launch boundary orders them


@triton.jit
def _expand_tile_slice(delta, v, lora_b, slot, rows, cols, ranks, in_seg, rank_ok, b_ok, rank0, stride_vt,
                       stride_vr, stride_bs, stride_bn, stride_br, PRECISION: tl.constexpr):
    """delta + v[rows, rank0 + ranks] @ B[slot, cols, ranks]^T over the columns b_ok."""
    vt = tl.load(v + rows[:, None].to(tl.int64) * stride_vt + (rank0 + ranks)[None, :] * stride_vr,
                 mask=in_seg[:, None] & rank_ok[None, :], other=0.0)
    b = tl.load(lora_b + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn
                + ranks[:, None] * stride_br, mask=rank_ok[:, None] & b_ok[None, :], other=0.0)
    return tl.dot(vt.to(tl.float32), b.to(tl.float32), delta, input_precision=PRECISION)


@triton.jit(do_not_specialize=["num_tokens", "num_segments", "num_steps"])
def sgmv_expand_tile_kernel(
    y, v, lora_b, scales, token_scales, out_scales, dora_slots, seg_indptr, seg_slots, num_tokens, num_segments,
    num_steps, h_out, max_rank, slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs,
    stride_bn, stride_br, stride_os, stride_on,
    FAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLICED: tl.constexpr, TOKEN_SCALES: tl.constexpr, DORA: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per tile of BLOCK_M tokens and block of BLOCK_N columns."""
    _expand_tile(tl.program_id(0), tl.program_id(1), y, v, lora_b, scales, token_scales, out_scales, dora_slots,
                 seg_indptr, seg_slots, num_tokens, num_segments, num_steps, h_out, max_rank, slice1_start,
                 slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs, stride_bn, stride_br, stride_os,
                 stride_on, FAN, BLOCK_M, BLOCK_N, BLOCK_R, SLICED, TOKEN_SCALES, DORA, PRECISION, PDL)


@triton.jit
def _expand_tile(
    tile, col_block, y, v, lora_b, scales, token_scales, out_scales, dora_slots, seg_indptr, seg_slots, num_tokens,
    num_segments, num_steps, h_out, max_rank, slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr,
    stride_bs, stride_bn, stride_br, stride_os, stride_on,
    FAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLICED: tl.constexpr, TOKEN_SCALES: tl.constexpr, DORA: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """sgmv_expand_tile_kernel's program for a tile of tokens and a block of columns."""
    row0 = tile * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    col0 = col_block * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < max_rank
    col_slice, first_slice, last_slice = _column_slices(cols, col0, h_out, slice1_start, slice2_start, BLOCK_N)
    first, last = _tile_segments(seg_indptr, num_segments, num_tokens, row0, num_steps, BLOCK_M, FAN)
    _previous_kernel_done(PDL)
    for s in range(first, last + 1):
        active, slot, in_seg = _tile_segment(seg_indptr, seg_slots, s, rows, num_tokens)
        if active:
            out = y + rows[:, None].to(tl.int64) * stride_yt + cols[None, :] * stride_yn
            out_ok = in_seg[:, None] & (cols < h_out)[None, :]
            old = tl.load(out, mask=out_ok, other=0.0)  # the largest load first
            delta = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if SLICED:
                for i in range(first_slice, last_slice + 1):  # each slice: its ranks, its columns
                    delta = _expand_tile_slice(delta, v, lora_b, slot, rows, cols, ranks, in_seg, rank_ok,
                                               (cols < h_out) & (col_slice == i), i * max_rank, stride_vt,
                                               stride_vr, stride_bs, stride_bn, stride_br, PRECISION)
            else:  # one dot, which the compiler pipelines better than a loop of one step
                delta = _expand_tile_slice(delta, v, lora_b, slot, rows, cols, ranks, in_seg, rank_ok,
                                           cols < h_out, 0, stride_vt, stride_vr, stride_bs, stride_bn,
                                           stride_br, PRECISION)
            scale = tl.load(scales + slot).to(tl.float32)
            if TOKEN_SCALES:
                row_scales = scale * tl.load(token_scales + rows, mask=in_seg, other=0.0)
                delta = delta * row_scales[:, None]
            else:
                delta = delta * scale
            result = old.to(tl.float32) + delta
            if DORA:
                result = result * dora_out_scales(out_scales, dora_slots, slot, cols, h_out, stride_os,
                                                   stride_on)[None, :]
            tl.store(out, result.to(y.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_segments", "num_steps", "tile_programs"])
def mixed_expand_kernel(
    y, v, lora_b, scales, token_scales, out_scales, dora_slots, token_slots, seg_indptr, seg_slots, num_tokens,
    num_segments, num_steps, tile_programs, h_out, max_rank, slice1_start, slice2_start, stride_yt, stride_yn,
    stride_vt, stride_vr, stride_bs, stride_bn, stride_br, stride_os, stride_on,
    FAN: tl.constexpr, BLOCK_M: tl.constexpr, TILE_BLOCK_N: tl.constexpr, TILE_BLOCK_R: tl.constexpr,
    ROW_BLOCK_N: tl.constexpr, ROW_BLOCK_R: tl.constexpr, SLICED: tl.constexpr, TOKEN_SCALES: tl.constexpr,
    DORA: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """A mixed batch's expand in one launch: its first `tile_programs` programs are
    sgmv_expand_tile_kernel's over the SGMV tokens [0, num_tokens) (tile-major), the rest
    expand_rowwise_kernel's, accumulating, over the BGMV tokens from num_tokens on (token-major),
    each by its token_slots."""
    pid = tl.program_id(0)
    tile_col_blocks = tl.cdiv(h_out, TILE_BLOCK_N)
    if pid < tile_programs:
        _expand_tile(pid // tile_col_blocks, pid % tile_col_blocks, y, v, lora_b, scales, token_scales, out_scales,
                     dora_slots, seg_indptr, seg_slots, num_tokens, num_segments, num_steps, h_out, max_rank,
                     slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs, stride_bn,
                     stride_br, stride_os, stride_on, FAN, BLOCK_M, TILE_BLOCK_N, TILE_BLOCK_R, SLICED, TOKEN_SCALES,
                     DORA, PRECISION, PDL)
    else:
        row_col_blocks = tl.cdiv(h_out, ROW_BLOCK_N)
        q = pid - tile_programs
        _expand_row(num_tokens + q // row_col_blocks, q % row_col_blocks, y, v, lora_b, scales, token_scales,
                    out_scales, dora_slots, token_slots, seg_indptr, seg_slots, num_segments, num_steps, h_out,
                    max_rank, slice1_start, slice2_start, stride_yt, stride_yn, stride_vt, stride_vr, stride_bs,
                    stride_bn, stride_br, stride_os, stride_on, False, FAN, ROW_BLOCK_N, ROW_BLOCK_R, TOKEN_SCALES,
                    DORA, True, PDL)
