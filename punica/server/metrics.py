"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from punica.engine.engine import Engine
from punica.engine.outputs import RequestOutput
from punica.engine.stats import EngineStats
from punica.server.residency import ResidencyCollector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKENS_PER_S_WINDOW_S = 10.0
NO_TENANT = "-"  # the tenant label of a request that has none


class Metrics:
    """A server's metrics. `per_tenant` (a server with tenants): the request metrics (requests,
    latency, time to first token, prompt and generated tokens, prefix-cache tokens) have a last
    label, `tenant`, the tenant id the request carried."""

    def __init__(self, per_tenant: bool = False):
        self.per_tenant = per_tenant
        self.registry = CollectorRegistry()
        r = self.registry
        tenant = ["tenant"] if per_tenant else []
        self.requests = Counter("punica_requests", "Finished requests by how they ended: stop, length, abort "
                                "(the client went away or aborted it) or error (it failed)",
                                ["adapter", "finish_reason", *tenant], registry=r)
        self.rejected = Counter("punica_rejected_requests", "HTTP requests answered with an error status", ["status"],
                                registry=r)
        self.adapter_load_failures = Counter("punica_adapter_load_failures",
                                             "/v1/load_lora_adapter calls that loaded no adapter", registry=r)
        self.latency = Histogram("punica_request_latency_seconds", "Arrival to last token", ["adapter", *tenant],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("punica_time_to_first_token_seconds", "Arrival to first token", ["adapter", *tenant],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("punica_prompt_tokens", "Prompt tokens of finished requests", tenant, registry=r)
        self.generation_tokens = Counter("punica_generation_tokens", "Generated tokens", tenant, registry=r)
        self.tokens_per_s = Gauge("punica_tokens_per_second",
                                  f"Generated tokens/s over the last {TOKENS_PER_S_WINDOW_S:g} s", registry=r)
        self.batch_size = Gauge("punica_batch_size", "Requests in the running batch", registry=r)
        self.queue_length = Gauge("punica_queue_length", "Requests waiting to be admitted", registry=r)
        self.kv_usage = Gauge("punica_kv_cache_usage", "Fraction of KV-cache pages in use", registry=r)
        self.lora_slots = Gauge("punica_lora_slots_in_use", "GPU adapter slots holding an adapter", registry=r)
        self.lora_slots_held = Gauge("punica_lora_slots_held", "GPU adapter slots held by running requests",
                                     registry=r)
        self.step_time = Histogram("punica_step_seconds", "Engine step time", buckets=LATENCY_BUCKETS, registry=r)
        self.constrained = Counter("punica_constrained_requests", "Requests added with a structured-output "
                                   "constraint (JSON schema or object, regex, choice, grammar, a required tool call)",
                                   registry=r)
        self.grammar_compile = Counter("punica_grammar_compile_seconds", "Time spent compiling the grammars of "
                                       "constrained requests (once per grammar while it stays in the cache; a "
                                       "cluster: on the driver and on each worker)", registry=r)
        self.prefix_queries = Counter("punica_prefix_cache_queried_tokens", "Prompt tokens of finished requests "
                                      "looked up in the prefix cache when first admitted", ["adapter", *tenant],
                                      registry=r)
        self.prefix_hits = Counter("punica_prefix_cache_hit_tokens", "Of them, the tokens found there (computed "
                                   "before under the same adapter)", ["adapter", *tenant], registry=r)
        self.cached_pages = Gauge("punica_prefix_cache_pages", "KV-cache pages in the prefix cache", registry=r)
        self.chunked_steps = Counter("punica_chunked_prefill_steps", "Steps that ran a prompt chunk short of its "
                                     "prompt's end", registry=r)
        self.preemptions = Counter("punica_preemptions", "Running requests preempted for KV-cache room (their "
                                   "tokens recomputed when readmitted)", registry=r)
        self.adapter_residency = ResidencyCollector()  # punica_adapter_* per adapter, set before each scrape
        r.register(self.adapter_residency)
        self._recent: deque[tuple[float, int]] = deque()
        # counters of what engines count from their start: (counter, its EngineStats field)
        self._totals = ((self.constrained, "num_constrained_requests"),
                        (self.grammar_compile, "grammar_compile_seconds"),
                        (self.chunked_steps, "num_chunked_steps"), (self.preemptions, "num_preemptions"))
        self._seen = {name: 0 for _, name in self._totals}  # the engines' totals at the last update
        self._totals_lock = threading.Lock()  # the engine thread and /metrics both update them

    def on_step(self, engine: Engine, outputs: list[RequestOutput], seconds: float) -> None:
        """Called by the engine thread after every step (finished outputs also go to `finished`)."""
        now = time.monotonic()
        self.step_time.observe(seconds)
        new_tokens = sum(len(o.new_token_ids) for o in outputs)
        if self.per_tenant:
            for o in outputs:
                self._of(self.generation_tokens, o).inc(len(o.new_token_ids))
        else:
            self.generation_tokens.inc(new_tokens)
        self._recent.append((now, new_tokens))
        while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
            self._recent.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW_S)
        self.update_gauges(engine)

    def finished(self, out: RequestOutput) -> None:
        """Called once per request, with its finished output, whatever ended it."""
        adapter = out.adapter or ""
        self._of(self.requests, out, adapter, out.finish_reason or "").inc()
        self._of(self.prompt_tokens, out).inc(len(out.prompt_token_ids))
        self._of(self.prefix_queries, out, adapter).inc(len(out.prompt_token_ids))
        self._of(self.prefix_hits, out, adapter).inc(out.num_cached_tokens)
        if out.time_to_first_token is not None:
            self._of(self.ttft, out, adapter).observe(out.time_to_first_token)
            if out.finish_reason in ("stop", "length"):  # an aborted or failed request has no last token
                total = out.time_to_first_token + (out.time_per_output_token or 0) * max(0, len(out.token_ids) - 1)
                self._of(self.latency, out, adapter).observe(total)

    def _of(self, metric, out: RequestOutput, *labels: str):
        """The series of `metric` with `labels`, and the tenant of `out` last when per tenant."""
        labels = (*labels, out.tenant or NO_TENANT) if self.per_tenant else labels
        return metric.labels(*labels) if labels else metric

    def update_gauges(self, engine: Engine) -> None:
        stats = engine.stats()
        self.batch_size.set(stats.num_running)
        self.queue_length.set(stats.num_waiting)
        self.kv_usage.set(stats.num_kv_pages_used / stats.num_kv_pages)
        self.lora_slots.set(stats.num_adapter_slots_used)
        self.lora_slots_held.set(stats.num_adapter_slots_held)
        self.cached_pages.set(stats.num_kv_pages_cached)
        self.update_totals([stats])

    def update_totals(self, stats: Iterable[EngineStats], driver_compile_seconds: float = 0.0) -> None:
        """Advance the counters of what engines count from their start (constrained requests, grammar
        compile time, chunked steps, preemptions) to the sum over `stats`, one per engine (a cluster's
        workers), with the grammar compile time of a cluster's driver: each counter advances by what is
        new since the last update."""
        stats = list(stats)
        with self._totals_lock:
            for counter, name in self._totals:
                total = sum(getattr(s, name) for s in stats)
                if name == "grammar_compile_seconds":
                    total += driver_compile_seconds
                counter.inc(max(0, total - self._seen[name]))
                self._seen[name] = max(self._seen[name], total)
