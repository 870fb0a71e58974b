"""GPU adapter pool: preallocated slot buffers in the canonical layout of punica.ops.lora.

    a[projection]: [num_layers, max_loras, max_rank, h_in]
    b[projection]: [num_layers, max_loras, h_out, max_rank]
    scales:        [max_loras] float32

Indexing a layer gives the [S, R, h] tensors the operators take, without a copy. An adapter's
rows beyond its rank, and projections it does not target, are zero in its slot.
"""

from __future__ import annotations

import torch

from punica.config import ModelConfig
from punica.lora.adapter import PROJECTIONS, LoraAdapter


class LoraPool:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str):
        if max_loras <= 0 or max_rank <= 0:
            raise ValueError(f"max_loras and max_rank must be positive, got {max_loras} and {max_rank}")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        shapes = config.projection_shapes()
        kw = {"dtype": dtype, "device": device}
        self.a = {p: torch.zeros(config.num_layers, max_loras, max_rank, shapes[p][0], **kw) for p in PROJECTIONS}
        self.b = {p: torch.zeros(config.num_layers, max_loras, shapes[p][1], max_rank, **kw) for p in PROJECTIONS}
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)

    def weights(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a[projection][layer], self.b[projection][layer]

    def write(self, slot: int, adapter: LoraAdapter, non_blocking: bool = False) -> None:
        """Copy an adapter into a slot (zeroing what it does not cover)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside the pool of {self.max_loras}")
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over the pool's "
                             f"max_lora_rank {self.max_rank}")
        r = adapter.rank
        for p in PROJECTIONS:
            a, b = self.a[p][:, slot], self.b[p][:, slot]
            if p in adapter.lora_a:
                a[:, r:].zero_()
                b[:, :, r:].zero_()
                a[:, :r].copy_(adapter.lora_a[p], non_blocking=non_blocking)
                b[:, :, :r].copy_(adapter.lora_b[p], non_blocking=non_blocking)
            else:
                a.zero_()
                b.zero_()
        self.scales[slot] = adapter.scale
