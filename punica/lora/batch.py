"""LoraBatch: the per-step LoRA index metadata, built once per step and passed explicitly."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica.ops.lora import prefer_bgmv


@dataclass(frozen=True)
class LoraBatch:
    seg_indptr: torch.Tensor   # [num_segments + 1] int32: token offsets of runs of equal slots
    seg_slots: torch.Tensor    # [num_segments] int32: slot of each run (-1: no LoRA)
    token_slots: torch.Tensor  # [num_tokens] int32: slot of each token
    token_scales: torch.Tensor  # [num_tokens] float32: each token's lora_scale (its request's)
    use_bgmv: bool             # run BGMV (per token) instead of SGMV (per segment)
    any_lora: bool             # False when every token has slot -1: the model skips LoRA

    def __post_init__(self):
        assert self.seg_indptr.numel() == self.seg_slots.numel() + 1
        assert self.seg_indptr.dtype == self.seg_slots.dtype == self.token_slots.dtype == torch.int32
        assert self.token_scales.dtype == torch.float32 and self.token_scales.shape == self.token_slots.shape

    @classmethod
    def build(cls, request_slots: list[int], request_num_tokens: list[int],
              device: torch.device | str = "cpu", use_bgmv: bool | None = None,
              request_scales: list[float] | None = None) -> LoraBatch:
        """From each request's slot, token count and lora_scale (default 1), in the batch's token order.

        Neighbouring requests with the same slot merge into one segment, whatever their scales
        (the expand reads each token's); order requests by slot (within prefill and within
        decode) to get fewer, longer segments. By default the kernel family is the one measured
        faster for this shape on the GPU (`prefer_bgmv`).
        """
        assert len(request_slots) == len(request_num_tokens)
        scales = request_scales if request_scales is not None else [1.0] * len(request_slots)
        assert len(scales) == len(request_slots)
        indptr, slots = [0], []
        for slot, n in zip(request_slots, request_num_tokens):
            if n == 0:
                continue
            if slots and slots[-1] == slot:
                indptr[-1] += n
            else:
                slots.append(slot)
                indptr.append(indptr[-1] + n)
        token_slots = [s for s, n in zip(request_slots, request_num_tokens) for _ in range(n)]
        token_scales = [scale for scale, n in zip(scales, request_num_tokens) for _ in range(n)]
        if use_bgmv is None:  # on CPU the references run, and the segment loop is the cheaper one
            use_bgmv = torch.device(device).type == "cuda" and prefer_bgmv(len(token_slots), len(slots))
        return cls(
            seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            seg_slots=torch.tensor(slots, dtype=torch.int32, device=device),
            token_slots=torch.tensor(token_slots, dtype=torch.int32, device=device),
            token_scales=torch.tensor(token_scales, dtype=torch.float32, device=device),
            use_bgmv=use_bgmv,
            any_lora=any(s >= 0 for s in slots),
        )
