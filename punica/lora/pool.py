"""GPU adapter pool: preallocated slots in the canonical layout of punica.ops.lora.

Each slot is one contiguous run of `buffer` [max_loras, slot_numel], so loading an adapter is
a single host-to-device copy of its packed form (`pack`). The per-projection views index it as

    a[projection]: [num_layers, max_loras, max_rank, h_in]   (slot stride: slot_numel)
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
        self.max_loras, self.max_rank = max_loras, max_rank
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.allocate(config, dtype, torch.device(device))

    def allocate(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Fresh zeroed slots laid out for `config`'s projection shapes."""
        self.config = config
        L, R = config.num_layers, self.max_rank
        shapes = config.projection_shapes()
        self.slot_numel = sum(L * R * (h_in + h_out) for h_in, h_out in shapes.values())
        self.buffer = torch.zeros(self.max_loras, self.slot_numel, dtype=dtype, device=device)
        self.a, self.b = self._views(self.buffer)

    def _views(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-projection [L, S, R, h_in] and [L, S, h_out, R] views of flat [S, slot_numel]."""
        L, R, S = self.config.num_layers, self.max_rank, flat.shape[0]
        a, b, offset = {}, {}, 0
        for p, (h_in, h_out) in self.config.projection_shapes().items():
            a[p] = flat[:, offset:offset + L * R * h_in].view(S, L, R, h_in).transpose(0, 1)
            offset += L * R * h_in
            b[p] = flat[:, offset:offset + L * h_out * R].view(S, L, h_out, R).transpose(0, 1)
            offset += L * h_out * R
        return a, b

    def weights(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a[projection][layer], self.b[projection][layer]

    def pack(self, adapter: LoraAdapter, pin_memory: bool = False) -> torch.Tensor:
        """The adapter as one slot's contents [slot_numel] in host memory (zero-padded to max_rank)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over the pool's "
                             f"max_lora_rank {self.max_rank}")
        packed = torch.zeros(1, self.slot_numel, dtype=self.buffer.dtype, pin_memory=pin_memory)
        a, b = self._views(packed)
        r = adapter.rank
        for p in adapter.lora_a:
            a[p][:, 0, :r].copy_(adapter.lora_a[p])
            b[p][:, 0, :, :r].copy_(adapter.lora_b[p])
        return packed[0]

    def write_packed(self, slot: int, packed: torch.Tensor, scale: float, non_blocking: bool = False) -> None:
        """Copy a packed adapter into a slot: one copy (asynchronous from pinned memory if asked)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside the pool of {self.max_loras}")
        self.buffer[slot].copy_(packed, non_blocking=non_blocking)
        self.scales[slot] = scale

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot (zeroing what it does not cover)."""
        self.write_packed(slot, self.pack(adapter), adapter.scale)
