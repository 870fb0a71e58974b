"""RequestOutput: what the engine hands back about a request after a step, an abort or a failure."""

from __future__ import annotations

from dataclasses import dataclass, field

from punica.engine.detokenizer import IncrementalDetokenizer
from punica.engine.request import Request


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


def request_output(request: Request, detokenizer: IncrementalDetokenizer | None, new_token_ids: list[int] = (),
                   error: str | None = None) -> RequestOutput:
    """The request's output now: its resolved tokens, its text so far and what is new since the last output."""
    finished = request.finished
    output_token_ids = request.resolved_output_token_ids
    num_out = len(output_token_ids)
    ttft = tpot = None
    prompt_done = request.params.prompt_logprobs is not None and len(request.prompt_logprobs) == len(
        request.prompt_token_ids)
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
        if finished and num_out > 1 and request.finish_time is not None:
            tpot = (request.finish_time - request.first_token_time) / (num_out - 1)
    return RequestOutput(
        request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
        adapter=request.adapter, text=detokenizer.text if detokenizer else "", token_ids=output_token_ids,
        logprobs=list(request.output_logprobs) if request.params.wants_logprobs else None,
        top_logprobs=list(request.output_top_logprobs) if request.params.top_logprobs else None,
        prompt_logprobs=request.prompt_logprobs if prompt_done else None,
        prompt_top_logprobs=request.prompt_top_logprobs if prompt_done else None,
        new_text=detokenizer.take_new_text(finished) if detokenizer else "", new_token_ids=list(new_token_ids),
        finished=finished, finish_reason=request.finish_reason, error=error,
        time_to_first_token=ttft, time_per_output_token=tpot, num_preemptions=request.num_preemptions,
        num_cached_tokens=request.num_cached_prompt_tokens, tenant=request.tenant,
    )
