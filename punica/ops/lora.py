"""The Punica LoRA operators: SGMV (segments) and BGMV (one slot per token).

Canonical weight layout (one per projection of one layer, shared by every op here):

    lora_a : [num_slots, max_rank, h_in]    shrink weights, rows >= an adapter's rank are zero
    lora_b : [num_slots, h_out, max_rank]   expand weights, columns >= its rank are zero
    scales : [num_slots] float32            lora_alpha / r (or / sqrt(r) with rsLoRA)

The expand also takes `token_scales` [num_tokens] float32, each token's own strength of its
adapter (a request's lora_scale: 0 = the base model, 1 = as trained), multiplied into the delta
with the slot's scale; None means 1 for every token.

DoRA: the expand may also take `dora` = (out_scales [num_slots, h_out] float32, dora_slots
[num_slots] int32). A token whose slot s has dora_slots[s] != 0 leaves the expand with its whole
output row multiplied by out_scales[s] (m / ||W + scale * B @ A||, see punica.lora.pool): its
base projection output plus its delta; tokens of other slots and of slot -1 are untouched.

A slot is an index into the GPU adapter pool; slot -1 means "no LoRA" and its rows are left
untouched (shrink writes zeros for them).

Projections that share an input (q/k/v, gate/up) run as one *group*: their A matrices stacked
along the rank axis, lora_a [S, n*R, h_in] (rows i*R:(i+1)*R are projection i's), so one
shrink computes every projection's v [T, n*R]; their B matrices stacked along the output
axis, lora_b [S, sum h_out_i, R], and one *sliced* expand adds each column slice's delta from
its own ranks of v. `slice_bounds` (b_0 = 0 <= b_1 <= ... <= b_n = h_out, plain ints taken
from shapes) names the slices; None means one slice, the plain expand. The intermediate `v` is
float32 whatever the input dtype. The PyTorch references (`*_ref`) are the spec; each public function runs the Triton
kernel of punica.ops.lora_triton when its tensors are on CUDA, and the reference otherwise.
"""

from __future__ import annotations

from typing import Protocol

import torch

from punica.ops.lora_shapes import check_slice_bounds, prefer_bgmv  # noqa: F401 (prefer_bgmv: re-exported)


class LoraIndices(Protocol):
    """The per-step index metadata `add_lora` needs (see punica.lora.batch.LoraBatch)."""

    seg_indptr: torch.Tensor   # [num_segments + 1] int32, token offsets of the segments
    seg_slots: torch.Tensor    # [num_segments] int32, slot of each segment (-1: no LoRA)
    token_slots: torch.Tensor  # [num_tokens] int32, slot of each token (-1: no LoRA)
    token_scales: torch.Tensor  # [num_tokens] float32, each token's lora_scale
    sgmv_tokens: int           # tokens [0, sgmv_tokens) run SGMV over the segments, the rest BGMV
    sgmv_block_m: int          # SGMV's tile height (1: its row-wise schedule)


def sgmv_shrink_ref(x, lora_a, seg_indptr, seg_slots):
    num_tokens, max_rank = x.shape[0], lora_a.shape[1]
    v = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    bounds = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            lo, hi = bounds[i], bounds[i + 1]
            v[lo:hi] = x[lo:hi].float() @ lora_a[slot].float().T
    return v


def _token_scaled(delta, slot_scale, token_scales, rows):
    """delta [n, h] times its slot's scale and, if given, each of its rows' token scale."""
    if token_scales is None:
        return delta * slot_scale.float()
    return delta * (slot_scale.float() * token_scales[rows].float())[:, None]


