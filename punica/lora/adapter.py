"""Load a PEFT LoRA adapter directory into the canonical layout of punica.ops.lora.

    lora_a[proj] : [num_layers, rank, h_in]    (PEFT's lora_A.weight of every layer, stacked)
    lora_b[proj] : [num_layers, h_out, rank]   (PEFT's lora_B.weight)
    delta_y      = scale * (x @ lora_a[proj][layer].T) @ lora_b[proj][layer].T

    magnitude[proj]: [num_layers, h_out]       (DoRA, `use_dora`: PEFT's lora_magnitude_vector)

DoRA's projection output is (m / ||W + scale * B @ A||) * (x @ W.T + delta_y), the norm of each
output feature's row (PEFT's DoraLinearLayer); the norms need the base weight W, so the pool
computes them where W lives, when the adapter is copied into its slot (punica.lora.pool).

    experts[(proj, layer)] = (A [E, rank, h_in], B [E, h_out, rank])   proj "gate_up" or "down"
    delta_y of a token routed to expert e = scale * (x @ A[e].T) @ B[e].T   (punica.lora.experts)

A mixture-of-experts layer's experts are adapted as PEFT adapts transformers 5's fused expert
parameters (`target_parameters`), read by punica.lora.adapter_experts.

Only targeted projections are keys; layers the adapter does not touch are zeros. Phi-3's fused
modules (qkv_proj, gate_up_proj), in checkpoints and adapters of models with `fused_projections`,
split exactly: one lora_A shared by q, k and v (gate and up), lora_B split by output rows, so
each part is a LoRA of the same rank and scale on its projection. Anything the canonical layout
cannot express exactly is rejected with an AdapterError (punica.lora.adapter_config, which reads
and checks adapter_config.json), never dropped; so is an adapter that could overflow the
activations of its requests (a non-finite value, a scale over MAX_LORA_SCALE, a layer's delta
with a gain over punica.lora.gains.MAX_LORA_GAIN, a DoRA magnitude over it).
What can be refused from adapter_config.json and the safetensors header is refused before any
tensor is read (punica.lora.adapter_files, which also keeps the reads inside --adapter-dir).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from punica.config import ModelConfig
from punica.lora.adapter_checks import check_shape, finite
from punica.lora.adapter_config import Fail, adapter_fail, check_config, read_config
from punica.lora.adapter_experts import expert_tensors, read_experts
from punica.lora.adapter_files import WeightsFile, confining_dirs
from punica.lora.gains import MAX_LORA_GAIN, lora_gain

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")

# PEFT module path inside one decoder layer -> projection
MODULES = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
    "self_attn.o_proj": "o", "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
}
# fused modules (Phi-3) -> the projections whose outputs they stack, in order
FUSED_MODULES = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
SUFFIXES = {module.split(".")[1]: proj for module, proj in MODULES.items()}  # "q_proj" -> "q"
FUSED_SUFFIXES = {module.split(".")[1]: parts for module, parts in FUSED_MODULES.items()}
FUSED_NAMES = {module: module.split(".")[1].removesuffix("_proj") for module in FUSED_MODULES}  # -> "qkv"
FUSED_PROJECTIONS = {FUSED_NAMES[module]: parts for module, parts in FUSED_MODULES.items()}
# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.adapter_name].weight, and DoRA's
# ....q_proj.lora_magnitude_vector[.adapter_name][.weight]
TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(\w+\.\w+)\."
    r"(?:lora_([AB])(?:\.[^.]+)?\.weight|lora_(magnitude)_vector(?:\.[^.]+)?(?:\.weight)?)$"
)
@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scale: float                       # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    lora_a: dict[str, torch.Tensor]    # projection -> [num_layers, rank, h_in]
    lora_b: dict[str, torch.Tensor]    # projection -> [num_layers, h_out, rank]
    # DoRA: projection -> [num_layers, h_out], NaN in layers without it; empty for plain LoRA
    magnitude: dict[str, torch.Tensor] = field(default_factory=dict)
    # MoE layers: ("gate_up" or "down", layer) -> (A [E, rank, h_in], B [E, h_out, rank])
    experts: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self):
        assert self.lora_a.keys() == self.lora_b.keys() <= set(PROJECTIONS)
        assert self.magnitude.keys() <= self.lora_a.keys()
        for proj, a in self.lora_a.items():
            b = self.lora_b[proj]
            assert a.shape[:2] == (b.shape[0], self.rank) and b.shape[2] == self.rank, proj

    @property
    def num_bytes(self) -> int:
        tensors = [*self.lora_a.values(), *self.lora_b.values(), *(t for pair in self.experts.values() for t in pair)]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def dora(self) -> bool:
        return bool(self.magnitude)

    def tensors(self) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
        """(projection, layer, A [rank, h_in], B [h_out, rank]) of every layer of every projection."""
        for proj, a in self.lora_a.items():
            for layer in range(a.shape[0]):
                yield proj, layer, a[layer], self.lora_b[proj][layer]

    def magnitudes(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        """(projection, layer, m [h_out]) of every DoRA projection and layer it has."""
        for proj, m in self.magnitude.items():
            for layer in range(m.shape[0]):
                if not m[layer].isnan().any():
                    yield proj, layer, m[layer]


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter as read and checked (`read_adapter`), one (A, B) pair per projection and layer
    it has: LoraPool.pack copies these straight into a slot; `stacked` makes a LoraAdapter."""
    name: str
    rank: int
    scale: float
    pairs: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # (proj, layer) -> (A, B)
    magnitude: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # DoRA: (proj, layer) -> m
    # MoE layers: ("gate_up" or "down", layer) -> (A [E, rank, h_in], B [E, h_out, rank])
    experts: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def dora(self) -> bool:
        return bool(self.magnitude)

    @property
    def num_bytes(self) -> int:
        """Of its weights: every A, B (of the experts too) and DoRA magnitude."""
        tensors = [t for pairs in (self.pairs, self.experts) for pair in pairs.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in (*tensors, *self.magnitude.values()))

    def tensors(self) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
        for (proj, layer), (a, b) in self.pairs.items():
            yield proj, layer, a, b

    def magnitudes(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        for (proj, layer), m in self.magnitude.items():
            yield proj, layer, m

    def stacked(self, num_layers: int) -> LoraAdapter:
        """[num_layers, ...] tensors per projection, zero for the layers it has no tensors for."""
        lora_a: dict[str, torch.Tensor] = {}
        lora_b: dict[str, torch.Tensor] = {}
        for (proj, layer), (a, b) in self.pairs.items():  # in projection order (read_adapter)
            if proj not in lora_a:  # every layer written: its tensors here, or zeros below
                lora_a[proj] = torch.empty(num_layers, *a.shape, dtype=a.dtype)
                lora_b[proj] = torch.empty(num_layers, *b.shape, dtype=b.dtype)
            lora_a[proj][layer] = a
            lora_b[proj][layer] = b
        for proj in lora_a:
            missing = [layer for layer in range(num_layers) if (proj, layer) not in self.pairs]
            lora_a[proj][missing] = 0
            lora_b[proj][missing] = 0
        magnitude: dict[str, torch.Tensor] = {}
        for (proj, layer), m in self.magnitude.items():
            if proj not in magnitude:
                magnitude[proj] = torch.full((num_layers, m.shape[0]), float("nan"), dtype=m.dtype)
            magnitude[proj][layer] = m
        return LoraAdapter(name=self.name, rank=self.rank, scale=self.scale, lora_a=lora_a, lora_b=lora_b,
                           magnitude=magnitude, experts=dict(self.experts))


def load_adapter(path: str | Path, config: ModelConfig, name: str | None = None,
                 dtype: torch.dtype = torch.float32, adapter_dirs: Iterable[str | Path] = (),
                 max_rank: int | None = None) -> LoraAdapter:
    """Read adapter_config.json and adapter_model.safetensors (or .bin) from a PEFT directory
    (`read_adapter` says what `adapter_dirs` and `max_rank` refuse)."""
    return read_adapter(path, config, name, dtype, adapter_dirs, max_rank).stacked(config.num_layers)


def read_adapter(path: str | Path, config: ModelConfig, name: str | None = None,
                 dtype: torch.dtype = torch.float32, adapter_dirs: Iterable[str | Path] = (),
                 max_rank: int | None = None) -> AdapterWeights:
    """`load_adapter` without the stacking: every check, each layer's tensors in `dtype`. An adapter
    inside one of `adapter_dirs` reads only files inside it (punica.lora.adapter_files). A rank over
    `max_rank` is refused from adapter_config.json, and tensor names, shapes and dtypes from the
    safetensors header, before any tensor is read."""
    path = Path(path)
    fail = adapter_fail(path)
    dirs = confining_dirs(path, adapter_dirs)
    cfg = read_config(path, fail, dirs)
    rank, scale = check_config(cfg, fail)
    if max_rank is not None and rank > max_rank:
        raise fail(f"its rank {rank} is over this engine's max_lora_rank {max_rank} (start it with "
                   f"--max-lora-rank >= {rank})")
    dora = bool(cfg.get("use_dora"))
    if dora and config.moe_layers:
        raise fail(f"DoRA on a mixture-of-experts model ({config.family}) is not supported")
    with WeightsFile(path, dirs, _max_weights_bytes(config, rank), _max_header_bytes(config), fail) as weights:
        shapes = weights.shapes()
        expert_names = expert_tensors(shapes, cfg, config, rank, fail)
        expert_keys = {key for sides in expert_names.values() for key in sides.values()}
        shapes = {k: v for k, v in shapes.items() if k not in expert_keys}
        pairs = _pair_tensors(shapes, config.num_layers, cfg.get("layers_to_transform"), dora, fail)
        layout = _check_layout(pairs, shapes, config, rank, dora, fail)
        tensors = weights.tensors()
    experts = read_experts(expert_names, tensors, config, rank, scale, dtype, fail)
    checked, magnitude = {}, {}
    for proj, layer, parts, bounds, sides in layout:
        a = _converted(sides["A"], tensors[sides["A"]], dtype, fail)
        b = _converted(sides["B"], tensors[sides["B"]], dtype, fail)
        m = _magnitude(sides["magnitude"], tensors[sides["magnitude"]], dtype, fail) if dora else None
        gain = lora_gain(a, b, scale)
        if not gain <= MAX_LORA_GAIN:
            raise fail(f"layer {layer} {proj} projection ({sides['A']}, {sides['B']}): the delta's gain "
                       f"|scale| * ||B @ A||_2 is {gain:.3g}, over the limit of {MAX_LORA_GAIN:g} (weights this "
                       "large would make the activations overflow)")
        for part, lo, hi in zip(parts, bounds, bounds[1:]):
            checked[part, layer] = (a, b[lo:hi] if len(parts) > 1 else b)
            if m is not None:
                magnitude[part, layer] = m[lo:hi]
    if not checked and not experts:
        raise fail("the weights file holds no LoRA tensors")
    targets = cfg.get("target_modules")
    projections = {p for p, _ in checked}
    for target in targets if isinstance(targets, list) else []:
        suffix = target.rsplit(".", 1)[-1]
        for proj in FUSED_SUFFIXES.get(suffix, (SUFFIXES.get(suffix),)):
            if proj is not None and proj not in projections:
                raise fail(f"target_modules names {target} but the weights have no {proj} tensors")
    return AdapterWeights(name=name or path.resolve().name, rank=rank, scale=scale, pairs=checked,
                          magnitude=magnitude, experts=experts)


def _check_layout(pairs: dict[tuple[str, int], dict[str, str]], shapes: dict[str, tuple[tuple[int, ...], Any]],
                  config: ModelConfig, rank: int, dora: bool, fail: Fail
                  ) -> list[tuple[str, int, tuple[str, ...], list[int], dict[str, str]]]:
    """(projection or fused module, layer, the projections it covers, their bounds along B's rows,
    its tensors' names) of every pair, in projection order, each tensor's dtype and shape checked
    against the config's rank and the base model; no tensor read."""
    model_shapes = config.projection_shapes()
    layout, covered = [], set()

    def first_projection(item) -> int:  # in PROJECTIONS order, a fused module at its first part
        return PROJECTIONS.index(FUSED_PROJECTIONS.get(item[0][0], item[0])[0])

    for (proj, layer), sides in sorted(pairs.items(), key=first_projection):
        parts = FUSED_PROJECTIONS.get(proj, (proj,))
        if config.is_moe(layer) and parts[0] in ("gate", "up", "down"):
            raise fail(f"tensor {sides['A']} adapts a dense MLP projection, but layer {layer} of the base model "
                       "is a mixture of experts (adapt its experts with target_parameters)")
        if len(parts) > 1 and not config.fused_projections:
            raise fail(f"tensor {sides['A']} targets the fused {proj}_proj, which a {config.family} model "
                       "does not have")
        h_in = model_shapes[parts[0]][0]
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + model_shapes[part][1])
        check_shape(sides["A"], *shapes[sides["A"]], (rank, h_in), 0, proj, fail)
        check_shape(sides["B"], *shapes[sides["B"]], (bounds[-1], rank), 1, proj, fail)
        if dora and config.qkv_bias and any(part in ("q", "k", "v") for part in parts):
            raise fail(f"DoRA on the biased {proj} projection of a {config.family} model is not supported "
                       f"(tensor {sides['magnitude']}): DoRA scales the projection's output without its bias")
        if dora:
            check_shape(sides["magnitude"], *shapes[sides["magnitude"]], (bounds[-1],), None, proj, fail)
        for part in parts:
            if (part, layer) in covered:
                raise fail(f"layer {layer} has tensors for the {part} projection both fused and on its own")
            covered.add((part, layer))
        layout.append((proj, layer, parts, bounds, sides))
    return layout


