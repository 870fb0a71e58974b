"""The driver's copy of one request served on a cluster: enough to resume it on any worker, and
its outputs told in the driver's terms whichever workers made them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Tracked:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    tenant: str | None = None
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    gpu_id: int | None = None
    num_migrations: int = 0
    arrival_time: float = field(default_factory=time.monotonic)  # the driver's clock, as below
    first_token_time: float | None = None
    # the logprobs (and top logprobs) of the output tokens made on earlier workers: a worker's
    # outputs hold those of the tokens it made itself
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    last_output: RequestOutput | None = None  # the latest output passed on, earlier workers' logprobs in

    def record(self, out: RequestOutput, now: float) -> RequestOutput:
        """A worker's output with the driver's prompt and latencies, and the logprobs of the tokens
        earlier workers made before its own, kept as the request's last output and returned. The
        worker only saw the request since it was last placed, so after a migration its own clock
        starts late and its logprobs start short."""
        if self.first_token_time is None and out.new_token_ids:
            self.first_token_time = now
        ttft = tpot = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
            if out.finished and len(self.output_token_ids) > 1:
                tpot = (now - self.first_token_time) / (len(self.output_token_ids) - 1)
        logprobs = {}
        if out.logprobs is not None:
            logprobs["logprobs"] = self.logprobs + out.logprobs
        if out.top_logprobs is not None:
            logprobs["top_logprobs"] = self.top_logprobs + out.top_logprobs
        self.last_output = replace(out, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                                   time_to_first_token=ttft, time_per_output_token=tpot, **logprobs)
        return self.last_output

    def output(self, **fields) -> RequestOutput:
        """An output the driver makes itself (an abort, a worker's refusal): the tokens so far."""
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             adapter=self.adapter, token_ids=list(self.output_token_ids), tenant=self.tenant, **fields)

    def moved(self) -> None:
        """It left its worker, to be placed again: its next worker's outputs follow its last one."""
        last = self.last_output
        if last is not None:
            self.logprobs = list(last.logprobs or [])
            self.top_logprobs = list(last.top_logprobs or [])
        self.gpu_id = None
        self.num_migrations += 1
