"""Request: one prompt's state as it moves through the queue, the batch and the cache."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from punica.engine.sampling_params import SamplingParams

PENDING = -1  # an output token sampled on the device whose value has not reached the host yet


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    tenant: str | None = None            # who sent it (the server's tenant id; None: no tenants)
    cache_salt: str | None = None        # requests share prefix-cache pages only with equal salts
    registration: object = None          # the adapter's registration it was queued for (AdapterManager.current)
    queued_residency: int | None = None  # AdapterManager.residency of its adapter when queued or sent back to the queue
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    slot: int = -1                       # GPU adapter-pool slot while admitted (-1: base model)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # the last num_pending are PENDING
    num_pending: int = 0
    # prompt tokens whose logprob (params.prompt_logprobs) a launched step computes or computed; the
    # first has none and counts from the start
    num_prompt_logprobs: int = 0
    matcher: object = None               # its grammar's xgrammar.GrammarMatcher (structured outputs), or None
    logit_bias_tensors: object = None    # its logit_bias as host tensors, made at its first step (engine.sampler)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0                  # tokens whose K/V are in the cache (or computed by a launched step)
    page_digests: list[bytes] = field(default_factory=list)  # prefix-cache names of its full pages (kv_cache)
    num_pages_cached: int = 0            # its first pages that are in the prefix cache
    num_cached_prompt_tokens: int = 0    # prompt tokens the prefix cache held when it was first admitted
    num_preemptions: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def resolved_output_token_ids(self) -> list[int]:
        """The output tokens whose values the host has."""
        return self.output_token_ids[:len(self.output_token_ids) - self.num_pending]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs, and some of them are still to be computed."""
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids)

    def prompt_rows(self, num_scheduled: int) -> tuple[int, int]:
        """(first position, count) of the positions a step computing its next `num_scheduled` tokens
        runs whose logits give prompt logprobs still missing (position p gives token p + 1's:
        punica.engine.prompt_logprobs)."""
        if not self.needs_prompt_logprobs:
            return 0, 0
        first = max(self.num_cached, self.num_prompt_logprobs - 1)
        end = min(self.num_cached + num_scheduled, len(self.prompt_token_ids) - 1)
        return first, max(0, end - first)

    def num_logits(self, num_scheduled: int) -> int:
        """How many of the rows of a step computing its next `num_scheduled` tokens, ending at its
        last, get logits."""
        first, count = self.prompt_rows(num_scheduled)
        return self.num_cached + num_scheduled - first if count else 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
