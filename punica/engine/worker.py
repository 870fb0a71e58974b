"""ModelWorker: one process's part of running steps: the model (or its tensor-parallel shard), its
KV cache, its LoRA pool and the runner over them. An executor runs steps on one worker's runner per
process (one, or one per tensor-parallel rank); it knows nothing of requests, only StepInputs and
adapter slots.
"""

from __future__ import annotations

import torch

from punica.config import EngineConfig, ModelConfig, ceil_div
from punica.engine.runner import ModelRunner, kv_bytes_per_token
from punica.lora.layers import attach_pool
from punica.lora.pool import LoraPool, pool_slots, slot_bytes
from punica.models.decoder import DecoderForCausalLM

CPU_KV_CACHE_BYTES = 1 << 30


def kv_cache_pages(model: DecoderForCausalLM, config: EngineConfig) -> int:
    """Pages from kv_cache_tokens, or from kv_cache_bytes or the free-memory fraction (CUDA) / 1 GiB (CPU)
    over the bytes a token takes in config.kv_cache_dtype (fp8: values and their scales). The fraction
    is of the memory left free once the adapter pool (allocated after) is set apart."""
    if config.kv_cache_tokens is not None:
        return ceil_div(config.kv_cache_tokens, config.page_size)
    budget = config.kv_cache_bytes
    if budget is None:
        weight = model.embed.weight
        if weight.device.type == "cuda":
            attach_pool(model, None)  # a pool it served before is not this engine's memory (ModelWorker)
            free, _ = torch.cuda.mem_get_info(weight.device)
            slots = pool_slots(model.config, config.max_loras, config.max_lora_rank, weight.dtype,
                               config.max_lora_bytes)
            pool = slots * slot_bytes(model.config, config.max_lora_rank, weight.dtype)
            budget = int(max(0, free - pool) * config.kv_cache_memory_fraction)
        else:
            budget = CPU_KV_CACHE_BYTES
    return max(1, budget // (kv_bytes_per_token(model, config.kv_cache_dtype) * config.page_size))


def context_limit(model_config: ModelConfig, config: EngineConfig, num_pages: int) -> int:
    """The longest sequence (prompt + output) the engine serves: the model's, the configured and the
    KV cache's limit, whichever is least."""
    positions = model_config.max_position_embeddings
    return min(config.max_model_len or positions, positions, num_pages * config.page_size)


class ModelWorker:
    def __init__(self, model: DecoderForCausalLM, config: EngineConfig, num_pages: int):
        self.model = model
        self.num_pages = num_pages
        weight = model.embed.weight
        self.device = weight.device
        # a model serves one engine's pool: a pool it served before (an engine dropped on the same
        # model) is let go before this one takes the memory
        attach_pool(model, None)
        slots = pool_slots(model.config, config.max_loras, config.max_lora_rank, weight.dtype, config.max_lora_bytes)
        self.pool = LoraPool(model.config, slots, config.max_lora_rank, weight.dtype, weight.device)
        self.pool.base_weight = model.group_weight  # DoRA's norms
        attach_pool(model, self.pool)  # before the runner captures CUDA graphs that read the pool
        self.runner = ModelRunner(model, num_pages, config.page_size, config.max_batch_size,
                                  context_limit(model.config, config, num_pages), eager=config.enforce_eager,
                                  kv_cache_dtype=config.kv_cache_dtype)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graphs is not None
