"""The offline API: `LLM(...).generate(prompts, params, adapter)`."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from punica.config import EngineConfig
from punica.engine.engine import Engine, RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.lora.adapter import adapter_rank
from punica.models.loader import default_dtype, load_hf_dir, resolve_model_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def with_lora_rank_for(adapters: dict[str, str], engine_kwargs: dict) -> dict:
    """engine_kwargs whose max_lora_rank (unless given) fits the largest of the adapters given up front."""
    if not adapters or "max_lora_rank" in engine_kwargs:
        return engine_kwargs
    return {**engine_kwargs, "max_lora_rank": max(EngineConfig.max_lora_rank, *map(adapter_rank, adapters.values()))}


def generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def build_engine(model_dir: Path, tokenizer, config: EngineConfig, adapters: dict[str, str] | None,
                 dtype: torch.dtype, device: str, tensor_parallel_size: int = 1) -> Engine:
    """The engine over a model directory, in this process or over `tensor_parallel_size` processes
    (one per device; this one is rank 0 and runs the engine)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > 1:
        from punica.parallel.engine import start_engine

        return start_engine(model_dir, tokenizer, config, adapters, generation_eos_ids(model_dir), dtype, device,
                            tensor_parallel_size)
    return Engine(load_hf_dir(model_dir, dtype, device), tokenizer, config, adapters, generation_eos_ids(model_dir))


class LLM:
    def __init__(self, model: str | None = None, adapters: dict[str, str] | None = None,
                 max_batch_size: int = 32, dtype: str | torch.dtype | None = None,
                 kv_cache_tokens: int | None = None, device: str | None = None, tensor_parallel_size: int = 1,
                 **engine_kwargs):
        from transformers import AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model_dir = resolve_model_dir(model)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        engine_kwargs = with_lora_rank_for(adapters or {}, engine_kwargs)
        config = EngineConfig(max_batch_size=max_batch_size, kv_cache_tokens=kv_cache_tokens, **engine_kwargs)
        self.engine = build_engine(model_dir, self.tokenizer, config, adapters, resolve_dtype(dtype, device), device,
                                   tensor_parallel_size)

    def chat_prompt(self, user_message: str) -> str:
        """The prompt for one user turn, through the tokenizer's chat template if it has one."""
        if not self.tokenizer.chat_template:
            return user_message
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (one string or token list, or a list of them)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        n = len(prompt_list)
        param_list = _per_prompt(params or SamplingParams(), n, "params")
        adapter_list = _per_prompt(adapter, n, "adapter")
        ids: list[str] = []
        for i, (p, sp, a) in enumerate(zip(prompt_list, param_list, adapter_list)):
            try:
                ids.append(self.engine.add_request(p, sp, a))
            except ValueError as e:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise ValueError(f"prompt {i}: {e}") from e
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="generate", disable=not (use_tqdm if use_tqdm is not None else n >= 64))
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            if self.engine.stalled(outputs):
                time.sleep(0.001)  # every queued request waits for an adapter load
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
