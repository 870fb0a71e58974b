"""ModelRunner: turns a scheduled batch into tensors, runs the model, returns next-token logits."""

from __future__ import annotations

import torch

from punica.engine.request import Request
from punica.lora.batch import LoraBatch
from punica.models.llama import LlamaForCausalLM
from punica.ops.attention import AttnBatch


def kv_bytes_per_token(model: LlamaForCausalLM) -> int:
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.weight.element_size()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_pages: int, page_size: int):
        self.model = model
        self.device = model.embed.weight.device
        self.page_size = page_size
        self.kv_cache = model.new_kv_cache(num_pages, page_size)

    @torch.inference_mode()
    def run(self, prefills: list[Request], decodes: list[Request]) -> torch.Tensor:
        """Logits [len(prefills) + len(decodes), V] float32 of each request's next token, in order.

        A prefill runs every token not yet cached (a whole prompt, or prompt + generated tokens
        when recomputing after a preemption); a decode runs its last token.
        """
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
        return self.model(input_ids, attn, lora, self.kv_cache)
