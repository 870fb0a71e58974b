"""LaunchedStep: a step sampled on the device, whose tokens (and logprobs) are on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica.engine.request import Request


@dataclass(frozen=True)
class LaunchedStep:
    """A step whose sampled tokens are on their way to the host."""
    requests: list[Request]
    sampled: torch.Tensor              # [2 + K, N] int64: tokens, 1 where the row could be sampled, top-K tokens
    logprobs: torch.Tensor | None      # [N, 1 + K] float32 (sampler.Sampled)
    copied: torch.cuda.Event | None    # set when both are on the host; None when the step ran on the CPU

    def read(self) -> tuple[list[int], list[bool], list[float | None], list[list[tuple[int, float]]]]:
        """Per row: the token, whether it could be sampled, its logprob, and the top (token, logprob)s."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, ok, *top_ids = self.sampled.tolist()
        n = len(self.requests)
        if self.logprobs is None:
            return tokens, [bool(v) for v in ok], [None] * n, [[] for _ in range(n)]
        logprobs = self.logprobs.tolist()
        tops = [[(top_ids[k][row], logprobs[row][1 + k]) for k in range(len(top_ids))] for row in range(n)]
        return tokens, [bool(v) for v in ok], [row[0] for row in logprobs], tops


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor into pinned host memory, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
