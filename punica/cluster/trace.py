"""The cluster workload of the paper's Fig. 13: a Poisson arrival rate that rises then falls
over the run, Zipf-1.5 adapter popularity, and the textgen prompt/output length generator."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from punica.workloads import adapter_ids, textgen_lengths


@dataclass(frozen=True)
class Trace:
    arrivals: list[float]      # seconds, ascending
    prompt_lens: list[int]
    output_lens: list[int]
    adapters: list[int]
    duration_s: float

    def __len__(self) -> int:
        return len(self.arrivals)


def rate_at(t: float, num_requests: int, duration_s: float) -> float:
    """Arrival rate (requests/s) at time t: num_requests * (pi / 2T) * sin(pi t / T)."""
    return num_requests * math.pi / (2 * duration_s) * math.sin(math.pi * t / duration_s)


def fig13_trace(num_requests: int, duration_s: float = 3600.0, seed: int = 0, max_total: int = 2048,
                num_adapters: int | None = None, zipf_alpha: float = 1.5) -> Trace:
    """`num_requests` arrivals of a Poisson process with rate `rate_at` (so, given their number,
    arrival times are i.i.d. with density sin(pi t / T) * pi / 2T, drawn by inverting the CDF).
    Adapters: Zipf(`zipf_alpha`) over `num_adapters` adapters (default: one per request)."""
    if num_adapters is not None and num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    rng = random.Random(seed)
    arrivals = sorted(duration_s / math.pi * math.acos(1 - 2 * rng.random()) for _ in range(num_requests))
    lengths = textgen_lengths(num_requests, rng, max_total=max_total)
    if num_adapters is None:
        adapters = adapter_ids("skewed", num_requests, rng, zipf_alpha=zipf_alpha)
    else:
        weights = [1.0 / (i + 1) ** zipf_alpha for i in range(num_adapters)]
        adapters = rng.choices(range(num_adapters), weights=weights, k=num_requests)
    return Trace(arrivals, [p for p, _ in lengths], [o for _, o in lengths], adapters, duration_s)
