"""The latency budget's start-up calibration (punica.engine.calibration): the shapes it runs fit the
engine's limits and are timed as served steps are, it stops at its deadline, learns each shape's
settled run, and leaves nothing behind that a request could see."""

import pytest
import torch

from punica.engine import calibration
from punica.engine.calibration import calibrate, features, shapes, step_input
from punica.engine.executor import LocalExecutor
from punica.engine.sampling_params import SamplingParams
from punica.engine.step_cost import LatencyBudget, StepFeatures

LIMITS = [  # (max_batch_size, max_num_batched_tokens, min_chunk, num_pages, page_size, max_context)
    (32, 512, 8, 4096, 16, 8192),   # the defaults, roughly
    (4, 256, 8, 40, 16, 640),       # a small cache: the long shapes shrink
    (2, 16, 8, 8, 4, 32),           # no room for a long context
]


@pytest.mark.parametrize("limits", LIMITS)
def test_shapes_fit_the_engines_limits_cheapest_first(limits):
    max_batch_size, max_tokens, min_chunk, num_pages, page_size, max_context = limits
    steps = shapes(*limits)
    if max_context <= calibration.SHORT:  # not even a short decode fits: no calibration
        assert steps == []
        return
    assert steps[0] == ((calibration.SHORT,), 0, 0)
    for contexts, chunk, position in steps:
        assert len(contexts) + (chunk > 0) <= max_batch_size and len(contexts) + chunk <= max_tokens
        pages = sum(-(-(c + 1) // page_size) for c in contexts) + -(-(position + chunk) // page_size)
        assert pages <= num_pages and max(max(contexts) + 1, position + chunk) <= max_context
    chunks = [shape for shape in steps if shape[1]]
    assert all(a[1] <= b[1] for a, b in zip(chunks, chunks[1:]))  # within each kind, cheapest first
    if limits == LIMITS[0]:
        assert {(chunk, position) for _, chunk, position in chunks} == {
            (c, p) for c in (8, 64, 511) for p in (0, calibration.LONG)}


@pytest.mark.parametrize("shape", shapes(*LIMITS[0]))
def test_a_shapes_step_is_what_its_features_say(shape):
    """The step run and the features learned describe the same step (as StepFeatures.of does a plan's)."""
    step, f = step_input(shape, 16), features(shape)
    contexts, chunk, _ = shape
    assert step.num_requests == f.rows and step.num_prefill_tokens == f.prompt_tokens == chunk
    assert step.num_decodes == f.num_decodes == len(contexts)
    assert int(step.context_lens.sum()) == f.keys
    if not chunk:
        assert f == StepFeatures.decodes(list(contexts))


class FakeExecutor:
    """Runs nothing: each run advances the clock by a known cost, plus a one-time cost the first
    time it sees a step's shape."""

    def __init__(self, clock):
        self.clock, self.seen, self.runs = clock, set(), 0

    def cost(self, step):
        return 0.1 + 0.001 * step.num_prefill_tokens

    def run(self, step):
        self.runs += 1
        key = (step.num_requests, step.num_prefill_tokens, int(step.context_lens.sum()))
        self.clock.now += self.cost(step) + (5.0 if key not in self.seen else 0.0)
        self.seen.add(key)
        return torch.zeros(step.num_requests, 8)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_calibration_learns_settled_runs_and_stops_at_its_deadline(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("punica.engine.core.step_clock", clock)
    monkeypatch.setattr(calibration, "CALIBRATION_S", 12.0)
    executor, budget, seen = FakeExecutor(clock), LatencyBudget(2.0), []
    monkeypatch.setattr(budget, "observe", lambda f, seconds: seen.append((f, seconds)))
    steps = shapes(*LIMITS[0])
    learned = calibrate(executor, budget, steps, 16)
    # a shape's first run pays 5 s more; its second (0.1 s against 5.1) is still falling, its third
    # (0.1 against 0.1) has settled and is learned. A shape takes 5.3 s: the third starts at 10.6,
    # the fourth would at 15.9
    assert learned == len(seen) == executor.runs // 3 == 3
    for (f, seconds), shape in zip(seen, steps):
        assert f == features(shape) and seconds == pytest.approx(0.1 + 0.001 * shape[1])
    monkeypatch.setattr(calibration, "CALIBRATION_S", 0.0)
    assert calibrate(executor, budget, steps, 16) == 0


def test_a_calibrated_engine_serves_what_an_uncalibrated_one_does(setup, make_engine, monkeypatch, run_all, workload):
    """The calibration steps write placeholder keys and values into free pages: with the prefix cache
    on, every page free and nothing cached after start-up, and the same greedy tokens after."""
    clock = Clock()

    def timed_run(executor, step, run=LocalExecutor.run):
        clock.now += 0.01 + 0.0001 * step.num_prefill_tokens
        return run(executor, step)

    monkeypatch.setattr(LocalExecutor, "run", timed_run)
    monkeypatch.setattr("punica.engine.core.step_clock", clock)
    outputs = {}
    for seconds in (0.0, 100.0):
        monkeypatch.setattr(calibration, "CALIBRATION_S", seconds)
        engine = make_engine(setup, max_batch_size=4, max_num_batched_tokens=64, max_itl_ratio=2.0,
                             prefix_caching=True)
        assert (engine.scheduler.latency.model.num_observed > 0) == bool(seconds)
        assert engine.allocator.num_free == engine.executor.num_pages and engine.allocator.num_cached == 0
        requests = workload(8, seed=3)
        outputs[seconds] = [o.token_ids for o in run_all(engine, requests, lambda n: SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True))]
    assert outputs[0.0] == outputs[100.0]
