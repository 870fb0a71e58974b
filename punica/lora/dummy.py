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
                        dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write adapter_config.json + adapter_model.safetensors with random A and B to `path`."""
    gen = torch.Generator().manual_seed(seed)
    module_of = {proj: module for module, proj in MODULES.items()}
    shapes = config.projection_shapes()
    tensors = {}
    for proj in projections:
        h_in, h_out = shapes[proj]
        for layer in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{module_of[proj]}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, h_in, generator=gen) / math.sqrt(h_in)).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(h_out, rank, generator=gen) * 0.05).to(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "bias": "none",
        "target_modules": [module_of[p].split(".")[1] for p in projections]}))
    return path
