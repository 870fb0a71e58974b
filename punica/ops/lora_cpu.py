"""A projection group's LoRA on the CPU for the whole batch at once: the shrink and each slice's
expand as one grouped GEMM over the pool's slots (torch._grouped_mm, the tokens with an adapter
sorted by slot into one group per slot, empty for slots no token uses).

The references of punica.ops.lora (the spec, and the CPU's path where this one does not apply) loop
over a batch's segments, a dozen small torch calls per segment and slice, so a step's LoRA time
grows with the adapters in it; here a group costs the same few calls whatever the batch holds. The
values are the references' up to rounding: each group's product is the one the reference computes
for that slot's rows (MKL may sum it in another order for another number of rows: a slot's tokens
are one group here, possibly several segments there), then the same scale (the slot's times each
token's), the same add into y in float32 and DoRA's out_scales on DoRA slots' rows.

It applies to fp32 tensors (the CPU's model dtype) where torch has a CPU grouped GEMM
(`grouped_available`) and the operands' strides are the multiples of 16 bytes it requires: h_in and
the rank padded to a multiple of 4 (`grouped_applies`), in batches of at least MIN_SEGMENTS
segments. torch's CPU grouped GEMM runs one small product per group (every slot of the pool, empty
ones too) behind one call, and the gathers by slot cost what a short loop saves: SmolLM2-135M's
four groups over 30 layers, 32 decode tokens, rank 16, 32 slots (2-core AVX-512 CPU, torch 2.13,
one-off script, fastest of 4; docs/results/cpu_grouped_lora_ops_2026-12-05.log): 62.8 ms against
the references' 42.5 with one adapter, 49.3 against 50.5 with 2, 54.7 against 55.8 with 4, 58.9
against 69.6 with 6, 65.8 against 86.0 with 8, and 98.1 against 235.8 with 32 distinct.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from punica.ops.lora_shapes import check_slice_bounds

MIN_SEGMENTS = 4  # a batch's segments from which the grouped GEMMs beat the references' loops (docstring)


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


def grouped_applies(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, num_segments: int) -> bool:
    """Whether a group's LoRA on these tensors (x [T, h_in], lora_a [S, n*R, h_in], lora_b
    [S, h_out, R]) in a batch of `num_segments` segments runs here (CPU, fp32, h_in and R multiples
    of 4, at least MIN_SEGMENTS segments) rather than the references."""
    return (num_segments >= MIN_SEGMENTS and x.device.type == "cpu"
            and x.dtype == lora_a.dtype == lora_b.dtype == torch.float32
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