def _pair_tensors(shapes: dict[str, Any], num_layers: int, layers_to_transform: int | list[int] | None,
                  dora: bool, fail: Fail) -> dict[tuple[str, int], dict[str, str]]:
    """(projection, layer) -> {"A": name, "B": name} and, with DoRA, "magnitude": name, for the
    tensors named in `shapes`; every name must parse."""
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    pairs: dict[tuple[str, int], dict[str, str]] = {}
    for key in shapes:
        if "lora_embedding_" in key:
            raise fail(f"{'DoRA' if dora else 'LoRA'} on embeddings is not supported (tensor {key})")
        match = TENSOR_NAME.match(key)
        if match is None or match[2] not in MODULES | FUSED_NAMES:
            if "lm_head" in key or "embed_tokens" in key:
                raise fail(f"LoRA on lm_head/embed_tokens is not supported (tensor {key})")
            raise fail(f"unrecognized tensor {key} (punica adapts only q/k/v/o/gate/up/down "
                       "projections of decoder layers)")
        layer, proj, side = int(match[1]), (MODULES | FUSED_NAMES)[match[2]], match[3] or match[4]
        if side == "magnitude" and not dora:
            raise fail(f"tensor {key} is a DoRA magnitude, but adapter_config.json does not set use_dora")
        if layer >= num_layers:
            raise fail(f"tensor {key} is for layer {layer}, but the base model has {num_layers} layers")
        if layers_to_transform is not None and layer not in layers_to_transform:
            raise fail(f"tensor {key} is for layer {layer}, outside layers_to_transform="
                       f"{layers_to_transform}")
        if side in pairs.setdefault((proj, layer), {}):
            raise fail(f"tensors {pairs[proj, layer][side]} and {key} are both lora_{side} "
                       f"of layer {layer} {proj}")
        pairs[proj, layer][side] = key
    for (proj, layer), sides in pairs.items():
        for side in ("A", "B", "magnitude") if dora else ("A", "B"):
            if side not in sides:
                present = next(s for s in ("A", "B", "magnitude") if s in sides)
                raise fail(f"layer {layer} {proj} projection has {_label(present)} ({sides[present]}) but no "
                           f"{_label(side)}")
    return pairs


