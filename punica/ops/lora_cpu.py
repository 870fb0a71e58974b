"""A projection group's LoRA on the CPU, in fp32 (the CPU's model dtype), in one of two forms:

  * for the whole batch at once: the shrink and each slice's expand as one grouped GEMM over the
    pool's slots (torch._grouped_mm, the tokens with an adapter sorted by slot into one group per
    slot, empty for slots no token uses), in batches of at least MIN_SEGMENTS segments;
  * segment by segment (`segment_lora`), in batches of fewer: a segment's shrink as one product,
    scaled by its tokens' scales, and each slice's expand added into y by one addmm (beta 1, alpha
    the slot's scale), DoRA's out_scales after the slices.

The references of punica.ops.lora (the spec, and the CPU's path where neither applies) loop
over a batch's segments, a dozen small torch calls per segment and slice; the grouped form costs
the same few calls whatever the batch holds, `segment_lora` one call per segment and slice. The
values are the references' up to rounding: each group's product is the one the reference computes
for that slot's rows (MKL may sum it in another order for another number of rows: a slot's tokens
are one group here, possibly several segments there), then the same scale (the slot's times each
token's), the same add into y in float32 and DoRA's out_scales on DoRA slots' rows.

The grouped form applies where torch has a CPU grouped GEMM (`grouped_available`) and the
operands' strides are the multiples of 16 bytes it requires: h_in and the rank padded to a multiple
of 4 (`grouped_applies`). torch's CPU grouped GEMM runs one small product per group (every slot of
the pool, empty ones too) behind one call, and the gathers by slot cost what a short loop saves.
SmolLM2-135M's four groups over 30 layers, 32 decode tokens, rank 16, 32 slots, ms a step, segments
/ grouped / references (2-core Intel Xeon, torch 2.13, one-off script, fastest of 4;
docs/results/cpu_lora_segments_ab_intel_cpu_2026-12-05.log): 1 adapter 26.3 / 47.2 / 32.8, 4
adapters 37.0 / 52.0 / 49.8, 8 adapters 51.8-52.5 / 56.7-58.0 / 69.2-72.5, 10 (11 segments) 61.7 /
59.7 / 86.7, 16 adapters 81.5 / 68.8 / 117.0, 32 adapters 147.0 / 82.8 / 212.9; one decode token on
one adapter 4.6 / 19.0 / 8.8.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from punica.ops.lora_shapes import check_slice_bounds

MIN_SEGMENTS = 9  # a batch's segments from which the grouped GEMMs beat segment_lora's loop (docstring)


@cache
def grouped_available() -> bool:
    """Whether this torch runs torch._grouped_mm on CPU fp32 tensors with a group per slot."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        out = torch._grouped_mm(torch.ones(2, 4), torch.ones(3, 4, 4), offs=torch.tensor([1, 1, 2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return out.shape == (2, 4) and bool((out == 4).all())


def _cpu_fp32(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether x and the group's weights are the CPU's model dtype, fp32, on the CPU: what both forms need."""
    return x.device.type == "cpu" and x.dtype == lora_a.dtype == lora_b.dtype == torch.float32


def grouped_applies(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, num_segments: int) -> bool:
    """Whether a group's LoRA on these tensors (x [T, h_in], lora_a [S, n*R, h_in], lora_b
    [S, h_out, R]) in a batch of `num_segments` segments runs here (CPU, fp32, h_in and R multiples
    of 4, at least MIN_SEGMENTS segments) rather than the references."""
    return (num_segments >= MIN_SEGMENTS and _cpu_fp32(x, lora_a, lora_b)
            and x.shape[1] % 4 == 0 and lora_b.shape[2] % 4 == 0 and grouped_available())


@dataclass(frozen=True)
class SlotGroups:
    """A batch's tokens with an adapter, grouped by slot for torch._grouped_mm."""
    rows: torch.Tensor     # [n] int64: the tokens whose slot is >= 0, sorted by slot (stably)
    slots: torch.Tensor    # [n] int64: their slots
    offsets: torch.Tensor  # [S] int32: where each slot's group ends in `rows` (empty groups repeat)

    @classmethod
    def of(cls, token_slots: torch.Tensor, num_slots: int) -> SlotGroups:
        """token_slots [T] int (-1: no adapter), for a pool of `num_slots` slots."""
        order = torch.argsort(token_slots, stable=True)
        sorted_slots = token_slots[order].long()
        first = int((sorted_slots < 0).sum())
        slots = sorted_slots[first:]
        offsets = torch.cumsum(torch.bincount(slots, minlength=num_slots), 0).to(torch.int32)
        return cls(order[first:], slots, offsets)


