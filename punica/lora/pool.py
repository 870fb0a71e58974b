"""GPU adapter pool: preallocated slots in the canonical layout of punica.ops.lora.

Each slot is one contiguous run of `buffer` [max_loras, slot_numel], so loading an adapter is
a single host-to-device copy of its packed form (`pack`). Projections that share an input form
a group (GROUPS: q/k/v, o, gate/up, down), stored so that one shrink and one sliced expand
serve the whole group (punica.ops.lora.add_lora with slice_bounds):

    group_a[group]: [num_layers, max_loras, n*max_rank, h_in]   A of the n projections stacked
                                                                 along the ranks (slot stride:
                                                                 slot_numel)
    group_b[group]: [num_layers, max_loras, sum h_out, max_rank] B stacked along the outputs
    a[projection]:  [num_layers, max_loras, max_rank, h_in]     views into group_a / group_b,
    b[projection]:  [num_layers, max_loras, h_out, max_rank]     for code that reads or writes
                                                                 one projection
    scales:         [max_loras] float32
    group_m[group]: [num_layers, max_loras, sum h_out]          DoRA magnitudes m as packed (NaN
                                                                 where the adapter has none)
    out_scales[group]: [num_layers, max_loras, sum h_out] fp32  DoRA: m / ||W + scale * B @ A||
                                                                 per output feature, 1 where no m
    dora_slots:     [max_loras] int32                           1 where the slot holds a DoRA adapter

    expert_a[param]: [num_moe_layers, max_loras, E, max_rank, h_in]   a MoE layer's experts'
    expert_b[param]: [num_moe_layers, max_loras, E, h_out, max_rank]  LoRA, param "gate_up" (h_in H,
                                                                 h_out 2I) or "down" (I -> H), in
                                                                 the order of config.moe_layers

The expand multiplies a DoRA slot's tokens' projection outputs by its out_scales row
(punica.ops.lora). Its norms need the base weights, so they are computed in `write_packed`,
on the device that holds both, in float32, from `base_weight(layer, group)` [sum h_out, h_in]
(the model's fused projection weight, set by the worker that owns both).

Indexing a layer gives the [S, R, h] tensors the operators take, without a copy;
`group_weights(layer, group)` gathers those of one layer's group with the scales and DoRA's
tensors, what that group's punica.lora.layers.LoraLinear reads. An adapter's
rows beyond its rank, and projections it does not target, are zero in its slot, so a group's
fused delta is exact for adapters that target only some of its projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from punica.config import ModelConfig
from punica.lora.adapter import AdapterWeights, LoraAdapter

# groups of projections that share their input, in the column order of the model's fused GEMMs
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
NORM_ROWS = 4096  # rows of W + scale * B @ A formed at once (float32) while computing DoRA's norms


def expert_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(h_in, h_out) of a MoE layer's expert parameters as the pool stores their LoRA."""
    return {"gate_up": (config.hidden_size, 2 * config.moe_intermediate_size),
            "down": (config.moe_intermediate_size, config.hidden_size)}


def slot_parts(config: ModelConfig, max_rank: int) -> tuple[int, int, int]:
    """Elements of one slot: the projections' A and B, DoRA's magnitudes, the experts' A and B."""
    L, R = config.num_layers, max_rank
    shapes = config.projection_shapes()
    lora = sum(L * R * (h_in + h_out) for h_in, h_out in shapes.values())
    magnitudes = L * sum(h_out for _, h_out in shapes.values())
    experts = len(config.moe_layers) * config.num_experts * R * sum(
        h_in + h_out for h_in, h_out in expert_shapes(config).values())
    return lora, magnitudes, experts


def slot_bytes(config: ModelConfig, max_rank: int, dtype: torch.dtype) -> int:
    """Device bytes of one slot of a pool of `dtype` (its float32 scale and DoRA out_scales included)."""
    lora, magnitudes, experts = slot_parts(config, max_rank)
    return (lora + magnitudes + experts) * dtype.itemsize + (1 + magnitudes) * 4 + 4


