"""Rotary position embedding tables: each rope's inverse frequencies, and cos / sin of positions."""

from __future__ import annotations

import math

import torch

from punica.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        return torch.where(wavelen > low_wavelen, inv_freq / rope.factor,
                           torch.where(wavelen < high_wavelen, inv_freq, smoothed))
    return inv_freq


class Rotary:
    """One rope of a model (the layers that use it share it): cos, sin of positions under it.
    Its inverse frequencies are made on first use on the positions' device, so a model built on the
    meta device has nothing of it to fill in."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.rope, self.head_dim = rope, head_dim
        self._inv_freq: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int  ->  cos, sin [T, head_dim / 2] float32."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.rope, self.head_dim).to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return freqs.cos(), freqs.sin()
