"""A model of benchmarks.fairness without a model: the real scheduler and waiting queue on the
benchmark's arrivals and lengths, each step's time from a cost model instead of a device.

python -m benchmarks.fairness_model [--seeds 1 2 3] [--margin 512] [--duration 20] [--load 1.7]
    [--step-ms 5.0 --decode-row-ms 0.08 --prompt-token-ms 0.025] [--out results/fairness_model]

Compares rules for fair share in seconds on a CPU: a step takes step-ms + decode-row-ms per decode
row + prompt-token-ms per prompt token (the defaults put the H200 run of benchmarks.fairness
--preset llama-2-7b within a few percent of its mean step time with and without the flood). The
scheduler plans each step and samples token 7 for every row that samples; a page allocator with
prefix caching, as the engine's, holds the KV. For each arrival seed: the steady tenants alone
(fair), then with the flood under fair (FairQueue with --margin) and FCFS; the steady tenants' TTFT
p99 with the flood over without it, and fair's throughput over FCFS's. Capacity, as in
benchmarks.fairness: requests/s of a full queue of the same requests under FCFS. Writes
fairness_model.json.
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import format_table, percentile, write_results
from benchmarks.fairness import FLOOD, RUNS, Arrival, Lengths, Traffic
from punica.engine.fair_share import FairQueue
from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import SampledTokens, SchedulerOutput
from punica.engine.waiting import FcfsQueue

PAGES, PAGE_SIZE = 20_000, 16  # room for every request: the H200 run's KV cache is never short
TOKEN = 7


@dataclass(frozen=True)
class Costs:
    step_s: float
    decode_row_s: float
    prompt_token_s: float

    def of(self, output: SchedulerOutput) -> float:
        num_decodes = len(output.num_scheduled) - output.num_prefills
        return self.step_s + self.decode_row_s * num_decodes + self.prompt_token_s * sum(
            output.num_scheduled[:output.num_prefills])


class Registration:
    """The one version of each tenant's adapter (the prefix cache names pages by it)."""
    version = 1


def simulate(schedule: list[Arrival], scheduling: str, costs: Costs, margin: float, max_batch_size: int,
             budget: int) -> dict:
    waiting = FairQueue(margin=margin) if scheduling == "fair" else FcfsQueue()
    scheduler = Scheduler(PageAllocator(PAGES, PAGE_SIZE, prefix_caching=True), max_batch_size, budget,
                          waiting=waiting)
    clock = busy = 0.0
    pending, num_steps, tokens, ids = 0, 0, 0, itertools.count()
    arrived: dict[str, tuple[float, str]] = {}
    ttft: dict[str, list[float]] = {}
    while pending < len(schedule) or scheduler.has_unfinished():
        if not scheduler.has_unfinished():
            clock = max(clock, schedule[pending].time)
        while pending < len(schedule) and schedule[pending].time <= clock:
            a = schedule[pending]
            request = Request(str(next(ids)), a.prompt, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                              a.tenant, tenant=a.tenant, registration=Registration)
            scheduler.add(request)
            arrived[request.request_id] = (a.time, a.tenant)
            pending += 1
        output = scheduler.schedule()
        if not output:
            continue
        scheduler.launched(output)
        n = len(output.sampling_rows)
        updates = scheduler.update_from_output(output, SampledTokens([TOKEN] * n, [True] * n, [None] * n, [[]] * n))
        seconds = costs.of(output)
        clock, busy, num_steps = clock + seconds, busy + seconds, num_steps + 1
        for update in updates:
            request = update.request
            if update.token_id is not None and len(request.output_token_ids) == 1:
                at, tenant = arrived[request.request_id]
                ttft.setdefault(tenant, []).append(clock - at)
            if request.finished:
                tokens += request.num_tokens
    steady = [t for tenant, values in ttft.items() if tenant != FLOOD for t in values]
    flood = ttft.get(FLOOD, [])
    return {"scheduling": scheduling, "requests": len(steady) + len(flood),
            "steady_ttft_p50_ms": 1e3 * percentile(steady, 0.5), "steady_ttft_p99_ms": 1e3 * percentile(steady, 0.99),
            "flood_ttft_p99_ms": 1e3 * percentile(flood, 0.99) if flood else None,
            "tokens_per_s": tokens / busy, "step_ms": 1e3 * busy / num_steps,
            "preemptions": scheduler.num_preemptions, "busy_s": busy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--margin", type=float, default=512.0, help="FairQueue's margin (the engine: its token budget)")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--load", type=float, default=1.7)
    parser.add_argument("--steady-tenants", type=int, default=7)
    parser.add_argument("--flood-factor", type=float, default=10.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--decode-row-ms", type=float, default=0.08)
    parser.add_argument("--prompt-token-ms", type=float, default=0.025)
    parser.add_argument("--out", type=Path, default=Path("results/fairness_model"))
    args = parser.parse_args()
    costs = Costs(args.step_ms / 1e3, args.decode_row_ms / 1e3, args.prompt_token_ms / 1e3)
    traffic = Traffic(args.steady_tenants, args.flood_factor, args.duration,
                      Lengths(32_000, (32, 512), (16, 256)))  # benchmarks.fairness on CUDA

    def run(schedule: list[Arrival], scheduling: str) -> dict:
        return simulate(schedule, scheduling, costs, args.margin, args.max_batch_size, args.max_num_batched_tokens)

    full = traffic.full_queue(args.max_batch_size)
    requests_per_s = len(full) / run(full, "fcfs")["busy_s"]
    traffic = traffic.at_load(args.load, requests_per_s)
    rows = []
    for seed in args.seeds:
        results = {}
        for name, scheduling, flood in RUNS:
            schedule = traffic.schedule(flood, seed)
            results[name, scheduling] = run(schedule, scheduling)
            rows.append({"seed": seed, "run": name} | results[name, scheduling])
        baseline = results["no flood", "fair"]["steady_ttft_p99_ms"]
        fair, fcfs = results["flood", "fair"], results["flood", "fcfs"]
        print(f"seed {seed}: steady TTFT p99 with the flood / without: fair "
              f"{fair['steady_ttft_p99_ms'] / baseline:.2f}x, fcfs {fcfs['steady_ttft_p99_ms'] / baseline:.2f}x; "
              f"throughput fair / fcfs {fair['tokens_per_s'] / fcfs['tokens_per_s']:.3f}", flush=True)
    meta = {"capacity_requests_per_s": requests_per_s, "margin": args.margin, "duration_s": args.duration,
            "load": args.load, "steady_tenants": args.steady_tenants, "flood_factor": args.flood_factor,
            "step_ms": args.step_ms, "decode_row_ms": args.decode_row_ms, "prompt_token_ms": args.prompt_token_ms,
            "max_batch_size": args.max_batch_size, "max_num_batched_tokens": args.max_num_batched_tokens,
            "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "fairness_model", rows, meta)
    print(format_table(rows, ["seed", "run", "scheduling", "requests", "steady_ttft_p50_ms", "steady_ttft_p99_ms",
                              "flood_ttft_p99_ms", "tokens_per_s", "step_ms", "preemptions"]))


if __name__ == "__main__":
    main()