def _expand_sliced_ref(expand, y, v, lora_b, slice_bounds, dora):
    """Run a one-slice expand reference on every slice: its columns of y, B and DoRA's out_scales,
    its ranks of v."""
    bounds, max_rank = check_slice_bounds(slice_bounds, y.shape[1]), lora_b.shape[2]
    assert v.shape == (y.shape[0], (len(bounds) - 1) * max_rank), (v.shape, bounds, max_rank)
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        expand(y[:, lo:hi], v[:, i * max_rank:(i + 1) * max_rank], lora_b[:, lo:hi],
               None if dora is None else (dora[0][:, lo:hi], dora[1]))


def _dora_scaled(out, slot, dora):
    """out [n, h] (y + delta, float32) times the slot's DoRA out_scales row, if it is a DoRA slot."""
    if dora is not None and int(dora[1][slot]) != 0:
        return out * dora[0][slot].float()
    return out


def sgmv_expand_ref(y, v, lora_b, seg_indptr, seg_slots, scales, slice_bounds=None, token_scales=None,
                    dora=None):
    if slice_bounds is not None:
        return _expand_sliced_ref(lambda y_i, v_i, b_i, d_i: sgmv_expand_ref(y_i, v_i, b_i, seg_indptr, seg_slots,
                                                                              scales, None, token_scales, d_i),
                                  y, v, lora_b, slice_bounds, dora)
    bounds = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            lo, hi = bounds[i], bounds[i + 1]
            delta = _token_scaled(v[lo:hi] @ lora_b[slot].float().T, scales[slot], token_scales, slice(lo, hi))
            y[lo:hi] = _dora_scaled(y[lo:hi].float() + delta, slot, dora).to(y.dtype)


def bgmv_shrink_ref(x, lora_a, token_slots):
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot >= 0:
            rows = token_slots == slot
            v[rows] = x[rows].float() @ lora_a[slot].float().T
    return v


def bgmv_expand_ref(y, v, lora_b, token_slots, scales, slice_bounds=None, token_scales=None, dora=None):
    if slice_bounds is not None:
        return _expand_sliced_ref(lambda y_i, v_i, b_i, d_i: bgmv_expand_ref(y_i, v_i, b_i, token_slots, scales, None,
                                                                              token_scales, d_i),
                                  y, v, lora_b, slice_bounds, dora)
    for slot in torch.unique(token_slots).tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().squeeze(1)
            delta = _token_scaled(v[rows] @ lora_b[slot].float().T, scales[slot], token_scales, rows)
            y[rows] = _dora_scaled(y[rows].float() + delta, slot, dora).to(y.dtype)


def bgmv_delta_ref(v, lora_b, token_slots, scales, slice_bounds=None, token_scales=None):
    d = torch.zeros(v.shape[0], lora_b.shape[1], dtype=torch.float32, device=v.device)
    bgmv_expand_ref(d, v, lora_b, token_slots, scales, slice_bounds, token_scales)
    return d


def add_delta_ref(y, d, token_slots, dora=None):
    for slot in torch.unique(token_slots).tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().squeeze(1)
            y[rows] = _dora_scaled(y[rows].float() + d[rows], slot, dora).to(y.dtype)


