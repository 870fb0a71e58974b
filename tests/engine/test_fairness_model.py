"""The fair share's goal at the level of the scheduler (benchmarks.fairness_model: the real scheduler
and queues, each step's time from a cost model, so no clock is read): one tenant flooding at 10x the
rate of seven steady ones, at 1.7x the capacity, leaves the steady tenants' TTFT p99 within 1.5x of
their p99 without the flood under fair share, where FCFS makes it many times longer, at the same
throughput."""

from benchmarks.fairness import Lengths, Traffic
from benchmarks.fairness_model import Costs, simulate

COSTS = Costs(5e-3, 0.08e-3, 0.025e-3)
TRAFFIC = Traffic(steady_tenants=7, flood_factor=10.0, duration=20.0, lengths=Lengths(32_000, (32, 512), (16, 256)))


def run(schedule, scheduling):
    return simulate(schedule, scheduling, COSTS, margin=512, max_batch_size=32, budget=512)


def test_fair_share_keeps_the_steady_tenants_first_tokens_under_a_flood():
    full = TRAFFIC.full_queue(32)
    traffic = TRAFFIC.at_load(1.7, len(full) / run(full, "fcfs")["busy_s"])
    alone = run(traffic.schedule(flood=False, seed=1), "fair")
    flooded = traffic.schedule(flood=True, seed=1)
    fair, fcfs = run(flooded, "fair"), run(flooded, "fcfs")
    assert fair["preemptions"] > 0
    assert fair["steady_ttft_p99_ms"] < 1.5 * alone["steady_ttft_p99_ms"]
    assert fcfs["steady_ttft_p99_ms"] > 10 * alone["steady_ttft_p99_ms"]
    assert fair["tokens_per_s"] > 0.97 * fcfs["tokens_per_s"]
