"""Shared test fixtures: a tiny random Llama and real PEFT LoRA adapters made by `peft` itself."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from punica.config import ModelConfig

HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer GQA Llama: hidden 64, intermediate 96, 4 heads, 2 kv heads, vocab 128."""
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return LlamaConfig(**(kw | overrides))


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A randomly initialised tiny Llama in fp32 eval mode (global RNG left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def capture_graph(fn):
    """Run fn once eagerly (its kernels compile outside the capture), then capture one call of it
    in a CUDA graph: (graph, what the captured call returned)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def punica_config(model: LlamaForCausalLM) -> ModelConfig:
    return ModelConfig.from_hf_dict(model.config.to_dict())


def make_peft_adapter(base_model: LlamaForCausalLM, path: str | Path, r: int, alpha: float,
                      targets: tuple[str, ...] | list[str] = HF_MODULES, use_rslora: bool = False,
                      seed: int = 0, safe_serialization: bool = True, **kw) -> Path:
    """Save a PEFT LoRA adapter with random non-zero A and B (init_lora_weights=False) to `path`.

    `base_model` is not modified; `kw` goes to LoraConfig (e.g. layers_to_transform).
    """
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base_model), config)
    peft_model.save_pretrained(str(path), safe_serialization=safe_serialization)
    return Path(path)


def load_peft_model(base_model: LlamaForCausalLM, paths: dict[str, str | Path]) -> PeftModel:
    """A PeftModel (on a copy of `base_model`) holding each adapter of `paths` under its name."""
    (first, first_path), *rest = paths.items()
    model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(first_path), adapter_name=first)
    for name, path in rest:
        model.load_adapter(str(path), adapter_name=name)
    return model.eval()