def _into(out: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor:
    """v, or `out` holding it (the references build v; the Triton kernels write `out` directly)."""
    return v if out is None else out.copy_(v)


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, block_m: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Segmented shrink (`block_m`: the Triton tile height, by default from the shapes; `out`: a
    [T, R] fp32 tensor that receives v).

        x: [T, h_in], lora_a: [S, R, h_in], seg_indptr: [n+1], seg_slots: [n]  ->  v: [T, R] fp32
        for i in range(n):
            rows = seg_indptr[i] : seg_indptr[i+1]
            v[rows] = x[rows] @ lora_a[seg_slots[i]].T   if seg_slots[i] >= 0 else 0
    """
    if x.is_cuda:
        from punica.ops.lora_triton import sgmv_shrink_triton
        return sgmv_shrink_triton(x, lora_a, seg_indptr, seg_slots, out=out, block_m=block_m)
    return _into(out, sgmv_shrink_ref(x, lora_a, seg_indptr, seg_slots))


def sgmv_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, seg_indptr: torch.Tensor,
                seg_slots: torch.Tensor, scales: torch.Tensor,
                slice_bounds: tuple[int, ...] | None = None, token_scales: torch.Tensor | None = None,
                dora: tuple[torch.Tensor, torch.Tensor] | None = None, block_m: int | None = None) -> None:
    """Segmented expand, accumulating into y in place (y may be a column slice of a wider tensor);
    `block_m` as sgmv_shrink's.

        y: [T, h_out], v: [T, n*R] fp32, lora_b: [S, h_out, R], scales: [S],
        slice_bounds: (b_0 = 0, b_1, ..., b_n = h_out), default (0, h_out),
        token_scales: [T] float32, default 1
        for i in range(num_segments):
            s = seg_slots[i]; rows = seg_indptr[i] : seg_indptr[i+1]
            for j in range(n):                            # slice j: its columns, its ranks of v
                cols = b_j : b_{j+1}
                y[rows, cols] += (scales[s] * token_scales[rows]) * v[rows, j*R : (j+1)*R] @ lora_b[s, cols].T
                                 if s >= 0
            y[rows] *= out_scales[s]   if s >= 0 and dora is given and dora_slots[s] != 0
    """
    if y.is_cuda:
        from punica.ops.lora_triton import sgmv_expand_triton
        return sgmv_expand_triton(y, v, lora_b, seg_indptr, seg_slots, scales, block_m=block_m,
                                  slice_bounds=slice_bounds, token_scales=token_scales, dora=dora)
    return sgmv_expand_ref(y, v, lora_b, seg_indptr, seg_slots, scales, slice_bounds, token_scales, dora)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Batched-gather shrink, one slot per token (`out` as sgmv_shrink's).

        x: [T, h_in], lora_a: [S, R, h_in], token_slots: [T]  ->  v: [T, R] fp32
        v[t] = x[t] @ lora_a[token_slots[t]].T   if token_slots[t] >= 0 else 0
    """
    if x.is_cuda:
        from punica.ops.lora_triton import bgmv_shrink_triton
        return bgmv_shrink_triton(x, lora_a, token_slots, out=out)
    return _into(out, bgmv_shrink_ref(x, lora_a, token_slots))


def bgmv_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                scales: torch.Tensor, slice_bounds: tuple[int, ...] | None = None,
                token_scales: torch.Tensor | None = None,
                dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Batched-gather expand, accumulating into y in place.

        y: [T, h_out], v: [T, n*R] fp32, lora_b: [S, h_out, R], token_slots: [T], scales: [S],
        slice_bounds: (b_0 = 0, b_1, ..., b_n = h_out), default (0, h_out),
        token_scales: [T] float32, default 1
        for j in range(n):
            cols = b_j : b_{j+1}
            y[t, cols] += (scales[s] * token_scales[t]) * v[t, j*R : (j+1)*R] @ lora_b[s, cols].T
                          where s = token_slots[t], if s >= 0
        y[t] *= out_scales[s]   if s >= 0 and dora is given and dora_slots[s] != 0
    """
    if y.is_cuda:
        from punica.ops.lora_triton import bgmv_expand_triton
        return bgmv_expand_triton(y, v, lora_b, token_slots, scales, slice_bounds=slice_bounds,
                                  token_scales=token_scales, dora=dora)
    return bgmv_expand_ref(y, v, lora_b, token_slots, scales, slice_bounds, token_scales, dora)


def bgmv_delta(v: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, scales: torch.Tensor,
               slice_bounds: tuple[int, ...] | None = None,
               token_scales: torch.Tensor | None = None) -> torch.Tensor:
    """bgmv_expand's delta alone, without y: d [T, h_out] float32, zero for tokens of slot -1.

        d[t, cols] = (scales[s] * token_scales[t]) * v[t, j*R : (j+1)*R] @ lora_b[s, cols].T
                     for each slice j, where s = token_slots[t] >= 0

    add_delta(y, d, token_slots, dora) then leaves y as bgmv_expand(y, v, ...) would, bit for bit,
    so the delta can run beside the base GEMM that writes y."""
    if v.is_cuda:
        from punica.ops.lora_triton import bgmv_delta_triton
        return bgmv_delta_triton(v, lora_b, token_slots, scales, slice_bounds, token_scales)
    return bgmv_delta_ref(v, lora_b, token_slots, scales, slice_bounds, token_scales)


def add_delta(y: torch.Tensor, d: torch.Tensor, token_slots: torch.Tensor,
              dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """y[t] = y[t] + d[t] in float32, times out_scales[s] if s = token_slots[t] is a DoRA slot,
    rounded once to y's dtype, in place (d: bgmv_delta's)."""
    if y.is_cuda:
        from punica.ops.lora_triton import add_delta_triton
        return add_delta_triton(y, d, token_slots, dora)
    return add_delta_ref(y, d, token_slots, dora)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: LoraIndices) -> torch.Tensor:
    """The first half of `add_lora`: v [T, n*R] fp32, SGMV for the batch's first sgmv_tokens
    tokens and BGMV for the rest."""
    n = indices.sgmv_tokens
    if n == 0:
        return bgmv_shrink(x, lora_a, indices.token_slots)
    if n == x.shape[0]:
        return sgmv_shrink(x, lora_a, indices.seg_indptr, indices.seg_slots, indices.sgmv_block_m)
    v = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink(x[:n], lora_a, indices.seg_indptr, indices.seg_slots, indices.sgmv_block_m, out=v[:n])
    bgmv_shrink(x[n:], lora_a, indices.token_slots[n:], out=v[n:])
    return v


def lora_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                indices: LoraIndices, slice_bounds: tuple[int, ...] | None = None,
                dora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The second half of `add_lora`: y += each token's v @ B.T * scale * its token scale, in place,
    then DoRA slots' rows times their out_scales; SGMV and BGMV as `lora_shrink` (on CUDA, a mixed
    batch whose SGMV runs tiles: both in one launch)."""
    n, token_scales = indices.sgmv_tokens, indices.token_scales
    if y.is_cuda and 0 < n < y.shape[0] and indices.sgmv_block_m > 1:
        from punica.ops.lora_triton import mixed_expand_triton
        return mixed_expand_triton(y, v, lora_b, indices.seg_indptr, indices.seg_slots, indices.token_slots, n,
                                   scales, indices.sgmv_block_m, slice_bounds, token_scales, dora)
    if n > 0:
        sgmv_expand(y[:n], v[:n], lora_b, indices.seg_indptr, indices.seg_slots, scales, slice_bounds,
                    token_scales[:n], dora, indices.sgmv_block_m)
    if n < y.shape[0]:
        bgmv_expand(y[n:], v[n:], lora_b, indices.token_slots[n:], scales, slice_bounds, token_scales[n:], dora)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scales: torch.Tensor, indices: LoraIndices,
             slice_bounds: tuple[int, ...] | None = None) -> None:
    """Add every token's adapter delta to the base projection's output, in place: one shrink
    and one expand, for one projection or a group of n sharing x (see the module docstring).

        y: [T, h_out], x: [T, h_in], lora_a: [S, n*R, h_in], lora_b: [S, h_out, R],
        slice_bounds: (b_0 = 0, ..., b_n = h_out), default (0, h_out);
        per segment (or per token with BGMV) of slot s >= 0, per slice j, cols = b_j : b_{j+1}:
        y[rows, cols] += (x[rows] @ lora_a[s, j*R:(j+1)*R].T) @ lora_b[s, cols].T
                         * (scales[s] * indices.token_scales[rows])
    """
    lora_expand(y, lora_shrink(x, lora_a, indices), lora_b, scales, indices, slice_bounds)
