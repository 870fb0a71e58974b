"""LaunchedStep: a step launched on the device, whose sampled tokens (and logprobs) are on their way
to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica.engine.request import Request
from punica.engine.scheduler_output import SampledTokens, SchedulerOutput


@dataclass(frozen=True)
class LaunchedStep:
    output: SchedulerOutput
    requests: list[Request]            # of its sampling rows, in order
    sampled: torch.Tensor | None       # [2 + K, N] int64: tokens, 1 where the row could be sampled, top-K tokens
    logprobs: torch.Tensor | None      # [N, 1 + K] float32 (sampler.Sampled)
    prompt_logprobs: dict[int, tuple]  # per row computing some: its part (punica.engine.prompt_logprobs.launch)
    copied: torch.cuda.Event | None    # set when both are on the host; None when the step ran on the CPU
    started: float = 0.0               # core.step_clock() when its launch began

    def read(self) -> SampledTokens:
        """Wait for the tokens (and logprobs) of the sampling rows to be on the host."""
        if self.sampled is None:
            return SampledTokens([], [], [], [], self.prompt_logprobs)
        if self.copied is not None:
            self.copied.synchronize()
        tokens, ok, *top_ids = self.sampled.tolist()
        n = len(self.requests)
        ok = [bool(v) for v in ok]
        if self.logprobs is None:
            return SampledTokens(tokens, ok, [None] * n, [[] for _ in range(n)], self.prompt_logprobs)
        logprobs = self.logprobs.tolist()
        tops = [[(top_ids[k][row], logprobs[row][1 + k]) for k in range(len(top_ids))] for row in range(n)]
        return SampledTokens(tokens, ok, [row[0] for row in logprobs], tops, self.prompt_logprobs)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CUDA tensor into pinned host memory, queued on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)
