"""Fixtures of every test directory: a tiny random Llama and real PEFT LoRA adapters made by `peft` itself.

Each fixture returns a function (tests call it with the arguments they need); test modules never
import this file.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on machines without a GPU; this must be set
# before any @triton.jit function is defined, triton's own included: before the imports
# below, which import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from punica.config import ModelConfig  # noqa: E402

HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
    """The punica ModelConfig of a transformers Llama."""
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


@pytest.fixture(scope="session", name="tiny_llama_config")
def tiny_llama_config_fixture():
    """The function `tiny_llama_config(**overrides) -> LlamaConfig`."""
    return tiny_llama_config


@pytest.fixture(scope="session", name="tiny_llama")
def tiny_llama_fixture():
    """The function `tiny_llama(seed=0, **overrides) -> LlamaForCausalLM`."""
    return tiny_llama


@pytest.fixture(scope="session", name="capture_graph")
def capture_graph_fixture():
    """The function `capture_graph(fn) -> (graph, out)`."""
    return capture_graph


@pytest.fixture(scope="session", name="punica_config")
def punica_config_fixture():
    """The function `punica_config(model) -> ModelConfig`."""
    return punica_config


@pytest.fixture(scope="session", name="make_peft_adapter")
def make_peft_adapter_fixture():
    """The function `make_peft_adapter(base_model, path, r, alpha, targets=HF_MODULES, ...) -> Path`."""
    return make_peft_adapter


@pytest.fixture(scope="session", name="load_peft_model")
def load_peft_model_fixture():
    """The function `load_peft_model(base_model, paths) -> PeftModel`."""
    return load_peft_model
