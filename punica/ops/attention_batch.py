"""AttnBatch: the per-step attention metadata of one fused batch (layout and semantics:
punica.ops.attention), in a module of its own so that the Triton launches
(punica.ops.attention_triton) take it without importing the public ops that dispatch to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica.config import ceil_div


@dataclass(frozen=True)
class AttnBatch:
    positions: torch.Tensor       # [T] int64: position of each token in its sequence
    slot_mapping: torch.Tensor    # [T] int64: page * page_size + offset where its K/V is written
    page_table: torch.Tensor      # [B, max_pages] int32: pages of each request, in order
    query_start: torch.Tensor     # [B + 1] int32: token offset of each request's queries
    context_lens: torch.Tensor    # [B] int32: tokens in cache for each request after this step
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits are computed
    num_prefills: int
    num_prefill_tokens: int
    # Every per-request length lives on the device only, so that a CUDA graph captured for one
    # batch shape serves any lengths (punica.engine.cuda_graphs).

    def __post_init__(self):
        assert 0 <= self.num_prefills <= self.page_table.shape[0]
        assert 0 <= self.num_prefill_tokens <= self.positions.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], page_tables: list[list[int]],
              page_size: int, num_prefills: int, device: torch.device | str = "cpu",
              all_logits: bool = False) -> AttnBatch:
        """From per-request query lengths, context lengths and page lists (host lists)."""
        if any(q != 1 for q in query_lens[num_prefills:]):
            raise ValueError("a decode request runs exactly one query token")
        positions, slots, starts = [], [], [0]
        for q, c, pages in zip(query_lens, context_lens, page_tables):
            if len(pages) < ceil_div(c, page_size):
                raise ValueError(f"request needs {ceil_div(c, page_size)} pages for {c} tokens, has {len(pages)}")
            for pos in range(c - q, c):
                positions.append(pos)
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
            starts.append(starts[-1] + q)
        max_pages = max((len(p) for p in page_tables), default=0)
        table = [p + [0] * (max_pages - len(p)) for p in page_tables]
        logits_rows = list(range(starts[-1])) if all_logits else [s - 1 for s in starts[1:]]

        def tensor(xs, dtype):
            return torch.tensor(xs, dtype=dtype, device=device)

        return cls(
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            page_table=tensor(table, torch.int32).reshape(len(page_tables), max_pages),
            query_start=tensor(starts, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            logits_indices=tensor(logits_rows, torch.int64),
            num_prefills=num_prefills,
            num_prefill_tokens=starts[num_prefills],
        )
