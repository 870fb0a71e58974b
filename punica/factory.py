"""The one way engines are built: `build_engine(EngineArgs, adapters)`.

It resolves the model source (a checkpoint directory, a .gguf file, the embedded default, or
random weights of a shape), the dtype and device, the adapters served at start (the demo
adapters when nothing is given for the embedded model), and composes the Engine with its
executor: one process, or tensor parallel over `tensor_parallel_size` processes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from punica.config import PRESETS, EngineArgs, EngineConfig, ModelConfig, preset_config
from punica.demo import demo_adapters
from punica.engine.engine import Engine
from punica.engine.executor import Executor, LocalExecutor
from punica.engine.worker import ModelWorker, kv_cache_pages
from punica.lora.adapter_config import adapter_rank
from punica.models.decoder import DecoderForCausalLM
from punica.models.loader import DummyWeights, default_dtype, load_weights
from punica.models.sources import resolve_model_dir
from punica.parallel.executor import start_tensor_parallel

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    return default_dtype(device) if dtype == "auto" else TORCH_DTYPES[dtype]


def model_source(args: EngineArgs) -> tuple[Path | DummyWeights, Path | None]:
    """(what to load weights from, the directory of its tokenizer and generation config, if any)."""
    if args.load_format == "dummy":
        if args.model in PRESETS:
            return DummyWeights(preset_config(args.model)), None
        model_dir = resolve_model_dir(args.model)
        return DummyWeights(ModelConfig.from_dir(model_dir)), model_dir
    model_dir = resolve_model_dir(args.model)
    return model_dir, model_dir


def load_tokenizer(model_dir: Path | None):
    """The directory's tokenizer, or None when it has none (token-id-only models)."""
    if model_dir is None or not any((model_dir / name).is_file()
                                    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def generation_eos_ids(model_dir: Path | None) -> tuple[int, ...]:
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def startup_adapters(args: EngineArgs, adapters: dict[str, str] | None) -> dict[str, str]:
    """The adapters served from the start: those given, or, for the embedded default model when none
    are given (None), its demo adapters."""
    if adapters is None:
        return demo_adapters() if args.model is None and args.load_format == "auto" else {}
    return dict(adapters)


def engine_config(args: EngineArgs, adapters: dict[str, str]) -> EngineConfig:
    """args' EngineConfig, its max_lora_rank raised to fit the largest of the start-up adapters."""
    config = args.engine_config()
    rank = max([config.max_lora_rank, *map(adapter_rank, adapters.values())])
    return dataclasses.replace(config, max_lora_rank=rank)


def engine_on_model(model: DecoderForCausalLM, config: EngineConfig, adapters: dict[str, str] | None = None,
                    tokenizer=None, eos_token_ids: tuple[int, ...] = ()) -> Engine:
    """An engine in this process over a model already loaded (benchmarks build several engines over one)."""
    return Engine(LocalExecutor(ModelWorker(model, config, kv_cache_pages(model, config))), tokenizer, config,
                  adapters, eos_token_ids)


def build_executor(args: EngineArgs, config: EngineConfig, source: Path | DummyWeights) -> Executor:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.tensor_parallel_size > 1:
        return start_tensor_parallel(source, config, dtype, device, args.tensor_parallel_size,
                                     quantization=args.quantization)
    model = load_weights(source, dtype, device, quantization=args.quantization)
    return LocalExecutor(ModelWorker(model, config, kv_cache_pages(model, config)))


def build_engine(args: EngineArgs, adapters: dict[str, str] | None = None) -> Engine:
    """The engine `args` describe, serving `adapters` (name -> PEFT directory; see startup_adapters).
    `args.workers` is the server's (punica.cluster); an engine is one process or one tensor-parallel group."""
    if args.workers:
        raise ValueError("an engine runs in one process or one tensor-parallel group; workers are the "
                         "server's (punica serve --workers)")
    adapters = startup_adapters(args, adapters)
    source, model_dir = model_source(args)
    config = engine_config(args, adapters)
    executor = build_executor(args, config, source)
    try:
        return Engine(executor, load_tokenizer(model_dir), config, adapters, generation_eos_ids(model_dir))
    except BaseException:
        executor.close()
        raise
