"""Random PEFT-format LoRA adapters, for tests and benchmarks (like dummy model weights)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from punica.config import ModelConfig
from punica.lora.adapter import MODULES, PROJECTIONS


def save_random_adapter(path: str | Path, config: ModelConfig, rank: int, seed: int,
                        alpha: float | None = None, projections: tuple[str, ...] = PROJECTIONS,
                        dtype: torch.dtype = torch.bfloat16, dora: bool = False) -> Path:
    """Write adapter_config.json + adapter_model.safetensors with random A and B to `path`; with
    `dora`, a DoRA adapter (use_dora) whose magnitudes are uniform in [0.5, 1.5] (around the
    row norms of dummy weights, ~1 for N(0, 0.02) rows of 4,096). On a mixture-of-experts model's
    MoE layers, gate/up and down stand for the experts' fused gate_up_proj and down_proj, adapted
    as PEFT's target_parameters adapts them (punica.lora.adapter)."""
    gen = torch.Generator().manual_seed(seed)
    module_of = {proj: module for module, proj in MODULES.items()}
    shapes = config.projection_shapes()
    tensors = {}
    dense = [p for p in projections  # the MLP's projections exist only on a MoE model's dense layers
             if p not in ("gate", "up", "down") or len(config.moe_layers) < config.num_layers]
    for proj in dense:
        h_in, h_out = shapes[proj]
        for layer in range(config.num_layers):
            if config.is_moe(layer) and proj in ("gate", "up", "down"):
                continue
            prefix = f"base_model.model.model.layers.{layer}.{module_of[proj]}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, h_in, generator=gen) / math.sqrt(h_in)).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(h_out, rank, generator=gen) * 0.05).to(dtype)
            if dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = (torch.rand(h_out, generator=gen) + 0.5).to(dtype)
    experts = [p for p in ("gate_up", "down") if config.moe_layers and set(p.split("_")) & set(projections)]
    tensors |= _random_expert_tensors(config, experts, rank, gen, dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "bias": "none", "use_dora": dora,
        "target_modules": [module_of[p].split(".")[1] for p in dense],
        "target_parameters": [f"mlp.experts.{p}_proj" for p in experts]}))
    return path


def _random_expert_tensors(config: ModelConfig, experts: list[str], rank: int, gen: torch.Generator,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """PEFT's tensors of the `experts` parameters ("gate_up", "down") of every MoE layer: lora_A
    [E * rank, h_in], lora_B [h_out, E * rank], the first parameter's wrapper nested under the
    second's (`experts.base_layer`)."""
    h, inter, num_experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    shapes = {"gate_up": (h, 2 * inter), "down": (inter, h)}
    tensors = {}
    for layer in config.moe_layers:
        for depth, param in enumerate(reversed(experts)):
            h_in, h_out = shapes[param]
            prefix = f"base_model.model.model.layers.{layer}.mlp.experts{'.base_layer' * depth}"
            a = torch.randn(num_experts * rank, h_in, generator=gen) / math.sqrt(h_in)
            b = torch.randn(h_out, num_experts * rank, generator=gen) * 0.05
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a.to(dtype), b.to(dtype)
    return tensors
