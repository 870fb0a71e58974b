"""LoraExperts: a mixture-of-experts layer's experts plus each token's adapter delta on them.

The experts (punica.models.moe.Experts: `gate_up_weight()` [E, 2I, H], `down_weight()` [E, H, I])
run over the batch's (token, expert) pairs, sorted by expert (punica.ops.moe): one grouped GEMM
per projection, SwiGLU between them, and each token's outputs summed by its router weights.
Each pair adds its token's adapter delta (slot and lora_scale from the step's LoraBatch) to both
expert projections' outputs, by (slot, expert) (punica.ops.lora_moe). Its weights are the layer's
part of the adapter pool (punica.lora.pool.ExpertWeights), set by punica.lora.layers.attach_pool;
without them, and in steps where no token has an adapter, it is its experts alone. Under tensor
parallelism (punica.parallel.tensor_parallel) each rank holds every expert's slice of the
intermediate dimension, and the weighted sum is all-reduced (`tp_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from punica.lora.batch import LoraBatch
from punica.lora.pool import ExpertWeights
from punica.ops.layers import silu_and_mul
from punica.ops.lora_moe import add_expert_lora
from punica.ops.moe import combine, grouped_matmul
from punica.ops.moe_routing import ExpertRouting


class LoraExperts(nn.Module):
    """The experts `base` of layer `layer`, with the LoRA deltas of their projections."""

    def __init__(self, base: nn.Module, layer: int):
        super().__init__()
        self.base, self.layer = base, layer
        self.weights: ExpertWeights | None = None
        # split over the experts' intermediate dimension under tensor parallelism: the ranks whose
        # partial outputs are summed
        self.tp_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, routing: ExpertRouting, lora: LoraBatch) -> torch.Tensor:
        """x: [T, H]  ->  [T, H]: each token's experts' outputs, each with the token's LoRA deltas,
        times their router weights, summed."""
        rows = x[routing.pair_tokens]
        gate_up = grouped_matmul(rows, self.base.gate_up_weight(), routing)
        w = self.weights if lora.any_lora else None
        if w is not None:
            add_expert_lora(gate_up, rows, w.gate_up_a, w.gate_up_b, routing.pair_tokens, routing.pair_experts,
                            lora.token_slots, lora.token_scales, w.scales)
        hidden = silu_and_mul(gate_up)
        down = grouped_matmul(hidden, self.base.down_weight(), routing)
        if w is not None:
            add_expert_lora(down, hidden, w.down_a, w.down_b, routing.pair_tokens, routing.pair_experts,
                            lora.token_slots, lora.token_scales, w.scales)
        out = combine(down, routing, x.shape[0])
        if self.tp_group is not None:
            dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return f"layer={self.layer}"
