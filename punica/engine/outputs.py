"""RequestOutput: what the engine hands back about a request after a step, an abort or a failure."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (token id, logprob), most likely first
    # params.prompt_logprobs: per prompt token (None for the first), its logprob and the top (token id,
    # logprob)s there; the same lists in every output of the request (None until all are computed)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    new_text: str = ""                 # since the previous output of this request
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None   # "stop", "length", "abort" or "error"
    error: str | None = None           # why the request failed (finish_reason "error")
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0         # prompt tokens the prefix cache held when it was admitted
    tenant: str | None = None          # who sent it (Request.tenant)

