"""The mixture-of-experts MLP of the MoE families (punica.families: Qwen3-MoE, Mixtral).

A linear router scores the num_experts experts per token; each token goes to its
num_experts_per_tok best (punica.ops.moe.route, the family's renormalisation), each expert a SwiGLU
MLP of moe_intermediate_size, and the token's output is its experts' outputs weighted by their
router weights. The experts' weights are stored as transformers 5 fuses them, flattened to two
dimensions (the loader fills them row by row from either checkpoint layout):

    experts.gate_up_proj [E * 2I, H]   expert e's rows e*2I .. e*2I + I: gate, then I rows of up
    experts.down_proj    [E * H, I]    expert e's rows e*H .. (e+1)*H

The experts are a LoraExperts (punica.lora.experts), which adds each token's adapter delta to
every expert projection the token passes through; the model picks no LoRA kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from punica.config import ModelConfig
from punica.lora.experts import LoraExperts
from punica.models.forward_batch import ForwardBatch
from punica.models.quantized import Linear
from punica.ops.moe import route


class Experts(nn.Module):
    """num_experts SwiGLU MLPs of one layer; their weights as 3-D views ([E, 2I, H], [E, H, I])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, **factory):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size, **factory),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size, **factory),
                                      requires_grad=False)

    def gate_up_weight(self) -> torch.Tensor:
        return self.gate_up_proj.view(self.num_experts, 2 * self.intermediate_size, self.hidden_size)

    def down_weight(self) -> torch.Tensor:
        return self.down_proj.view(self.num_experts, self.hidden_size, self.intermediate_size)


class MoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, **factory):
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.router = Linear(config.hidden_size, config.num_experts, bias=False, **factory)
        self.experts = LoraExperts(Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                           **factory), layer)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h: [T, hidden] normed  ->  [T, hidden], each token's experts' outputs weighted by the router."""
        routing = route(self.router(h), self.top_k, self.renormalize)
        return self.experts(h, routing, batch.lora)
