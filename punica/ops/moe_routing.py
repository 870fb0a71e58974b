"""ExpertRouting: one MoE layer's (token, expert) pairs of a batch, as punica.ops.moe.route makes
them and the experts' operators (punica.ops.moe, its Triton kernels, punica.lora.experts) read them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ExpertRouting:
    """One MoE layer's (token, expert) pairs of a batch, sorted by expert."""
    pair_tokens: torch.Tensor    # [P] int64: the token of each pair
    pair_experts: torch.Tensor   # [P] int64: its expert (non-decreasing)
    pair_weights: torch.Tensor   # [P] float32: its router weight
    expert_indptr: torch.Tensor  # [E + 1] int64: pairs [indptr[e], indptr[e + 1]) are expert e's
    token_pairs: torch.Tensor    # [T * k] int64: at t * k + j, the pair of token t's j-th expert (by rank)
    # BLOCK_M -> the grouped GEMM's layout of these pairs (punica.ops.moe_triton.block_layout)
    layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_pairs(self) -> int:
        return self.pair_tokens.numel()
