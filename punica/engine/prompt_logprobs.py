"""Prompt logprobs (SamplingParams.prompt_logprobs): the model's log-probability of each prompt token
given the tokens before it, and of the most likely tokens at its position; the first token has none.

The query row of position p predicts token p + 1, so a step that runs positions [a, b) of a prompt of
P tokens can give the logprobs of tokens a + 1 .. min(b, P - 1). Such a request gets the logits of
its rows from the first missing one to its last (Request.num_logits); every other request gets its
last row's only. The log_softmax of those rows, the prompt tokens' entries and the top-k run on the
device, and their copy to the host is queued before the step samples: so they are on the host when
the request's first sampled token is (the engine reads them then, `take`), and no step waits longer.
A request counts the logprobs it has queued (Request.num_prompt_logprobs): one preempted and
recomputed computes none twice.

Cached prompt tokens have no logits: a request that still needs prompt logprobs takes no pages from
the prefix cache (its own full pages go there as anyone's do).
"""

from __future__ import annotations

import torch

from punica.engine.launched import to_host
from punica.engine.request import Request
from punica.ops.transfer import to_device


def start(request: Request) -> None:
    """Prepare a new request's prompt logprobs (a migrated request computes them again: it
    recomputes its prompt anyway)."""
    if request.params.prompt_logprobs is not None:
        request.prompt_logprobs, request.prompt_top_logprobs = [None], [None]
        request.num_prompt_logprobs = 1


class Chunk:
    """One step's prompt logprobs, on their way to the host: per row, the prompt token's logprob and
    the top K (token, logprob)s (K: the most any of the step's requests asks)."""

    def __init__(self, values: torch.Tensor, top_ids: torch.Tensor | None):
        self.copied = None
        if values.is_cuda:
            values, top_ids = to_host(values), None if top_ids is None else to_host(top_ids)
            self.copied = torch.cuda.Event()
            self.copied.record()
        self._tensors = (values, top_ids)
        self._lists: tuple[list, list] | None = None

    def rows(self) -> tuple[list[list[float]], list[list[int]]]:
        """Per row: [logprob, top logprobs...] and the top token ids, as lists (read once)."""
        if self._lists is None:
            if self.copied is not None:
                self.copied.synchronize()
            values, top_ids = self._tensors
            self._lists = values.tolist(), top_ids.tolist() if top_ids is not None else [[] for _ in values]
            self._tensors = None
        return self._lists


def launch(logits: torch.Tensor, requests: list[Request], counts: list[int]) -> None:
    """Compute on the device the prompt logprobs this step's rows give (logits [sum(counts), V]: each
    request's `counts` last rows), queue their copy to the host and hand each request its part."""
    spans = [r.prompt_rows() for r in requests]
    if not any(count for _, count in spans):
        return
    rows, targets, offset = [], [], 0
    for request, n, (first, count) in zip(requests, counts, spans):
        rows += range(offset, offset + count)
        targets += request.prompt_token_ids[first + 1:first + 1 + count]
        offset += n
    index = to_device(torch.tensor(rows, dtype=torch.int64), logits.device)
    target = to_device(torch.tensor(targets, dtype=torch.int64), logits.device)
    logprobs = logits[index].log_softmax(-1)
    values, top_ids = logprobs.gather(1, target[:, None]), None
    k = max(r.params.prompt_logprobs for r, (_, count) in zip(requests, spans) if count)
    if k:
        top = logprobs.topk(k, dim=-1)
        values, top_ids = torch.cat([values, top.values], 1), top.indices
    chunk, row = Chunk(values, top_ids), 0
    for request, (_, count) in zip(requests, spans):
        if count:
            request.prompt_logprob_chunks.append((chunk, row, count))
            request.num_prompt_logprobs += count
            row += count


def take(request: Request) -> None:
    """Move the request's prompt logprobs that reached the host into its lists (a chunk not yet
    copied is waited for)."""
    k = request.params.prompt_logprobs
    for chunk, row, count in request.prompt_logprob_chunks:
        values, top_ids = chunk.rows()
        for r in range(row, row + count):
            request.prompt_logprobs.append(values[r][0])
            request.prompt_top_logprobs.append([(top_ids[r][j], values[r][1 + j]) for j in range(k)])
    request.prompt_logprob_chunks.clear()

