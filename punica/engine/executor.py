"""Executors: what an Engine runs its steps on. The engine is composed of a scheduler, an adapter
manager and one executor; variants (one process, tensor parallel over N processes) are executors,
not engine subclasses.
"""

from __future__ import annotations

from typing import Protocol

import torch

from punica.config import ModelConfig
from punica.engine.step_input import StepInput
from punica.engine.worker import ModelWorker
from punica.lora.adapter import AdapterWeights, LoraAdapter


class AdapterSlots(Protocol):
    """Where the adapter manager writes adapters: punica.lora.pool.LoraPool, or a pool that shards
    each adapter over tensor-parallel ranks (it packs every rank's shard into one host row)."""

    max_loras: int
    max_rank: int
    buffer: torch.Tensor          # its dtype and device are the slots'

    @property
    def packed_shape(self) -> tuple[int, ...]: ...

    def pack(self, adapter: LoraAdapter | AdapterWeights, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def write_packed(self, slot: int, packed: torch.Tensor, scale: float, non_blocking: bool = False) -> None: ...


class Executor(Protocol):
    model_config: ModelConfig     # the whole model's: adapters are read and checked against it
    num_pages: int                # KV-cache pages for requests
    adapter_slots: AdapterSlots
    can_feed_sampled: bool        # runs steps whose tokens the previous step sampled on the device
    device: torch.device          # where the model runs (rank 0's under tensor parallelism)
    chunk_sizes: tuple[int, ...]  # the prompt tokens steps compute, by size (ModelRunner.chunk_sizes)
    row_sizes: tuple[int, ...]    # the GEMM rows between which steps pad (ModelRunner.row_sizes)
    query_tile: int               # queries of a prefill attention tile (ModelRunner.query_tile)

    def run(self, step: StepInput) -> torch.Tensor:
        """Logits [step.num_logits.sum(), V] float32 on the device of the sampler (ModelRunner.run)."""

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens on the device, for the next step's fed rows."""

    def close(self) -> None:
        """Release what the executor started (processes); idempotent."""


class LocalExecutor:
    """One ModelWorker in this process: steps run on its runner."""
    can_feed_sampled = True

    def __init__(self, worker: ModelWorker):
        self.worker = worker
        self.model_config = worker.model.config
        self.num_pages = worker.num_pages
        self.adapter_slots = worker.pool
        self.device = worker.device
        self.chunk_sizes = worker.runner.chunk_sizes
        self.row_sizes = worker.runner.row_sizes
        self.query_tile = worker.runner.query_tile

    def run(self, step: StepInput) -> torch.Tensor:
        return self.worker.runner.run(step)

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        self.worker.runner.keep_sampled(tokens)

    def close(self) -> None:
        """Nothing to release: the worker's memory goes with the executor."""
