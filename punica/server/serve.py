"""`punica serve`: load the model and adapters, start the engine thread, run uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from punica.config import EngineConfig
from punica.engine.llm import build_engine, resolve_dtype, with_lora_rank_for
from punica.models.loader import resolve_model_dir
from punica.server.app import ServerState, build_app
from punica.server.async_engine import AsyncEngine
from punica.server.demo import demo_adapters

log = logging.getLogger("punica.server")


def adapters_in(directory: Path) -> dict[str, str]:
    """Every PEFT adapter directly under `directory`, named by its folder."""
    if not directory.is_dir():
        raise FileNotFoundError(f"--adapter-dir {directory} is not a directory")
    return {p.name: str(p) for p in sorted(directory.iterdir()) if (p / "adapter_config.json").is_file()}


def build_state(model: str | None = None, adapters: dict[str, str] | None = None,
                adapter_dirs: list[str] | None = None, api_key: str | None = None, max_queue: int = 1024,
                served_model_name: str | None = None, device: str | None = None, dtype: str | None = None,
                workers: int = 0, tensor_parallel_size: int = 1, **engine_kwargs) -> ServerState:
    """The server's state: one engine in this process (over `tensor_parallel_size` devices), or
    `workers` Ray workers behind the Punica cluster scheduler."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    dirs = [Path(d) for d in adapter_dirs or []]
    all_adapters = dict(demo_adapters()) if model is None and adapters is None and not dirs else {}
    for d in dirs:
        all_adapters.update(adapters_in(d))
    all_adapters.update(adapters or {})
    engine_kwargs = with_lora_rank_for(all_adapters, engine_kwargs)
    name = served_model_name or model_dir.name
    if name in all_adapters:
        raise ValueError(f"an adapter is named like the base model ({name!r}); rename it")
    for adapter, path in all_adapters.items():
        log.info("adapter %s <- %s", adapter, path)
    if workers and tensor_parallel_size > 1:
        raise ValueError("--workers and --tensor-parallel-size do not combine (yet)")
    if workers:
        from punica.cluster.ray_backend import build_cluster_engine
        from punica.server.cluster_backend import ClusterBackend, start_ray

        start_ray()
        cluster = build_cluster_engine(str(model_dir), all_adapters, engine_kwargs, workers, device=device, dtype=dtype)
        log.info("model %s from %s on %d workers (Punica placement and migration)", name, model_dir, workers)
        return ServerState(ClusterBackend(cluster), tokenizer, name, dirs, api_key, max_queue)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = build_engine(model_dir, tokenizer, EngineConfig(**engine_kwargs), all_adapters,
                          resolve_dtype(dtype, device), device, tensor_parallel_size)
    state = ServerState(AsyncEngine(engine), tokenizer, name, dirs, api_key, max_queue)
    state.backend.on_step, state.backend.on_finished = state.metrics.on_step, state.metrics.finished
    log.info("model %s from %s on %s x%d (%s), context %d tokens, KV cache %d pages of %d tokens",
             name, model_dir, device, tensor_parallel_size, engine.model.embed.weight.dtype, engine.max_model_len,
             engine.allocator.num_pages, engine.config.page_size)
    return state


def serve(host: str, port: int, **kwargs) -> None:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(build_state(**kwargs))
    log.info("serving the OpenAI API at http://%s:%d/v1 and the playground at http://%s:%d/", host, port, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info")
