"""A PEFT adapter's LoRAs on a mixture-of-experts layer's fused experts (punica.lora.adapter reads
the rest of the adapter).

transformers 5 stores a layer's experts as fused parameters (mlp.experts.gate_up_proj [E, 2I, H],
down_proj [E, H, I]); PEFT adapts them with `target_parameters`, one LoRA per expert of the
adapter's rank: lora_A [E * rank, h_in] holds expert e's A in rows e*rank .. (e+1)*rank, lora_B
[h_out, E * rank] expert e's B in columns e, e + E, e + 2E, ... (PEFT's ParamWrapper). Both
parameters of one layer nest (`experts.base_layer.lora_A` and `experts.lora_A`); which is which
follows from their shapes, which differ for every model. Read, each expert's pair is

    A [E, rank, h_in], B [E, h_out, rank]     delta_y of a token routed to expert e = scale * (x @ A[e].T) @ B[e].T
"""

from __future__ import annotations

import re
from typing import Any

import torch

from punica.config import ModelConfig
from punica.lora.adapter_checks import check_shape, finite
from punica.lora.adapter_config import Fail
from punica.lora.gains import MAX_LORA_GAIN, first_gain_over_limit, gain_bounds

# the wrappers of gate_up_proj and down_proj nest, so one of them is under `.base_layer`
EXPERT_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts((?:\.base_layer)*)\."
    r"lora_([AB])(?:\.[^.]+)?\.weight$")
PER_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")

ExpertNames = dict[tuple[str, int], dict[str, str]]  # ("gate_up" or "down", layer) -> {"A": name, "B": name}
ExpertPairs = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]  # the same keys -> (A, B)


def expert_tensors(shapes: dict[str, tuple[tuple[int, ...], Any]], cfg: dict[str, Any], config: ModelConfig,
                   rank: int, fail: Fail) -> ExpertNames:
    """("gate_up" or "down", layer) -> {"A": name, "B": name} of the adapter's tensors on MoE layers'
    fused experts (EXPERT_TENSOR), each tensor's dtype and shape checked; target_parameters other
    than the experts' and per-expert modules refused by name. No tensor read."""
    targets = cfg.get("target_parameters") or []
    for target in targets:
        # PEFT matches a parameter by its name's suffix, and makes the bare names of target_modules that
        # name an expert parameter ("down_proj") target_parameters
        parts = target.split(".") if isinstance(target, str) else [""]
        if parts[-1] not in ("gate_up_proj", "down_proj") or (len(parts) > 1 and parts[-2] != "experts"):
            raise fail(f"target_parameters names {target!r}; punica adapts only the MoE experts' gate_up_proj "
                       "and down_proj")
    h, inter, num_experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    # (A, B) shapes of each expert parameter: they differ (gate_up's outputs 2I, down's inputs I)
    expected = {"gate_up": ((num_experts * rank, h), (2 * inter, num_experts * rank)),
                "down": ((num_experts * rank, inter), (h, num_experts * rank))}
    found: ExpertNames = {}
    by_wrapper: dict[tuple[int, str], dict[str, str]] = {}
    for key in shapes:
        if PER_EXPERT_TENSOR.search(key):
            raise fail(f"tensor {key} adapts one expert's module; punica serves LoRA on the fused experts "
                       "(PEFT's target_parameters mlp.experts.gate_up_proj and down_proj)")
        match = EXPERT_TENSOR.match(key)
        if match is None:
            continue
        layer = int(match[1])
        if layer >= config.num_layers or not config.is_moe(layer):
            raise fail(f"tensor {key} adapts experts, but layer {layer} of the base model has none")
        by_wrapper.setdefault((layer, match[2]), {})[match[3]] = key
    for (layer, _), sides in by_wrapper.items():
        if set(sides) != {"A", "B"}:
            raise fail(f"tensor {next(iter(sides.values()))} has no lora_{'B' if 'A' in sides else 'A'} beside it")
        got = tuple(shapes[sides[side]][0] for side in ("A", "B"))
        param = next((p for p, shape in expected.items() if got == shape), None)
        if param is None:
            raise fail(f"tensors {sides['A']} and {sides['B']} have shapes {got[0]} and {got[1]}; the experts of "
                       f"a rank-{rank} adapter need {expected['gate_up']} (gate_up_proj) or {expected['down']} "
                       "(down_proj)")
        if (param, layer) in found:
            raise fail(f"layer {layer} has two LoRAs of the experts' {param}_proj ({sides['A']})")
        for side in ("A", "B"):
            check_shape(sides[side], *shapes[sides[side]], got[side == "B"], None, f"experts' {param}", fail)
        found[param, layer] = sides
    for target in targets:
        param = target.rsplit(".", 1)[-1].removesuffix("_proj")
        if not any(p == param for p, _ in found):
            raise fail(f"target_parameters names {target} but the weights have no tensors for it")
    return found


def read_experts(names: ExpertNames, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                 scale: float, dtype: torch.dtype, fail: Fail) -> ExpertPairs:
    """(param, layer) -> (A [E, rank, h_in], B [E, h_out, rank]) in `dtype` of the tensors `expert_tensors`
    named, each expert's delta finite and its gain within MAX_LORA_GAIN."""
    experts: ExpertPairs = {}
    for (param, layer), sides in names.items():
        num_experts, a, b = config.num_experts, tensors[sides["A"]], tensors[sides["B"]]
        a = a.to(dtype).view(num_experts, rank, a.shape[-1])  # rows e*rank .. (e+1)*rank
        # columns e, e + E, ...: each row's [rank, E] block transposed and converted in one copy (a
        # block at a time stays in cache), handed on as the [E, h_out, rank] view that pool.pack copies
        rows_by_expert = torch.empty(b.shape[0], num_experts, rank, dtype=dtype)
        rows_by_expert.copy_(b.view(b.shape[0], rank, num_experts).transpose(1, 2))
        b = rows_by_expert.transpose(0, 1)
        # the gain screen's norms are the finiteness check: only a non-finite bound (a NaN or inf
        # weight, or an overflow) needs a look at the values
        bound = gain_bounds(a, b, scale)
        if not bool(bound.isfinite().all()):
            finite(sides["A"], a, fail)
            finite(sides["B"], b, fail)
        over = first_gain_over_limit(a, b, scale, bound)
        if over is not None:
            expert, gain = over
            raise fail(f"layer {layer} expert {expert} {param} projection ({sides['A']}, {sides['B']}): the delta's "
                       f"gain |scale| * ||B @ A||_2 is {gain:.3g}, over the limit of {MAX_LORA_GAIN:g}")
        experts[param, layer] = (a, b)
    return experts
