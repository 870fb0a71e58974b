"""What crosses the scheduler's boundary (torch-free): its plan of a step (`SchedulerOutput`), the
values the step sampled once they are on the host (`SampledTokens`), and what each step did to a
request (`RequestUpdate`, for the output processor).

    Scheduler.schedule() -> SchedulerOutput -> the step runs and samples on the device
    -> Scheduler.launched(output) -> ... -> SampledTokens
    -> Scheduler.update_from_output(output, sampled) -> [RequestUpdate] -> OutputProcessor
"""

from __future__ import annotations

from dataclasses import dataclass, field

from punica.engine.request import Request


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Its rows: the prompts first (a chunk of each), then the decodes (one token
    each); within each group by adapter slot, so that the requests of one adapter sit side by side
    (one LoRA segment). A row samples a token when it reaches its request's last token: every decode
    does, and a prompt's last chunk."""
    step: int                       # the scheduler's count of the steps it planned
    request_ids: tuple[str, ...]    # per row
    num_computed: tuple[int, ...]   # per row: its tokens in the KV cache before the step (where its chunk starts)
    num_scheduled: tuple[int, ...]  # per row: the tokens the step computes
    num_prefills: int               # the first rows, prompts
    sampling_rows: tuple[int, ...]  # the rows that sample, in order
    preempted_ids: tuple[str, ...]  # running requests the plan sent back to the queue

    def __bool__(self) -> bool:
        return bool(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)


@dataclass(frozen=True)
class SampledTokens:
    """A launched step's sampled tokens on the host: per sampling row (SchedulerOutput.sampling_rows)
    its token, whether it could be sampled (finite logits), the token's logprob and the top (token,
    logprob)s, when its request asks for them; and per row that computed prompt logprobs, its part
    of them (punica.engine.prompt_logprobs: read by the output processor)."""
    token_ids: list[int]
    ok: list[bool]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # row -> (Chunk, its first row there, count)


@dataclass(frozen=True)
class RequestUpdate:
    """What a step, an abort or a failure did to one request: a token (its value, logprob and top
    logprobs), prompt logprobs computed, or an error that ended it. The request's status says
    whether it finished and why."""
    request: Request
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = ()
    prompt_logprobs: tuple | None = None  # (Chunk, first row in it, count), as SampledTokens'
    error: str | None = None
