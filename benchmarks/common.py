"""Shared benchmark helpers: random PEFT adapters on disk, result files, tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from punica.config import ModelConfig

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_random_adapter(path: Path, config: ModelConfig, rank: int, seed: int, alpha: float | None = None) -> Path:
    """A PEFT-format LoRA adapter on all 7 projections with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for proj, (h_in, h_out) in config.projection_shapes().items():
        for layer in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{layer}.{HF_MODULES[proj]}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, h_in, generator=gen) / math.sqrt(h_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(h_out, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "bias": "none",
        "target_modules": [m.split(".")[1] for m in HF_MODULES.values()]}))
    return path


def write_results(out_dir: Path, name: str, rows: list[dict], meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return path


def format_table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(_fmt(r[c]).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)
