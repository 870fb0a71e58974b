"""TenantShare: a tenant's fair share of an engine, as the server's tenants file sets it (torch-free:
the server builds these, the engine schedules by them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantShare:
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    max_kv_tokens: int | None = None