def pool_slots(config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
               max_bytes: int | None) -> int:
    """Slots of a pool: `max_loras`, or fewer where `max_bytes` holds fewer; an error where it holds none."""
    if max_bytes is None:
        return max_loras
    one = slot_bytes(config, max_rank, dtype)
    if max_bytes < one:
        raise ValueError(f"max_lora_bytes {max_bytes} does not hold one adapter slot: a slot of rank {max_rank} "
                         f"takes {one} bytes on this model")
    return min(max_loras, max_bytes // one)


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """What one MoE layer's experts read of the pool (punica.lora.experts.LoraExperts): views of the
    pool's tensors, S = max_loras slots of E experts, max_rank R."""
    gate_up_a: torch.Tensor  # [S, E, R, H]
    gate_up_b: torch.Tensor  # [S, E, 2I, R]
    down_a: torch.Tensor     # [S, E, R, I]
    down_b: torch.Tensor     # [S, E, H, R]
    scales: torch.Tensor     # [S] float32


@dataclass(frozen=True, eq=False)
class GroupWeights:
    """What one layer's projection group reads of the pool (punica.lora.layers.LoraLinear): views
    of the pool's tensors, S = max_loras slots, n projections of max_rank R each."""
    lora_a: torch.Tensor              # [S, n*R, h_in]
    lora_b: torch.Tensor              # [S, sum h_out, R]
    slice_bounds: tuple[int, ...]     # where each projection's output columns start, and the end
    scales: torch.Tensor              # [S] float32
    out_scales: torch.Tensor          # [S, sum h_out] float32, DoRA's (1 where the slot has none)
    dora_slots: torch.Tensor          # [S] int32, 1 where the slot holds a DoRA adapter


class LoraPool:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str):
        if max_loras <= 0 or max_rank <= 0:
            raise ValueError(f"max_loras and max_rank must be positive, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.dora_slots = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.base_weight: Callable[[int, str], torch.Tensor] | None = None
        self.allocate(config, dtype, torch.device(device))

    def allocate(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Fresh zeroed slots laid out for `config`'s projection shapes (views taken before, such as
        `group_weights`, keep the old tensors: attach the pool to a model after this)."""
        self.config = config
        self.lora_numel, magnitude_numel, self.expert_numel = slot_parts(config, self.max_rank)
        self.expert_shapes = expert_shapes(config)
        self.slot_numel = self.lora_numel + magnitude_numel + self.expert_numel
        self.buffer = torch.zeros(self.max_loras, self.slot_numel, dtype=dtype, device=device)
        self.expert_a, self.expert_b = self._expert_views(self.buffer)
        self.group_a, self.group_b = self._group_views(self.buffer)
        self.group_m = self._magnitude_views(self.buffer[:, self.lora_numel:self.slot_numel - self.expert_numel])
        self.a, self.b = self._projection_views(self.group_a, self.group_b)
        self.out_scales = self._magnitude_views(
            torch.ones(self.max_loras, magnitude_numel, dtype=torch.float32, device=device))
        self.slice_bounds = {g: self._slice_bounds(g) for g in GROUPS}

    def _slice_bounds(self, group: str) -> tuple[int, ...]:
        """Where each projection's output columns start in the group's stacked B, and the end."""
        bounds = [0]
        for p in GROUPS[group]:
            bounds.append(bounds[-1] + self.config.projection_shapes()[p][1])
        return tuple(bounds)

    def _group_views(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-group [L, S, n*R, h_in] and [L, S, sum h_out, R] views of flat [S, slot_numel]."""
        L, R, S = self.config.num_layers, self.max_rank, flat.shape[0]
        shapes = self.config.projection_shapes()
        a, b, offset = {}, {}, 0
        for group, projections in GROUPS.items():
            h_in = shapes[projections[0]][0]
            assert all(shapes[p][0] == h_in for p in projections), (group, shapes)
            rows, h_out = len(projections) * R, sum(shapes[p][1] for p in projections)
            a[group] = flat[:, offset:offset + L * rows * h_in].view(S, L, rows, h_in).transpose(0, 1)
            offset += L * rows * h_in
            b[group] = flat[:, offset:offset + L * h_out * R].view(S, L, h_out, R).transpose(0, 1)
            offset += L * h_out * R
        assert offset == self.lora_numel, (offset, flat.shape)
        return a, b

    def _expert_views(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per expert parameter [num_moe_layers, S, E, R, h_in] and [num_moe_layers, S, E, h_out, R] views
        of the expert part (the end) of flat [S, slot_numel]."""
        M, E, R, S = len(self.config.moe_layers), self.config.num_experts, self.max_rank, flat.shape[0]
        a, b, offset = {}, {}, self.slot_numel - self.expert_numel
        for param, (h_in, h_out) in self.expert_shapes.items():
            a[param] = flat[:, offset:offset + M * E * R * h_in].view(S, M, E, R, h_in).transpose(0, 1)
            offset += M * E * R * h_in
            b[param] = flat[:, offset:offset + M * E * h_out * R].view(S, M, E, h_out, R).transpose(0, 1)
            offset += M * E * h_out * R
        assert offset == self.slot_numel, (offset, flat.shape)
        return a, b

    def expert_weights(self, layer: int) -> ExpertWeights:
        """MoE layer `layer`'s experts of every slot, as views that later writes to the pool show through."""
        i = self.config.moe_layers.index(layer)
        return ExpertWeights(gate_up_a=self.expert_a["gate_up"][i], gate_up_b=self.expert_b["gate_up"][i],
                             down_a=self.expert_a["down"][i], down_b=self.expert_b["down"][i], scales=self.scales)

    def _magnitude_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-group [L, S, sum h_out] views of flat [S, L * sum of every h_out]."""
        L, S, shapes = self.config.num_layers, flat.shape[0], self.config.projection_shapes()
        views, offset = {}, 0
        for group, projections in GROUPS.items():
            h_out = sum(shapes[p][1] for p in projections)
            views[group] = flat[:, offset:offset + L * h_out].view(S, L, h_out).transpose(0, 1)
            offset += L * h_out
        assert offset == flat.shape[1], (offset, flat.shape)
        return views

    def _projection_views(self, group_a: dict[str, torch.Tensor], group_b: dict[str, torch.Tensor]
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per-projection [L, S, R, h_in] and [L, S, h_out, R] views of the group views."""
        R, shapes = self.max_rank, self.config.projection_shapes()
        a, b = {}, {}
        for group, projections in GROUPS.items():
            col = 0
            for i, p in enumerate(projections):
                h_out = shapes[p][1]
                a[p] = group_a[group][:, :, i * R:(i + 1) * R]
                b[p] = group_b[group][:, :, col:col + h_out]
                col += h_out
        return a, b

    def group_weights(self, layer: int, group: str) -> GroupWeights:
        """One layer's group of every slot, as views that later writes to the pool show through."""
        return GroupWeights(lora_a=self.group_a[group][layer], lora_b=self.group_b[group][layer],
                            slice_bounds=self.slice_bounds[group], scales=self.scales,
                            out_scales=self.out_scales[group][layer], dora_slots=self.dora_slots)

    @property
    def packed_shape(self) -> tuple[int, ...]:
        """The shape of a packed adapter (`pack`)."""
        return (self.slot_numel,)

    def pack(self, adapter: LoraAdapter | AdapterWeights, out: torch.Tensor | None = None) -> torch.Tensor:
        """The adapter as one slot's contents [slot_numel] in host memory (zero-padded to
        max_rank), written into `out` if given (else a new tensor)."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, over the pool's "
                             f"max_lora_rank {self.max_rank}")
        r = adapter.rank
        if out is None:
            out = torch.empty(self.slot_numel, dtype=self.buffer.dtype)
        assert out.shape == self.packed_shape and out.dtype == self.buffer.dtype, (out.shape, out.dtype)
        packed = out.view(1, self.slot_numel)
        a, b = self._projection_views(*self._group_views(packed))
        magnitudes = self._magnitude_views(packed[:, self.lora_numel:self.slot_numel - self.expert_numel])
        expert_a, expert_b = self._expert_views(packed)
        for param in expert_a:  # each element written once: the adapter's, else zero
            for i, layer in enumerate(self.config.moe_layers):
                pair = adapter.experts.get((param, layer))
                if pair is None:
                    expert_a[param][i, 0].zero_()
                    expert_b[param][i, 0].zero_()
                    continue
                expert_a[param][i, 0, :, :r].copy_(pair[0])
                expert_b[param][i, 0, :, :, :r].copy_(pair[1])
                if r < self.max_rank:
                    expert_a[param][i, 0, :, r:].zero_()
                    expert_b[param][i, 0, :, :, r:].zero_()
        for m in magnitudes.values():  # NaN: no magnitude (out_scales 1); a plain adapter's are never read
            m.fill_(float("nan") if adapter.dora else 0.0)
        columns = {p: (group, sum(self.config.projection_shapes()[q][1] for q in GROUPS[group][:i]))
                   for group, projections in GROUPS.items() for i, p in enumerate(projections)}
        for p, layer, m in adapter.magnitudes():
            group, col = columns[p]
            magnitudes[group][layer, 0, col:col + m.shape[0]].copy_(m)
        num_layers = self.config.num_layers
        written: dict[str, set[int]] = {p: set() for p in a}
        for p, layer, lora_a, lora_b in adapter.tensors():
            a[p][layer, 0, :r].copy_(lora_a)
            b[p][layer, 0, :, :r].copy_(lora_b)
            written[p].add(layer)
        for p, layers in written.items():  # zeros where the adapter has nothing
            if r < self.max_rank:
                a[p][:, 0, r:].zero_()
                b[p][:, 0, :, r:].zero_()
            missing = [layer for layer in range(num_layers) if layer not in layers]
            if missing:
                a[p][missing, 0] = 0
                b[p][missing, 0] = 0
        return packed[0]

    def write_packed(self, slot: int, packed: torch.Tensor, scale: float, non_blocking: bool = False,
                     dora: bool = False) -> None:
        """Copy a packed adapter into a slot: one copy (asynchronous from pinned memory if asked); with
        `dora`, its out_scales are then computed from the copied weights on the pool's device."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside the pool of {self.max_loras}")
        self.buffer[slot].copy_(packed, non_blocking=non_blocking)
        self.scales[slot] = scale
        if dora:
            self._compute_out_scales(slot, scale)
        self.dora_slots[slot] = int(dora)

    def _compute_out_scales(self, slot: int, scale: float) -> None:
        """out_scales of a slot: m / ||W + scale * B @ A|| per output row (PEFT's DoRA weight norm),
        in float32 from the base weights, NORM_ROWS rows at a time; 1 where the adapter has no m."""
        if self.base_weight is None:
            raise RuntimeError("this adapter pool has no base weights (base_weight), which DoRA's norms need")
        R = self.max_rank
        for layer in range(self.config.num_layers):
            for group in GROUPS:
                w, bounds = self.base_weight(layer, group), self.slice_bounds[group]
                a, b = self.group_a[group][layer, slot], self.group_b[group][layer, slot]
                m, out = self.group_m[group][layer, slot], self.out_scales[group][layer, slot]
                for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                    a_i = a[i * R:(i + 1) * R].float()
                    for start in range(lo, hi, NORM_ROWS):
                        rows = slice(start, min(start + NORM_ROWS, hi))
                        norm = torch.linalg.vector_norm(torch.addmm(w[rows].float(), b[rows].float(), a_i, alpha=scale),
                                                        dim=1)
                        magnitude = m[rows].float()
                        out[rows] = torch.where(magnitude.isnan(), 1.0, magnitude / norm)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot (zeroing what it does not cover)."""
        self.write_packed(slot, self.pack(adapter), adapter.scale, dora=adapter.dora)
