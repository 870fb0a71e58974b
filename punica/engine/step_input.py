"""StepInput: everything the model needs to run one step, as plain host arrays, built once per step.

The scheduler's plan (punica.engine.scheduler_output.SchedulerOutput: prefill requests first, then
decodes, each group in adapter-slot order) becomes one StepInput, which every way of running a step
consumes as it is: the eager runner copies it to the device, a CUDA-graph bucket pads it into its
static buffers, and tensor-parallel ranks receive it through their pipes. Nothing downstream looks
at requests.

Per token (T = num_tokens, prefill tokens first, then one per decode):
    token_ids    int64  the token (a placeholder where fed_rows >= 0)
    fed_rows     int64  the row of the previous step's sampled tokens (on the device) holding this
                        token, or -1: a decode whose last token has not reached the host yet
    positions    int64  its position in its sequence
    kv_slots     int64  page * page_size + offset where its key and value are written
    token_slots  int64  its adapter slot (-1: no adapter)
    token_scales float32 its request's lora_scale (the strength of its adapter's delta)
Per request (B = num_requests):
    query_start   int64 [B + 1]  token offset of each request's queries
    context_lens  int64 [B]      tokens in its KV cache after this step
    request_slots int64 [B]      its adapter slot
    request_scales float32 [B]   its lora_scale
    page_table    int64 [B, W]   its pages in order (W = the most pages any request holds; the rest 0)
    num_logits    int64 [B]      how many of its last query rows get logits: 1, or more for a request
                                 that asks for prompt logprobs (punica.engine.prompt_logprobs)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from punica.lora.batch import LoraBatch
from punica.ops.attention import AttnBatch
from punica.ops.transfer import to_device


@dataclass(frozen=True, eq=False)
class StepInput:
    token_ids: np.ndarray
    fed_rows: np.ndarray
    positions: np.ndarray
    kv_slots: np.ndarray
    token_slots: np.ndarray
    token_scales: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    request_slots: np.ndarray
    request_scales: np.ndarray
    page_table: np.ndarray
    num_prefills: int
    num_logits: np.ndarray

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)

    @property
    def num_decodes(self) -> int:
        return self.num_requests - self.num_prefills

    @property
    def num_prefill_tokens(self) -> int:
        return int(self.query_start[self.num_prefills])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start)

    @property
    def any_lora(self) -> bool:
        return bool((self.request_slots >= 0).any())

    @property
    def only_last_logits(self) -> bool:
        """Every request gets the logits of its last row only (the CUDA graphs compute no others)."""
        return bool((self.num_logits == 1).all())

    @property
    def logits_rows(self) -> np.ndarray:
        """[num_logits.sum()] the token rows whose logits the step computes, in order."""
        ends = self.query_start[1:]
        if self.only_last_logits:
            return ends - 1
        return np.concatenate([np.arange(end - n, end) for end, n in zip(ends, self.num_logits)])

    @property
    def any_fed(self) -> bool:
        return bool((self.fed_rows >= 0).any())

    @classmethod
    def build(cls, new_token_ids: list[list[int]], num_cached: list[int], pages: list[list[int]],
              slots: list[int], num_prefills: int, page_size: int, fed_rows: list[int] | None = None,
              scales: list[float] | None = None, num_logits: list[int] | None = None) -> StepInput:
        """From each request's tokens to run this step (a prefill's uncached tokens; a decode's one
        token), how many of its tokens are cached before it, its pages and its adapter slot.
        `fed_rows`: one per decode, as the field (None: every token is on the host); `scales`: each
        request's lora_scale (None: 1 for all); `num_logits`: as the field (None: 1 for all)."""
        num_requests = len(new_token_ids)
        assert len(num_cached) == len(pages) == len(slots) == num_requests and 0 <= num_prefills <= num_requests
        if any(len(ids) != 1 for ids in new_token_ids[num_prefills:]):
            raise ValueError("a decode request runs exactly one query token")
        cached = np.asarray(num_cached, dtype=np.int64)
        if num_prefills:
            query_lens = np.fromiter(map(len, new_token_ids), dtype=np.int64, count=num_requests)
            query_start = np.zeros(num_requests + 1, dtype=np.int64)
            np.cumsum(query_lens, out=query_start[1:])
            owner = np.repeat(np.arange(num_requests), query_lens)  # each token's request
        else:  # decodes only: token i is request i's (fewer numpy calls before the step's launch)
            query_lens = np.ones(num_requests, dtype=np.int64)
            query_start = np.arange(num_requests + 1, dtype=np.int64)
            owner = query_start[:-1]
        num_tokens = int(query_start[-1])
        context_lens = cached + query_lens
        width = max(map(len, pages), default=0)
        page_table = np.zeros((num_requests, width), dtype=np.int64)
        for row, request_pages in enumerate(pages):
            page_table[row, :len(request_pages)] = request_pages
        if (np.fromiter(map(len, pages), dtype=np.int64, count=num_requests) * page_size < context_lens).any():
            raise ValueError("a request holds fewer pages than its context needs")
        # each token's position in its request
        positions = np.arange(num_tokens, dtype=np.int64) - query_start[owner] + cached[owner]
        kv_slots = page_table[owner, positions // page_size] * page_size + positions % page_size
        request_slots = np.asarray(slots, dtype=np.int64)
        request_scales = (np.asarray(scales, dtype=np.float32) if scales is not None
                          else np.ones(num_requests, dtype=np.float32))
        assert request_scales.shape == (num_requests,)
        fed = np.full(num_tokens, -1, dtype=np.int64)
        if fed_rows is not None:
            assert len(fed_rows) == num_requests - num_prefills
            fed[query_start[num_prefills]:] = fed_rows
        token_ids = np.fromiter((t for ids in new_token_ids for t in ids), dtype=np.int64, count=num_tokens)
        if num_logits is None:
            logits = np.ones(num_requests, dtype=np.int64)
        else:
            logits = np.asarray(num_logits, np.int64)
            assert logits.shape == (num_requests,) and ((logits >= 1) & (logits <= query_lens)).all()
        return cls(token_ids=token_ids, fed_rows=fed, positions=positions, kv_slots=kv_slots,
                   token_slots=request_slots[owner], token_scales=request_scales[owner], query_start=query_start,
                   context_lens=context_lens, request_slots=request_slots, request_scales=request_scales,
                   page_table=page_table, num_prefills=num_prefills, num_logits=logits)

    @classmethod
    def from_requests(cls, requests: list, num_scheduled: tuple[int, ...], num_prefills: int, page_size: int,
                      fed_rows: list[int] | None = None) -> StepInput:
        """The step of these requests (punica.engine.request.Request), as a SchedulerOutput lays its
        rows out: the first `num_prefills` run the `num_scheduled` tokens after their cached ones, the
        others (decodes) their last token; a request that asks for prompt logprobs gets the logits
        of the rows that give them."""
        prefills, decodes = requests[:num_prefills], requests[num_prefills:]
        new_tokens = [r.token_ids[r.num_cached:r.num_cached + n] for r, n in zip(prefills, num_scheduled)]
        new_tokens += [[r.last_token_id] for r in decodes]
        cached = [r.num_cached for r in prefills] + [r.num_tokens - 1 for r in decodes]
        num_logits = ([r.num_logits(n) for r, n in zip(prefills, num_scheduled)] + [1] * len(decodes)
                      if prefills else None)
        return cls.build(new_tokens, cached, [r.pages for r in requests], [r.slot for r in requests],
                         num_prefills, page_size, fed_rows, [r.params.lora_scale for r in requests], num_logits)

    # device views --------------------------------------------------------------------------
    def attn_batch(self, device: torch.device | str) -> AttnBatch:
        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.from_numpy(array).to(dtype), device)

        return AttnBatch(
            positions=tensor(self.positions, torch.int64),
            slot_mapping=tensor(self.kv_slots, torch.int64),
            page_table=tensor(self.page_table, torch.int32),
            query_start=tensor(self.query_start, torch.int32),
            context_lens=tensor(self.context_lens, torch.int32),
            logits_indices=tensor(self.logits_rows, torch.int64),
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
        )

    def lora_batch(self, device: torch.device | str) -> LoraBatch:
        return LoraBatch.build(self.request_slots.tolist(), self.query_lens.tolist(), device,
                               request_scales=self.request_scales.tolist(), num_prefills=self.num_prefills)
