"""benchmarks.textgen's HF+PEFT baseline (its module docstring says what runs): transformers' Llama of
the preset's shape with PEFT LoRA adapters, generating in static batches of HF_BATCH."""

from __future__ import annotations

import random
import time

import torch

from punica.config import ModelConfig
from punica.workloads import textgen_lengths

HF_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_BATCH = 32


def hf_llama(config: ModelConfig, dtype: torch.dtype, device: str):
    """transformers' Llama of this shape, randomly initialised, without an EOS token (so
    generation always runs to max_new_tokens)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()


def hf_generate(model, requests: list[tuple[list[int], int]], names: list[str] | None, max_new: int | None = None):
    """One static batch: left-padded prompts, greedy, to the longest requested output (or max_new)."""
    width = max(len(prompt) for prompt, _ in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(requests):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    max_new = max_new or max(out for _, out in requests)
    extra = {"adapter_names": names} if names else {}
    device = model.device
    output = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                            do_sample=False, **extra)
    assert output.shape == (len(requests), width + max_new), output.shape


def hf_run(model, requests: list[tuple[list[int], int]], names: list[str] | None) -> dict:
    batches = [slice(i, i + HF_BATCH) for i in range(0, len(requests), HF_BATCH)]
    hf_generate(model, requests[batches[0]], names and names[batches[0]], max_new=2)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        hf_generate(model, requests[batch], names and names[batch])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(prompt) + out for prompt, out in requests)
    return {"system": "hf+peft", "requests": len(requests), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds}


def hf_baseline(config: ModelConfig, workloads: list[str], num_requests: int, max_total: int, rank: int,
                dtype: torch.dtype, device: str) -> list[dict]:
    """HF+PEFT rows for backbone, distinct and identical (those in `workloads`)."""
    from peft import LoraConfig, get_peft_model

    rng = random.Random(2)
    requests = [([rng.randrange(3, config.vocab_size) for _ in range(prompt)], out)
                for prompt, out in textgen_lengths(num_requests, rng, max_total=max_total)]
    model = hf_llama(config, dtype, device)
    rows = []

    def measure(workload: str, model, names: list[str] | None) -> None:
        rows.append({"workload": workload, **hf_run(model, requests, names)})
        print(f"hf+peft {workload}: {rows[-1]['tokens_per_s']:.1f} tokens/s", flush=True)

    if "backbone" in workloads:
        measure("backbone", model, None)
    lora_workloads = [w for w in ("distinct", "identical") if w in workloads]
    if lora_workloads:
        lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(HF_MODULES),
                                 init_lora_weights=False)
        with torch.device(device):  # create the adapters' weights where they will live
            model = get_peft_model(model, lora_config, adapter_name="a0", autocast_adapter_dtype=False)
            for i in range(1, num_requests if "distinct" in lora_workloads else 1):
                model.add_adapter(f"a{i}", lora_config, autocast_adapter_dtype=False)
        model.set_adapter("a0")
        model.eval()
        if "distinct" in lora_workloads:
            measure("distinct", model, [f"a{i}" for i in range(num_requests)])  # request i, adapter i
        if "identical" in lora_workloads:  # PEFT's ordinary path: the active adapter for every row
            measure("identical", model, None)
    return rows
