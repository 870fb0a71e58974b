"""The /metrics counters fed from the engine's running totals advance by what is new since the
last update, whoever updates first (the engine thread after a step, or a scrape)."""

from prometheus_client import generate_latest

from punica.engine.stats import EngineStats
from punica.server.metrics import Metrics


class FakeEngine:
    def __init__(self):
        self.preemptions = self.chunked = 0

    def stats(self) -> EngineStats:
        return EngineStats(num_running=1, num_waiting=0, num_kv_pages=8, num_kv_pages_used=2, num_adapter_slots=2,
                           num_adapter_slots_used=1, num_adapter_slots_held=1, num_preemptions=self.preemptions,
                           num_chunked_steps=self.chunked)


def sample(metrics: Metrics, name: str) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_preemption_and_chunked_step_counters_follow_the_engine_totals():
    metrics, engine = Metrics(), FakeEngine()
    metrics.update_gauges(engine)
    assert sample(metrics, "punica_preemptions_total") == 0
    engine.preemptions, engine.chunked = 3, 2
    metrics.update_gauges(engine)
    metrics.update_gauges(engine)  # nothing new: no change
    assert sample(metrics, "punica_preemptions_total") == 3
    assert sample(metrics, "punica_chunked_prefill_steps_total") == 2
    engine.preemptions = 7
    metrics.update_gauges(engine)
    assert sample(metrics, "punica_preemptions_total") == 7
