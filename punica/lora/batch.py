"""LoraBatch: the per-step LoRA index metadata, built once per step and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from punica.ops.lora_cpu import SlotGroups
from punica.ops.lora_shapes import sgmv_block_m
from punica.ops.transfer import to_device

KERNELS = ("auto", "sgmv", "bgmv")  # LoraBatch.build's choices of kernel


@dataclass(frozen=True)
class LoraBatch:
    """Tokens [0, sgmv_tokens) (the prefill requests', when their segments are long enough) run
    SGMV over the segments, which cover exactly them; the others (decodes) run BGMV by their
    token slots. A mixed step so runs its prompt chunks on SGMV's tiles and its decodes row-wise
    instead of running every token row-wise."""
    seg_indptr: torch.Tensor   # [num_segments + 1] int32: token offsets of runs of equal slots
    seg_slots: torch.Tensor    # [num_segments] int32: slot of each run (-1: no LoRA)
    token_slots: torch.Tensor  # [num_tokens] int32: slot of each token
    token_scales: torch.Tensor  # [num_tokens] float32: each token's lora_scale (its request's)
    sgmv_tokens: int           # the leading tokens that run SGMV (the rest: BGMV)
    sgmv_block_m: int          # SGMV's tile height (punica.ops.lora_triton.sgmv_block_m; 1: row-wise)
    any_lora: bool             # False when every token has slot -1: the model skips LoRA
    _slot_groups: dict[int, SlotGroups] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        assert self.seg_indptr.numel() == self.seg_slots.numel() + 1
        assert self.seg_indptr.dtype == self.seg_slots.dtype == self.token_slots.dtype == torch.int32
        assert self.token_scales.dtype == torch.float32 and self.token_scales.shape == self.token_slots.shape
        assert 0 <= self.sgmv_tokens <= self.token_slots.numel() and self.sgmv_block_m >= 1

    def slot_groups(self, num_slots: int) -> SlotGroups:
        """The tokens with an adapter grouped by slot for a pool of `num_slots` slots
        (punica.ops.lora_cpu), made at the step's first call and kept for its other layers."""
        if num_slots not in self._slot_groups:
            self._slot_groups[num_slots] = SlotGroups.of(self.token_slots, num_slots)
        return self._slot_groups[num_slots]

    @classmethod
    def build(cls, request_slots: list[int], request_num_tokens: list[int],
              device: torch.device | str = "cpu", kernel: str = "auto",
              request_scales: list[float] | None = None, num_prefills: int | None = None) -> LoraBatch:
        """From each request's slot, token count and lora_scale (default 1), in the batch's token
        order; the first `num_prefills` requests (default: all) may run SGMV.

        Neighbouring requests with the same slot merge into one segment, whatever their scales
        (the expand reads each token's); order requests by slot (within prefill and within
        decode) to get fewer, longer segments. By default, on the GPU, the prefill requests run
        SGMV where it is measured faster for their shape (`sgmv_prefix`) and the rest BGMV; on
        the CPU (the references) every request runs SGMV, whose segment loop is the cheaper one.
        `kernel` picks instead: "bgmv" runs every token on BGMV (no segments), "sgmv" gives every
        prefill request its segment and runs them on SGMV (the batch of an operator test that wants
        every request's segments: all requests, with `num_prefills` left out).
        """
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        assert len(request_slots) == len(request_num_tokens)
        scales = request_scales if request_scales is not None else [1.0] * len(request_slots)
        assert len(scales) == len(request_slots)
        prefills = len(request_slots) if num_prefills is None else num_prefills
        if kernel == "auto" and torch.device(device).type != "cuda":
            prefills = len(request_slots)
        indptr, slots = [0], []
        for slot, n in zip(request_slots[:prefills], request_num_tokens[:prefills]):
            if n == 0:
                continue
            if slots and slots[-1] == slot:
                indptr[-1] += n
            else:
                slots.append(slot)
                indptr.append(indptr[-1] + n)
        block_m = sgmv_block_m(indptr[-1], len(slots))
        if kernel == "bgmv" or (kernel == "auto" and torch.device(device).type == "cuda" and block_m == 1):
            indptr, slots = [0], []
        token_slots = [s for s, n in zip(request_slots, request_num_tokens) for _ in range(n)]
        token_scales = [scale for scale, n in zip(scales, request_num_tokens) for _ in range(n)]
        return cls(
            seg_indptr=to_device(torch.tensor(indptr, dtype=torch.int32), device),
            seg_slots=to_device(torch.tensor(slots, dtype=torch.int32), device),
            token_slots=to_device(torch.tensor(token_slots, dtype=torch.int32), device),
            token_scales=to_device(torch.tensor(token_scales, dtype=torch.float32), device),
            sgmv_tokens=indptr[-1],
            sgmv_block_m=block_m,
            any_lora=any(s >= 0 for s in request_slots),
        )
