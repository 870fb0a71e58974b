"""The tensor-parallel executor: this process is rank 0, punica.parallel.worker the other ranks.

An Engine composed with it schedules, samples and manages adapters as always; the executor

  - sends each step's StepInput to the workers before running rank 0's shard of it: every rank
    runs the same step, the model's all-reduces combine the shards, and rank 0's logits (lm_head
    is replicated) go to the sampler;
  - gives the engine's adapter manager a pool that packs every rank's shard of an adapter (on
    the manager's read thread, into the host tier); writing a slot sends worker r its packed
    shard, which it copies into the same slot of its pool, and copies rank 0's into rank 0's pool.

The KV cache of each rank holds its kv heads; all ranks use the same pages, the fewest any
rank's memory allows. Workers keep no request state: each step's message is all they need.
Every token comes from rank 0's host (`can_feed_sampled` is False): the workers have no sampled
tokens of their own, so the engine does not overlap steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

from punica.config import EngineConfig, ModelConfig
from punica.engine.step_input import StepInput
from punica.engine.worker import ModelWorker, kv_cache_pages
from punica.lora.adapter import AdapterWeights
from punica.lora.pool import LoraPool
from punica.models.loader import DummyWeights
from punica.parallel.driver import Workers
from punica.parallel.tensor_parallel import rank_config, shard_adapter
from punica.parallel.worker import load_shard

TIMEOUT_S = 300.0  # start-up, and any collective a dead or hung rank never joins


class ShardingPool:
    """The pool rank 0's AdapterManager writes into: whole adapters in, each rank's shard to its pool.

    It has what the manager uses of a LoraPool: `pack` (on the read thread: every rank's
    packed shard, `packed_shape` [world_size, slot_numel]), `write_packed`, and `buffer`,
    `max_loras`, `max_rank` (rank 0's pool's).
    """

    def __init__(self, pool: LoraPool, workers: Workers, full_config: ModelConfig):
        self.pool, self.workers, self.full_config = pool, workers, full_config
        self.buffer, self.max_loras, self.max_rank = pool.buffer, pool.max_loras, pool.max_rank

    @property
    def packed_shape(self) -> tuple[int, ...]:
        return (self.workers.world_size, self.pool.slot_numel)

    def pack(self, adapter: AdapterWeights, out: torch.Tensor | None = None) -> torch.Tensor:
        if adapter.dora:
            raise ValueError(f"adapter {adapter.name!r} is a DoRA adapter, which punica does not serve under tensor "
                             "parallelism (its weight norms need whole rows of the sharded base weights)")
        n = self.workers.world_size
        packed = out if out is not None else torch.empty(self.packed_shape, dtype=self.buffer.dtype)
        stacked = adapter.stacked(self.full_config.num_layers)
        for rank in range(n):
            self.pool.pack(shard_adapter(stacked, self.full_config, rank, n), out=packed[rank])
        return packed

    def write_packed(self, slot: int, packed: torch.Tensor, scale: float, non_blocking: bool = False,
                     dora: bool = False) -> None:
        assert not dora, "pack refuses DoRA adapters"
        self.workers.send(("write", slot, scale), [shard.view(torch.uint8).numpy() for shard in packed[1:]])
        self.pool.write_packed(slot, packed[0], scale, non_blocking=non_blocking)


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group (see the module docstring); `close` stops the workers."""
    can_feed_sampled = False

    def __init__(self, worker: ModelWorker, workers: Workers, full_config: ModelConfig):
        self.worker, self.workers = worker, workers
        self.model_config = full_config
        self.num_pages = worker.num_pages
        self.adapter_slots = ShardingPool(worker.pool, workers, full_config)
        self.device = worker.device
        self.chunk_sizes = worker.runner.chunk_sizes
        self.row_sizes = worker.runner.row_sizes
        self.query_tile = worker.runner.query_tile

    def run(self, step: StepInput) -> torch.Tensor:
        assert not step.any_fed, "a tensor-parallel step reads every token from the host"
        self.workers.send(("step", step))
        try:
            return self.worker.runner.run(step)
        except Exception as e:  # the workers ran (or wait in) this step: the group cannot go on
            raise self.workers.fail(e) from e

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        raise AssertionError("a tensor-parallel engine does not overlap steps")

    def close(self) -> None:
        self.workers.stop()


def backend_for(device: torch.device, world_size: int) -> str:
    """gloo for CPU ranks, NCCL for GPU ranks (rank r on cuda:r)."""
    if device.type == "cpu":
        return "gloo"
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device.type}")
    if device.index not in (None, 0):
        raise ValueError(f"with tensor parallelism rank r uses cuda:r; pass the device 'cuda', not {device}")
    if torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor parallel size {world_size} needs {world_size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    return "nccl"


def start_tensor_parallel(source: str | Path | DummyWeights, config: EngineConfig, dtype: torch.dtype,
                          device: str | torch.device, tensor_parallel_size: int,
                          timeout_s: float = TIMEOUT_S, quantization: str = "none") -> TensorParallelExecutor:
    """Start ranks 1..N-1, load this process's shard as rank 0, and return the executor over all N.

    `source`: a checkpoint directory or DummyWeights (random weights of a model shape); each
    rank reads or generates only its own shard (`quantization`: punica.models.loader.load_weights')."""
    full_config = source.config if isinstance(source, DummyWeights) else ModelConfig.from_dir(Path(source))
    rank_config(full_config, tensor_parallel_size)  # the heads must split: fail before starting anything
    backend = backend_for(torch.device(device), tensor_parallel_size)
    workers = Workers(tensor_parallel_size, backend, source, dtype, config, timeout_s, quantization)
    try:
        model = load_shard(source, dtype, workers.device, quantization)
        num_pages = workers.agree(kv_cache_pages(model, config))
        return TensorParallelExecutor(ModelWorker(model, config, num_pages), workers,
                                      full_config)
    except BaseException:
        workers.stop()
        raise
