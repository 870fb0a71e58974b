"""CUDA graphs for decode-only steps, one per batch-size bucket.

A decode step of a 7B model launches ~1,000 kernels; run eagerly, Python and the launches take
longer than the GPU work. So each bucket's step (embedding, every layer with its LoRA deltas,
lm_head) is captured once and replayed: a step costs one host-to-device copy of its inputs and
one graph launch, whatever the mix of adapters.

A step's inputs live in one int64 device buffer per bucket that the graph reads:

    [token ids | positions | KV slots | context lengths | adapter slots | page table (size x max_pages)]

A batch of n < size requests is padded to its bucket with rows that read and write only the
scratch page (a page of the KV cache the allocator never hands out) and use no adapter (slot -1).
The LoRA ops run per token (BGMV: decode batches up to 64 tokens are measured faster that way,
punica.ops.lora.prefer_bgmv), so the adapter mix is data, not graph structure; each bucket also
has a graph without the LoRA ops, replayed when no request of the step uses an adapter. The page table
is as wide as the longest context, and the attention kernels read each row's length on the
device, so one graph serves every context length.
"""

from __future__ import annotations

import numpy as np
import torch

from punica.engine.request import Request
from punica.lora.batch import LoraBatch
from punica.models.llama import LlamaForCausalLM
from punica.ops.attention import AttnBatch


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, then multiples of 8, and max_batch_size itself."""
    sizes = {s for s in (1, 2, 4) if s < max_batch_size} | set(range(8, max_batch_size, 8))
    return sorted(sizes | {max_batch_size})


class StaticDecodeBatch:
    """The device inputs of one bucket: refilled in place by `fill`, read by `forward`."""

    def __init__(self, size: int, max_pages: int, page_size: int, scratch_page: int, device: torch.device):
        self.size, self.max_pages, self.page_size, self.scratch_page = size, max_pages, page_size, scratch_page
        self.host = torch.empty(5 * size + size * max_pages, dtype=torch.int64,
                                pin_memory=device.type == "cuda")
        self.inputs = torch.empty_like(self.host, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(size, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.fill([])

    def fill(self, decodes: list[Request]) -> None:
        """Copy the inputs of these decode requests (at most `size`) to the device, padded."""
        n, size = len(decodes), self.size
        assert n <= size, (n, size)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        host = self.host.numpy()
        ids, positions, kv_slots, context, adapters = host[:5 * size].reshape(5, size)
        table = host[5 * size:].reshape(size, self.max_pages)
        ids[:], positions[:], context[:], adapters[:] = 0, 0, 1, -1
        kv_slots[:] = self.scratch_page * self.page_size
        table[:] = self.scratch_page
        for i, request in enumerate(decodes):
            pos = request.num_tokens - 1
            ids[i], positions[i], context[i], adapters[i] = request.token_ids[-1], pos, pos + 1, request.slot
            kv_slots[i] = request.pages[pos // self.page_size] * self.page_size + pos % self.page_size
            table[i, :len(request.pages)] = request.pages
        self.inputs.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def forward(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, with_lora: bool) -> torch.Tensor:
        """Logits [size, V] float32 of every row (LoRA deltas only if `with_lora`): only device
        ops, so it can be captured."""
        size, x = self.size, self.inputs
        token_slots = x[4 * size:5 * size].to(torch.int32)
        attn = AttnBatch(
            positions=x[size:2 * size], slot_mapping=x[2 * size:3 * size],
            page_table=x[5 * size:].view(size, self.max_pages).to(torch.int32),
            query_start=self.query_start, context_lens=x[3 * size:4 * size].to(torch.int32),
            logits_indices=self.logits_indices, num_prefill_tokens=0,
            prefill_query_lens=(), prefill_context_lens=(),
        )
        # every token its own segment, so the SGMV view agrees with the per-token one
        lora = LoraBatch(seg_indptr=self.query_start, seg_slots=token_slots, token_slots=token_slots,
                         use_bgmv=True, any_lora=with_lora)
        return model(x[:size], attn, lora, kv_cache)


class DecodeGraphs:
    """Two captured decode steps per bucket (with and without LoRA), sharing one memory pool."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, page_size: int,
                 max_batch_size: int, max_pages: int, scratch_page: int):
        self.model, self.kv_cache = model, kv_cache
        device = kv_cache.device
        self.batches = {size: StaticDecodeBatch(size, max_pages, page_size, scratch_page, device)
                        for size in graph_batch_sizes(max_batch_size)}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.batches, reverse=True):  # the largest first: the others reuse its memory
            for with_lora in (True, False):
                batch, key = self.batches[size], (size, with_lora)
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # compile the kernels and settle the allocator outside capture
                    for _ in range(2):
                        batch.forward(model, kv_cache, with_lora)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[key] = batch.forward(model, kv_cache, with_lora)
                self.graphs[key] = graph
        torch.cuda.synchronize(device)

    @property
    def max_batch_size(self) -> int:
        return max(self.batches)

    def run(self, decodes: list[Request]) -> torch.Tensor:
        """Logits [len(decodes), V] float32, from the smallest bucket that holds the batch."""
        size = min(s for s in self.batches if s >= len(decodes))
        key = (size, any(r.slot >= 0 for r in decodes))
        self.batches[size].fill(decodes)
        self.graphs[key].replay()
        return self.outputs[key][:len(decodes)].clone()
