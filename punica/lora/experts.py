"""LoraExperts: a mixture-of-experts layer's experts plus each token's adapter delta on them.

The experts (punica.models.moe.Experts: `gate_up_weight()` [E, 2I, H], `down_weight()` [E, H, I])
run over the batch's (token, expert) pairs, sorted by expert (punica.ops.moe): one grouped GEMM
per projection, SwiGLU between them, and each token's outputs summed by its router weights.
"""

from __future__ import annotations

import torch
from torch import nn

from punica.lora.batch import LoraBatch
from punica.ops.layers import silu_and_mul
from punica.ops.moe import ExpertRouting, combine, grouped_matmul


class LoraExperts(nn.Module):
    """The experts `base` of layer `layer`, with the LoRA deltas of their projections."""

    def __init__(self, base: nn.Module, layer: int):
        super().__init__()
        self.base, self.layer = base, layer

    def forward(self, x: torch.Tensor, routing: ExpertRouting, lora: LoraBatch) -> torch.Tensor:
        """x: [T, H]  ->  [T, H]: each token's experts' outputs times their router weights, summed."""
        rows = x[routing.pair_tokens]
        gate_up = grouped_matmul(rows, self.base.gate_up_weight(), routing)
        down = grouped_matmul(silu_and_mul(gate_up), self.base.down_weight(), routing)
        return combine(down, routing, x.shape[0])

    def extra_repr(self) -> str:
        return f"layer={self.layer}"
