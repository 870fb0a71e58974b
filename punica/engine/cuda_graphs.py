"""CUDA graphs for decode steps and steps of up to 2,048 prefill tokens: every bucket's whole
model run is captured.

A decode step of a 7B model launches ~1,000 kernels; run eagerly, Python and the launches take
longer than the GPU work. So the step (embedding, every layer with its LoRA deltas, lm_head) is
captured once per bucket and replayed: a step costs one host-to-device copy of its inputs and
one graph launch, whatever the mix of adapters.

A bucket is a batch shape: `num_prefills` prefill requests with `prefill_tokens` query tokens
between them, then `num_decodes` decode rows. Decode-only buckets (no prefills) cover batch
sizes 1, 2, 4, then multiples of 8; mixed buckets hold MIXED_PREFILL_TOKENS prefill tokens
(up to the longest context), plus one per padding request, beside a full batch of decodes, so
that steps admitting prompts replay a graph too (run eagerly, a step's ~1,000 kernel launches
take ~50 ms of host time on a 7B model, longer than its GPU work up to ~2,000 prefill tokens).
A mixed bucket takes up to one prefill request per 16 of its tokens (at least 3, at most
max_batch_size), plus one for padding. A step's inputs live in one int64 device buffer per bucket that its graph reads:

    [token ids | fed rows | positions | KV slots | adapter slots]  (one each per token)
    [query starts (requests + 1) | context lengths | adapter slots | page table (requests x max_pages)]

and one float32 buffer of each token's lora_scale (padding rows: 0, with slot -1 they add nothing).

A smaller batch is padded to its bucket: padded decode rows, and one padded prefill request
that takes every spare prefill token, read and write only the scratch page (a page of the KV
cache the allocator never hands out) and use no adapter (slot -1). The LoRA ops run the decode
rows per token (BGMV) and, in mixed buckets, the prefill rows as one segment per request (SGMV,
its tile height from the bucket's prefill tokens per real request: punica.lora.batch); either
way the adapter mix is data, not graph structure; each bucket also has a graph without
the LoRA ops, replayed when no request of the step uses an adapter. The page table is as wide
as the longest context and the attention kernels read every length on the device, so one graph
serves every context length. A decode row whose token the previous step sampled on the device
reads it there (its fed row, else -1), so the next step can be launched before that token
reaches the host. The KV cache's pages, and an fp8 cache's scales beside them, are static
buffers the graphs read and write like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from punica.engine.step_input import StepInput
from punica.lora.batch import LoraBatch
from punica.models.decoder import DecoderForCausalLM
from punica.models.forward_batch import ForwardBatch
from punica.ops.attention import AttnBatch
from punica.ops.kv_cache import KVCache
from punica.ops.lora_shapes import sgmv_block_m

MIXED_PREFILL_TOKENS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048)  # prefill tokens of the mixed buckets
MIN_MIXED_PREFILLS = 4                    # prefill requests of a mixed bucket, the padding one included
TOKENS_PER_PREFILL = 16                   # a mixed bucket takes one prefill request per this many tokens


def fed_token_ids(ids: torch.Tensor, sources: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """ids [T] with ids[i] replaced by sampled[sources[i]] wherever sources[i] >= 0."""
    return torch.where(sources >= 0, sampled[sources.clamp(min=0)], ids)


def decode_batch_sizes(max_batch_size: int) -> list[int]:
    """The decode-only buckets: 1, 2, 4, then multiples of 8, and max_batch_size itself."""
    sizes = {s for s in (1, 2, 4) if s < max_batch_size} | set(range(8, max_batch_size, 8))
    return sorted(sizes | {max_batch_size})


@dataclass(frozen=True)
class Bucket:
    num_prefills: int
    prefill_tokens: int
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.num_decodes

    @property
    def num_requests(self) -> int:
        return self.num_prefills + self.num_decodes

    @property
    def prompt_tokens(self) -> int:
        """A mixed bucket's prompt tokens: its prefill rows less the one it keeps for each of
        num_prefills - 1 padding requests (`buckets`)."""
        return self.prefill_tokens - self.num_prefills + 1

    def fits(self, step: StepInput) -> bool:
        if not step.num_prefills:
            return self.num_prefills == 0 and step.num_decodes <= self.num_decodes
        padding = self.num_prefills - step.num_prefills  # padding requests, of at least one token each
        return (padding > 0 and step.num_prefill_tokens + padding <= self.prefill_tokens
                and step.num_decodes <= self.num_decodes)


def buckets(max_batch_size: int, max_context: int) -> list[Bucket]:
    """Every bucket, smallest first (no padding prefill request longer than `max_context`)."""
    decode = [Bucket(0, 0, size) for size in decode_batch_sizes(max_batch_size)]
    mixed = []
    for tokens in MIXED_PREFILL_TOKENS:
        if tokens <= max_context:
            num_prefills = min(max_batch_size, max(MIN_MIXED_PREFILLS - 1, tokens // TOKENS_PER_PREFILL)) + 1
            # a token for each padding request besides `tokens`: any num_prefills - 1 prompts of
            # `tokens` tokens in all fit (32 prompts of 64 tokens fit the 2,048 bucket)
            mixed.append(Bucket(num_prefills, tokens + num_prefills - 1, max_batch_size))
    return decode + mixed


class StaticBatch:
    """The device inputs of one bucket: refilled in place by `fill`, read by `forward`."""

    def __init__(self, bucket: Bucket, max_pages: int, page_size: int, scratch_page: int, device: torch.device):
        self.bucket, self.max_pages, self.page_size, self.scratch_page = bucket, max_pages, page_size, scratch_page
        t, b = bucket.num_tokens, bucket.num_requests
        self.sizes = (t, t, t, t, t, b + 1, b, b, b * max_pages)
        self.host = torch.empty(sum(self.sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.inputs = torch.empty_like(self.host, device=device)
        self.host_scales = torch.empty(t, dtype=torch.float32, pin_memory=device.type == "cuda")
        self.token_scales = torch.empty_like(self.host_scales, device=device)
        # numpy views of the host buffers' fields, made once: `fill` runs on the host before every
        # replay, so its numpy calls delay the step's launch
        fields = np.split(self.host.numpy(), np.cumsum(self.sizes)[:-1])
        self._fields = tuple(fields[:-1]) + (fields[-1].reshape(b, max_pages),)
        self._scales = self.host_scales.numpy()
        # the prefill rows' SGMV tile height, from the bucket's prompt tokens and prefill requests
        # (the padding request and its tokens left out: a 64-token chunk runs BGMV, as outside a
        # graph); 1: every row runs BGMV, and the segments cover no token
        self.sgmv_block_m = sgmv_block_m(bucket.prompt_tokens, bucket.num_prefills - 1) if bucket.num_prefills else 1
        self.no_segments = torch.zeros(1, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.fill(None)

    def fill(self, step: StepInput | None) -> None:
        """Copy the step's inputs (a step the bucket `fits`, or None for an all-padding batch) to the
        device, padded."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffer
        bucket, page_size, scratch = self.bucket, self.page_size, self.scratch_page
        ids, sources, positions, kv_slots, adapters, starts, context, request_slots, table = self._fields
        scales = self._scales
        scales[:] = 0
        ids[:], sources[:], positions[:], adapters[:], context[:], request_slots[:] = 0, -1, 0, -1, 1, -1
        kv_slots[:] = scratch * page_size
        table[:] = scratch
        starts[:] = np.arange(bucket.num_requests + 1) + bucket.prefill_tokens - bucket.num_prefills
        num_prefills = step.num_prefills if step is not None else 0
        num_tokens = step.num_prefill_tokens if step is not None else 0
        if step is not None:
            width = step.page_table.shape[1]
            # the step's prefill tokens and requests first, its decodes after the bucket's prefill part
            parts = ((slice(0, num_tokens), slice(0, num_prefills), slice(0, num_tokens), slice(0, num_prefills)),
                     (slice(bucket.prefill_tokens, bucket.prefill_tokens + step.num_decodes),
                      slice(bucket.num_prefills, bucket.num_prefills + step.num_decodes),
                      slice(num_tokens, step.num_tokens), slice(num_prefills, step.num_requests)))
            for token_rows, request_rows, step_tokens, step_requests in (
                    part for part, count in zip(parts, (num_prefills, step.num_decodes)) if count):
                ids[token_rows] = step.token_ids[step_tokens]
                sources[token_rows] = step.fed_rows[step_tokens]
                positions[token_rows] = step.positions[step_tokens]
                kv_slots[token_rows] = step.kv_slots[step_tokens]
                adapters[token_rows] = step.token_slots[step_tokens]
                scales[token_rows] = step.token_scales[step_tokens]
                context[request_rows] = step.context_lens[step_requests]
                request_slots[request_rows] = step.request_slots[step_requests]
                table[request_rows, :width] = step.page_table[step_requests]
            starts[:num_prefills + 1] = step.query_start[:num_prefills + 1]
        starts[0] = 0
        if bucket.num_prefills:  # padding requests: one token each, the last takes what is left
            first, last = num_prefills, bucket.num_prefills - 1
            starts[first + 1:last + 1] = np.arange(num_tokens + 1, num_tokens + 1 + last - first)
            starts[last + 1] = bucket.prefill_tokens
            context[first:last + 1] = starts[first + 1:last + 2] - starts[first:last + 1]
            positions[starts[last]:bucket.prefill_tokens] = np.arange(bucket.prefill_tokens - starts[last])
        self.inputs.copy_(self.host, non_blocking=True)
        self.token_scales.copy_(self.host_scales, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def forward(self, model: DecoderForCausalLM, kv_cache: KVCache, sampled: torch.Tensor,
                with_lora: bool) -> torch.Tensor:
        """Logits [num_requests, V] float32 of every request row (LoRA deltas only if
        `with_lora`), fed rows read from `sampled`: only device ops, so it can be captured."""
        bucket = self.bucket
        ids, sources, positions, kv_slots, adapters, starts, context, request_slots, table = self.inputs.split(
            self.sizes)
        ids = fed_token_ids(ids, sources, sampled)
        token_slots, query_start = adapters.to(torch.int32), starts.to(torch.int32)
        attn = AttnBatch(
            positions=positions, slot_mapping=kv_slots,
            page_table=table.view(bucket.num_requests, self.max_pages).to(torch.int32),
            query_start=query_start, context_lens=context.to(torch.int32), logits_indices=starts[1:] - 1,
            num_prefills=bucket.num_prefills, num_prefill_tokens=bucket.prefill_tokens,
        )
        if self.sgmv_block_m > 1:
            lora = LoraBatch(seg_indptr=query_start[:bucket.num_prefills + 1],
                             seg_slots=request_slots[:bucket.num_prefills].to(torch.int32), token_slots=token_slots,
                             token_scales=self.token_scales, sgmv_tokens=bucket.prefill_tokens,
                             sgmv_block_m=self.sgmv_block_m, any_lora=with_lora)
        else:
            lora = LoraBatch(seg_indptr=self.no_segments, seg_slots=self.no_segments[:0], token_slots=token_slots,
                             token_scales=self.token_scales, sgmv_tokens=0, sgmv_block_m=1, any_lora=with_lora)
        return model(ids, ForwardBatch(attn, lora, kv_cache))


class CudaGraphs:
    """Two captured steps per bucket (with and without LoRA), sharing one memory pool."""

    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, sampled: torch.Tensor, page_size: int,
                 max_batch_size: int, max_pages: int, scratch_page: int):
        device = kv_cache.pages.device
        self.batches = [StaticBatch(b, max_pages, page_size, scratch_page, device)
                        for b in buckets(max_batch_size, max_pages * page_size)]
        self.graphs: dict[tuple[Bucket, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[Bucket, bool], torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        by_size = sorted(self.batches, key=lambda batch: batch.bucket.num_tokens, reverse=True)
        for batch in by_size:  # the largest first: the others reuse its memory
            for with_lora in (True, False):
                key = (batch.bucket, with_lora)
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # compile the kernels and settle the allocator outside capture
                    for _ in range(2):
                        batch.forward(model, kv_cache, sampled, with_lora)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[key] = batch.forward(model, kv_cache, sampled, with_lora)
                self.graphs[key] = graph
        torch.cuda.synchronize(device)

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The prompt tokens of the mixed buckets, smallest first: a step's prompt tokens run at the
        first size that holds them (besides their requests' padding, which every bucket has room for)."""
        return tuple(b.bucket.prompt_tokens for b in self.batches if b.bucket.num_prefills)

    def run(self, step: StepInput) -> torch.Tensor | None:
        """Logits [step.num_requests, V] float32 from the smallest bucket that fits the step, or None
        when none does (the caller runs it eagerly)."""
        batch = next((b for b in self.batches if b.bucket.fits(step)), None)
        if batch is None:
            return None
        bucket = batch.bucket
        key = (bucket, step.any_lora)
        batch.fill(step)
        self.graphs[key].replay()
        out = self.outputs[key]
        if not step.num_prefills:
            return out[:step.num_decodes].clone()
        return torch.cat([out[:step.num_prefills], out[bucket.num_prefills:bucket.num_prefills + step.num_decodes]])