def _label(side: str) -> str:
    return "lora_magnitude_vector" if side == "magnitude" else f"lora_{side}"


def _max_weights_bytes(config: ModelConfig, rank: int) -> int:
    """The most bytes a weights file of a rank-`rank` adapter of this model can need: A, B and a
    DoRA magnitude for every projection of every layer in float64, 1 kB of names and framing per
    tensor, and 1 MiB more."""
    per_layer = sum(rank * (h_in + h_out) + h_out for h_in, h_out in config.projection_shapes().values())
    experts = len(config.moe_layers) * config.num_experts * rank * (
        2 * config.hidden_size + 3 * config.moe_intermediate_size)
    return 8 * (config.num_layers * per_layer + experts) + 1024 * 3 * len(PROJECTIONS) * config.num_layers + (1 << 20)


def _max_header_bytes(config: ModelConfig) -> int:
    """A safetensors header of every tensor an adapter can have: 512 bytes for each, 64 KiB more."""
    return 512 * (3 * len(PROJECTIONS) * config.num_layers + 4 * len(config.moe_layers)) + (1 << 16)


def _converted(key: str, tensor: torch.Tensor, dtype: torch.dtype, fail: Fail) -> torch.Tensor:
    """The tensor in `dtype`, after checking that its values are finite there."""
    return finite(key, tensor.to(dtype), fail)


def _magnitude(key: str, tensor: torch.Tensor, dtype: torch.dtype, fail: Fail) -> torch.Tensor:
    """A DoRA magnitude in `dtype`: finite, and at most MAX_LORA_GAIN in absolute value. Output
    row i of a DoRA projection is m_i * (w_i . x) / ||w_i|| (w_i the adapted weight's row), at
    most |m_i| * ||x||: m is the projection's gain, bounded as a LoRA delta's is."""
    m = _converted(key, tensor, dtype, fail)
    largest = float(m.abs().max())
    if not largest <= MAX_LORA_GAIN:
        raise fail(f"tensor {key}: a DoRA magnitude of {largest:.3g}, over the limit of {MAX_LORA_GAIN:g} (it "
                   "scales the projection's output, which would overflow the activations)")
    return m
