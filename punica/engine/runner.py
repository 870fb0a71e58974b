"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import logging
import time

import torch

from punica.config import ceil_div
from punica.engine.cuda_graphs import CudaGraphs, fed_token_ids
from punica.engine.step_input import StepInput
from punica.models.decoder import DecoderForCausalLM
from punica.models.forward_batch import ForwardBatch
from punica.models.quantized import pack_cpu_linears, packed_linears
from punica.ops.attention import prefill_query_tile
from punica.ops.kv_cache import kv_bytes_per_token as layer_bytes_per_token
from punica.ops.linear import (
    CPU_SKINNY_BLOCK,
    MAX_CPU_SKINNY_ROWS,
    MIN_CPU_PACKED_ROWS,
    choose_few_rows_paths,
    cpu_packing_available,
)
from punica.ops.transfer import to_device

log = logging.getLogger(__name__)

MAX_PACKED_FRACTION = 0.5  # of the memory available at start-up that CPU weights' packed copies may take


def available_memory() -> int:
    """Bytes of memory the kernel says are available (MemAvailable in /proc/meminfo; 0 where unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def kv_bytes_per_token(model: DecoderForCausalLM, kv_cache_dtype: str = "auto") -> int:
    """Bytes of KV cache (values and, fp8, scales) one token takes over all of the model's layers."""
    c = model.config
    return layer_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.embed.weight.dtype, kv_cache_dtype)


class ModelRunner:
    """On CUDA (unless `eager`), steps that fit a bucket of punica.engine.cuda_graphs replay a
    captured graph; other steps, and every step on the CPU, run eagerly.

    A decode's last token may still be on the device, sampled by the previous step and kept by
    `keep_sampled`: the step's fed row of that token says where (punica.engine.step_input).

    The KV cache (in `kv_cache_dtype`: punica.ops.kv_cache) holds `num_pages` pages for requests
    plus one scratch page (the last) that padded rows of graph batches write to.

    On a CPU, the projections' fp32 weights get packed copies for steps of many rows
    (punica.ops.linear), if the copies take at most MAX_PACKED_FRACTION of the memory available;
    then the GEMMs of 1-3 rows take, per weight shape and row count, the path that ran fastest here
    (punica.ops.linear.choose_few_rows_paths).
    """

    def __init__(self, model: DecoderForCausalLM, num_pages: int, page_size: int, max_batch_size: int,
                 max_model_len: int | None = None, eager: bool = False, kv_cache_dtype: str = "auto"):
        self.model = model
        self.device = model.embed.weight.device
        self.page_size = page_size
        self.kv_cache = model.new_kv_cache(num_pages + 1, page_size, kv_cache_dtype)
        self.sampled = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        self.graphs: CudaGraphs | None = None
        self.packed_bytes = 0
        if self.device.type == "cpu" and model.embed.weight.dtype == torch.float32 and cpu_packing_available():
            budget = int(MAX_PACKED_FRACTION * available_memory())
            self.packed_bytes = pack_cpu_linears(model, budget)
            if self.packed_bytes:
                log.info("packed %.0f MB of CPU weights for oneDNN", self.packed_bytes / 2**20)
                start = time.perf_counter()
                chosen = choose_few_rows_paths(packed_linears(model))
                log.info("CPU GEMMs of 1-%d rows, by weight shape: %s (timed in %.2f s)", MIN_CPU_PACKED_ROWS - 1,
                         ", ".join(f"{n}x{k} {'/'.join(paths)}" for (n, k), paths in chosen.items()),
                         time.perf_counter() - start)
            else:
                log.info("CPU weights not packed: over %.0f MB of memory", budget / 2**20)
        if self.device.type == "cuda" and not eager:
            start = time.perf_counter()
            max_pages = ceil_div(max_model_len or num_pages * page_size, page_size)
            with torch.inference_mode():
                self.graphs = CudaGraphs(model, self.kv_cache, self.sampled, page_size, max_batch_size, max_pages,
                                         scratch_page=num_pages)
            log.info("captured CUDA graphs of %d batch shapes in %.1f s", len(self.graphs.batches),
                     time.perf_counter() - start)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The prompt tokens a step computes when it replays a graph (CudaGraphs.chunk_sizes); ()
        when every step runs eagerly, computing just its own."""
        return self.graphs.chunk_sizes if self.graphs is not None else ()

    @property
    def query_tile(self) -> int:
        """Queries of the prefill attention's tiles, each reading its request's cached context
        (punica.ops.attention.prefill_query_tile): what a chunk size's attention costs by."""
        return prefill_query_tile(self.device, self.model.config.head_dim, self.model.embed.weight.dtype)

    @property
    def row_sizes(self) -> tuple[int, ...]:
        """Row counts of a step's GEMMs between which its rows are padded to the next (the step's rows
        in (size, next size] compute the next): on a CPU, fp32 W @ x^T (punica.ops.linear) unless
        the weights are packed; () elsewhere."""
        if self.device.type == "cpu" and self.model.embed.weight.dtype == torch.float32 and not self.packed_bytes:
            return CPU_SKINNY_BLOCK, MAX_CPU_SKINNY_ROWS
        return ()

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens [num_requests] on the device, for the next step's `fed` rows."""
        self.sampled[:len(tokens)].copy_(tokens)

    @torch.inference_mode()
    def run(self, step: StepInput) -> torch.Tensor:
        """Logits [step.num_logits.sum(), V] float32 of each request's last num_logits rows (its next
        token's last), in the step's order. A token whose fed row is >= 0 is read from the previous
        step's sampled tokens (`keep_sampled`). A step with more rows of logits than one per request
        (prompt logprobs) runs eagerly."""
        if self.graphs is not None and step.only_last_logits:
            logits = self.graphs.run(step)
            if logits is not None:
                return logits
        input_ids = to_device(torch.from_numpy(step.token_ids), self.device)
        if step.any_fed:
            input_ids = fed_token_ids(input_ids, to_device(torch.from_numpy(step.fed_rows), self.device), self.sampled)
        batch = ForwardBatch(step.attn_batch(self.device), step.lora_batch(self.device), self.kv_cache)
        return self.model(input_ids, batch)
