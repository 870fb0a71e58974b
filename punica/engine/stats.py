"""What an engine reports about itself (Engine.stats) and about the step it ran last (Engine.last_step)."""

from __future__ import annotations

from dataclasses import dataclass, field

from punica.engine.scheduler import PrefixCacheCounts
from punica.engine.tenancy import TenantStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_pages: int
    num_kv_pages_used: int
    num_adapter_slots: int
    num_adapter_slots_used: int        # holding an adapter
    num_adapter_slots_held: int        # held by requests in the batch
    num_preemptions: int
    num_constrained_requests: int = 0  # added with structured_outputs, since the engine started
    grammar_compile_seconds: float = 0.0  # spent compiling (or finding in the cache) their grammars
    num_kv_pages_cached: int = 0       # in the prefix cache (held by requests or idle)
    num_chunked_steps: int = 0         # steps that ran a prompt chunk short of its prompt's end
    prefix_cache: dict[str | None, PrefixCacheCounts] = field(default_factory=dict)  # per adapter (None: base)
    tenants: dict[str | None, TenantStats] = field(default_factory=dict)  # per tenant (tenancy.tenant_key)


@dataclass(frozen=True)
class StepShape:
    """What a step ran: its requests, the tokens they attend to in all, and the prompt tokens it computed."""
    num_requests: int
    num_context_tokens: int
    num_prefill_tokens: int