def grouped_shrink(x: torch.Tensor, lora_a: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """x [T, h_in], lora_a [S, R, h_in]  ->  v [T, R] fp32: each token's x @ A[its slot].T, 0 for
    tokens without an adapter."""
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32)
    if groups.rows.numel():
        v[groups.rows] = torch._grouped_mm(x[groups.rows], lora_a.transpose(1, 2), offs=groups.offsets)
    return v


def grouped_expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
                   token_scales: torch.Tensor, groups: SlotGroups, slice_bounds: tuple[int, ...] | None,
                   dora: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """y [T, h_out] += each token's v @ B[its slot].T * scales[slot] * token_scales[token], slice by
    slice (v's ranks j*R:(j+1)*R into B's columns of slice j), then DoRA slots' rows times their
    out_scales: punica.ops.lora.lora_expand, in place."""
    rows, slots = groups.rows, groups.slots
    if not rows.numel():
        return
    bounds, max_rank = check_slice_bounds(slice_bounds, y.shape[1]), lora_b.shape[2]
    v_rows = v[rows]
    factor = (scales[slots] * token_scales[rows])[:, None]
    is_dora = None if dora is None else (dora[1][slots] != 0)[:, None]
    if is_dora is not None and not bool(is_dora.any()):
        is_dora = None
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        delta = torch._grouped_mm(v_rows[:, i * max_rank:(i + 1) * max_rank], lora_b[:, lo:hi].transpose(1, 2),
                                  offs=groups.offsets)
        out = y[rows, lo:hi] + delta * factor
        if is_dora is not None:
            out = torch.where(is_dora, out * dora[0][slots, lo:hi], out)
        y[rows, lo:hi] = out


def segments_apply(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, sgmv_tokens: int) -> bool:
    """Whether `segment_lora` runs a group's LoRA on these tensors: CPU, fp32, every token in the
    batch's segments (LoraBatch.build's choice on the CPU)."""
    return _cpu_fp32(x, lora_a, lora_b) and sgmv_tokens == x.shape[0]


def segment_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, token_scales: torch.Tensor, seg_indptr: torch.Tensor,
                 seg_slots: torch.Tensor, slice_bounds: tuple[int, ...] | None,
                 dora: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """punica.ops.lora.add_lora over the segments, in place: for each segment of slot s >= 0, v = x @
    A[s].T times each token's scale, then y's columns of slice j += scales[s] * v's ranks of slice j @
    B[s]'s rows of slice j.T, then, on a DoRA slot, the segment's rows times out_scales[s]. The
    products and the add into y run as the references' up to rounding (the token scale meets v
    before the expand here, after it there; addmm rounds y + alpha * product once)."""
    bounds, max_rank = check_slice_bounds(slice_bounds, y.shape[1]), lora_b.shape[2]
    indptr = seg_indptr.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        lo, hi = indptr[i], indptr[i + 1]
        v = x[lo:hi] @ lora_a[slot].T
        v.mul_(token_scales[lo:hi, None])
        rows, scale = y[lo:hi], float(scales[slot])
        for j, (c0, c1) in enumerate(zip(bounds, bounds[1:])):
            rows[:, c0:c1].addmm_(v[:, j * max_rank:(j + 1) * max_rank], lora_b[slot, c0:c1].T, alpha=scale)
        if dora is not None and int(dora[1][slot]) != 0:
            rows.mul_(dora[0][slot])
