"""Per-adapter residency counters of the AdapterManager, and the plain-data form routers read.

The manager counts where each event happens: a load into a tier when the engine takes in a
finished read (disk -> host) or copy (host -> GPU), an eviction when an adapter's host row or
GPU slot is taken for another adapter, a hit or a miss when a request is admitted. A tier is
"host" or "gpu"; an adapter's residency tier is the fastest one holding it ("disk": registered,
not read, or evicted from both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("host", "gpu")  # the tiers loads go into and evictions leave


def _per_tier(value: float) -> dict[str, float]:
    return dict.fromkeys(TIERS, value)


@dataclass
class AdapterCounters:
    """One registration's counts since it was registered."""
    loads: dict[str, int] = field(default_factory=lambda: _per_tier(0))          # reads into host, copies to gpu
    evictions: dict[str, int] = field(default_factory=lambda: _per_tier(0))      # of its host row, of its GPU slot
    load_seconds: dict[str, float] = field(default_factory=lambda: _per_tier(0.0))  # start to taken in, summed
    last_load_seconds: dict[str, float | None] = field(default_factory=lambda: _per_tier(None))
    hits: int = 0    # admissions on the GPU residency the request was queued on
    misses: int = 0  # admissions that waited for a load (or a reload after an eviction)

    def loaded(self, tier: str, seconds: float) -> None:
        self.loads[tier] += 1
        self.load_seconds[tier] += seconds
        self.last_load_seconds[tier] = seconds

    def admitted(self, queued_residency: int | None) -> None:
        """Count a request admitted; `queued_residency`: AdapterManager.residency when it was queued."""
        if queued_residency is not None and queued_residency == self.loads["gpu"]:
            self.hits += 1
        else:
            self.misses += 1

    def as_dict(self) -> dict:
        return {"loads": dict(self.loads), "evictions": dict(self.evictions), "load_seconds": dict(self.load_seconds),
                "last_load_seconds": dict(self.last_load_seconds), "hits": self.hits, "misses": self.misses}
