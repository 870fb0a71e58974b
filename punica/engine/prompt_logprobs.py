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


def launch(logits: torch.Tensor, requests: list[Request], num_scheduled: tuple[int, ...],
           counts: list[int]) -> dict[int, tuple[Chunk, int, int]]:
    """Compute on the device the prompt logprobs of a step's rows (logits [sum(counts), V]: each
    request's `counts` last rows; each request runs its next `num_scheduled` tokens) and queue their
    copy to the host: per row that gives some, (the step's Chunk, its first row there, their count)."""
    spans = [r.prompt_rows(n) for r, n in zip(requests, num_scheduled)]
    if not any(count for _, count in spans):
        return {}
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
    chunk, row, parts = Chunk(values, top_ids), 0, {}
    for i, (_, count) in enumerate(spans):
        if count:
            parts[i] = (chunk, row, count)
            row += count
    return parts


def read(parts: list[tuple[Chunk, int, int]], k: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The logprobs of the prompt tokens in `parts` (as `launch` gives them), in order, and the top `k`
    (token, logprob)s at each (a chunk not yet copied is waited for)."""
    logprobs, tops = [], []
    for chunk, row, count in parts:
        values, top_ids = chunk.rows()
        for r in range(row, row + count):
            logprobs.append(values[r][0])
            tops.append([(top_ids[r][j], values[r][1 + j]) for j in range(k)])
    return logprobs, tops
