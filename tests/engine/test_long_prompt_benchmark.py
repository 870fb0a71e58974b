"""benchmarks.long_prompt on the CPU: every step of a prompt's chunks is logged with the latency
budget's predictions, and the row's aggregates are those steps'."""

import itertools
import random
import statistics

import torch

from benchmarks.long_prompt import Clock, decodes_engine, run_mode
from punica.engine.step_cost import LatencyBudget


def test_each_chunk_step_of_the_prompt_is_logged():
    with decodes_engine("tiny", 2, 128, 32, torch.float32, "cpu") as (engine, config):
        clock = Clock(engine)
        engine.scheduler.chunked_prefill, engine.scheduler.max_num_batched_tokens = True, 32
        engine.scheduler.latency = LatencyBudget.of_executor(2.0, engine.executor)
        (row,) = run_mode(clock, "chunked", [128], 2, config.vocab_size, random.Random(0))
    steps = row["chunk_steps"]
    chunks = [s["chunk"] for s in steps]
    assert sum(chunks) == 128
    assert [s["prefix"] for s in steps] == list(itertools.accumulate([0] + chunks[:-1]))
    assert all(s["decodes"] == 2 and min(s["ms"], s["predicted_ms"], s["steady_ms"]) > 0 for s in steps)
    assert row["chunk_p50"] == statistics.median(chunks)
    assert row["over_predicted_p50"] == statistics.median(s["ms"] / s["predicted_ms"] for s in steps)
    assert row["over_budget_steady_max"] == max(s["ms"] / s["steady_ms"] for s in steps)
