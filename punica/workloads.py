"""The paper's four adapter-popularity workloads, for tests and benchmarks."""

from __future__ import annotations

import math
import random

WORKLOADS = ("distinct", "uniform", "skewed", "identical")


def adapter_ids(workload: str, num_requests: int, rng: random.Random, zipf_alpha: float = 1.5) -> list[int]:
    """Adapter index of each of `num_requests` requests.

    distinct: every request its own adapter; uniform: ceil(sqrt(n)) adapters, uniformly;
    skewed: Zipf(alpha) over n adapters; identical: one adapter for all.
    """
    if workload == "distinct":
        return list(range(num_requests))
    if workload == "uniform":
        k = max(1, math.ceil(math.sqrt(num_requests)))
        return [rng.randrange(k) for _ in range(num_requests)]
    if workload == "skewed":
        weights = [1.0 / (i + 1) ** zipf_alpha for i in range(num_requests)]
        return rng.choices(range(num_requests), weights=weights, k=num_requests)
    if workload == "identical":
        return [0] * num_requests
    raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")


def textgen_lengths(num_requests: int, rng: random.Random, max_total: int = 2048,
                    min_prompt: int = 1) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs after the paper's generator.

    prompt_len ~ lognorm(s=0.8, loc=-1, scale=18), clipped to [min_prompt, max_total - 1];
    total length ~ uniform up to max_total, at least prompt_len + 1.
    """
    pairs = []
    for _ in range(num_requests):
        prompt = int(-1 + 18 * rng.lognormvariate(0.0, 0.8))
        prompt = min(max(prompt, min_prompt), max_total - 1)
        total = rng.randint(prompt + 1, max_total)
        pairs.append((prompt, total - prompt))
    return pairs
