"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import logging
import time

import torch

from punica.config import ceil_div
from punica.engine.cuda_graphs import CudaGraphs, fed_token_ids
from punica.engine.request import Request
from punica.lora.batch import LoraBatch
from punica.models.llama import LlamaForCausalLM
from punica.ops.attention import AttnBatch

log = logging.getLogger(__name__)


def kv_bytes_per_token(model: LlamaForCausalLM) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.weight.element_size()


class ModelRunner:
    """On CUDA (unless `eager`), steps that fit a bucket of punica.engine.cuda_graphs replay a
    captured graph; other steps, and every step on the CPU, run eagerly.

    A decode's last token may still be on the device, sampled by the previous step and kept by
    `keep_sampled`: `fed[i]` is then its row there (else -1), and the model reads it from there.

    The KV cache holds `num_pages` pages for requests plus one scratch page (the last) that
    padded rows of graph batches write to.
    """

    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int, max_batch_size: int = 32,
                 max_model_len: int | None = None, eager: bool = False):
        self.model = model
        self.device = model.embed.weight.device
        self.page_size = page_size
        self.kv_cache = model.new_kv_cache(num_pages + 1, page_size)
        self.sampled = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        self.graphs: CudaGraphs | None = None
        if self.device.type == "cuda" and not eager:
            start = time.perf_counter()
            max_pages = ceil_div(max_model_len or num_pages * page_size, page_size)
            with torch.inference_mode():
                self.graphs = CudaGraphs(model, self.kv_cache, self.sampled, page_size, max_batch_size, max_pages,
                                         scratch_page=num_pages)
            log.info("captured CUDA graphs of %d batch shapes in %.1f s", len(self.graphs.batches),
                     time.perf_counter() - start)

    def keep_sampled(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens [num_requests] on the device, for the next step's `fed` rows."""
        self.sampled[:len(tokens)].copy_(tokens)

    @torch.inference_mode()
    def run(self, prefills: list[Request], decodes: list[Request], fed: list[int] | None = None) -> torch.Tensor:
        """Logits [len(prefills) + len(decodes), V] float32 of each request's next token, in order.

        A prefill runs every token not yet cached (a whole prompt, or prompt + generated tokens
        when recomputing after a preemption); a decode runs its last token, read from the
        previous step's sampled tokens where `fed` (one per decode) gives a row.
        """
        if self.graphs is not None:
            logits = self.graphs.run(prefills, decodes, fed)
            if logits is not None:
                return logits
        ids: list[int] = []
        query_lens, context_lens, tables, slots = [], [], [], []
        for i, request in enumerate(prefills + decodes):
            n = request.num_tokens
            q = n - request.num_cached if i < len(prefills) else 1
            ids.extend(request.token_ids[n - q:])
            query_lens.append(q)
            context_lens.append(n)
            tables.append(request.pages)
            slots.append(request.slot)
        attn = AttnBatch.build(query_lens, context_lens, tables, self.page_size, len(prefills), self.device)
        lora = LoraBatch.build(slots, query_lens, self.device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if fed is not None:
            sources = torch.tensor([-1] * (len(ids) - len(fed)) + fed, dtype=torch.int64, device=self.device)
            input_ids = fed_token_ids(input_ids, sources, self.sampled)
        return self.model(input_ids, attn, lora, self.kv_cache)
