"""Tenants as the engine sees them (torch-free; the server imports this too): the share of the engine
each one gets (`TenantShare`, given to Engine.set_tenants), the error of a tenant over its request
cap, and what Engine.stats reports per tenant.

A request belongs to the tenant `tenant_key` names: its `tenant` (the id the server resolved) if it
has one, else its adapter's name (None: the base model). So without tenants each adapter, and the
base model, is a tenant of its own: shares given under an adapter's name apply to its requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShare:
    weight: float = 1.0                          # service relative to other tenants' (fair scheduling)
    max_concurrent_requests: int | None = None   # queued and running at once; more are refused
    max_kv_tokens: int | None = None             # KV held by its running requests, in whole pages

    def __post_init__(self):
        if (isinstance(self.weight, bool) or not isinstance(self.weight, int | float)
                or not math.isfinite(self.weight) or self.weight <= 0):
            raise ValueError(f"a tenant's weight must be a positive finite number, got {self.weight!r}")
        for name in ("max_concurrent_requests", "max_kv_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"a tenant's {name} must be an integer >= 1 or None, got {value!r}")


DEFAULT_SHARE = TenantShare()


class TenantLimitError(ValueError):
    """A request refused because its tenant already has `max_concurrent_requests` queued or running
    (an HTTP server answers 429: the same request may succeed once one of them finishes)."""

    def __init__(self, tenant: str | None, limit: int):
        who = "the base model" if tenant is None else f"tenant {tenant!r}"
        super().__init__(f"{who} already has {limit} requests queued or running (its max_concurrent_requests); "
                         f"retry when one of them finishes")
        self.tenant, self.limit = tenant, limit


@dataclass(frozen=True)
class TenantStats:
    num_waiting: int
    num_running: int
    num_kv_tokens: int           # held by its running requests (whole pages; shared cached pages count for each)
    num_computed_tokens: int     # prompt and output tokens the engine computed for it (prefix-cache hits are free)
    service: float               # its virtual token counter: computed tokens / weight, lifted on return from idle


def checked_shares(shares: dict[str, TenantShare]) -> dict[str, TenantShare]:
    """A copy of `shares`; TypeError unless it maps tenant names to TenantShares."""
    for name, share in shares.items():
        if not isinstance(name, str) or not isinstance(share, TenantShare):
            raise TypeError(f"tenant shares map names to TenantShare, got {name!r}: {share!r}")
    return dict(shares)


def tenant_key(tenant: str | None, adapter: str | None) -> str | None:
    """The tenant a request of `tenant` on `adapter` belongs to, for fair share and caps."""
    return tenant if tenant is not None else adapter
