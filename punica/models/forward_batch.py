"""ForwardBatch: everything one forward pass reads besides the token ids and the weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from punica.lora.batch import LoraBatch
from punica.models.rotary import Rotary
from punica.ops.attention import AttnBatch
from punica.ops.kv_cache import KVCache


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """Built once per step (punica.engine: the eager runner from a StepInput, a CUDA graph from its
    bucket's static buffers, which its tensors then are) and handed as it is to every layer."""
    attn: AttnBatch  # positions, KV slots, page tables, lengths, the rows that get logits
    lora: LoraBatch  # each token's adapter slot and lora_scale, the SGMV segments
    kv: KVCache      # every layer's pages (and an fp8 cache's scales)
    # cos, sin of attn.positions per rope, made by the first layer that asks (`rope`)
    _rope: dict[Rotary, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False, repr=False)

    def rope(self, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim / 2] float32 of the batch's positions under `rotary`: computed once
        per batch, whatever the number of layers that use that rope."""
        if rotary not in self._rope:
            self._rope[rotary] = rotary(self.attn.positions)
        return self._rope[rotary]
