"""step_time.measure on a real Engine whose executor costs a known time per step (on a fake clock):
the fitted model must recover that cost exactly, and overlapped engines are refused."""

import pytest
import torch

from punica.cluster.step_time import StepTimeModel, fit, measure
from punica.config import EngineConfig, ModelConfig
from punica.engine.engine import Engine
from punica.lora.pool import LoraPool

CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=8, max_position_embeddings=512)
COST = StepTimeModel(base=0.004, per_request=0.0005, per_context_token=2e-6, per_prefill_token=3e-5)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedExecutor:
    """Runs no model: each step advances the clock by COST of what the step holds, and returns zero logits."""
    can_feed_sampled = True

    def __init__(self, clock: Clock):
        self.clock = clock
        self.model_config = CONFIG
        self.num_pages = 1024
        self.adapter_slots = LoraPool(CONFIG, 1, 4, torch.float32, "cpu")
        self.steps = []

    def run(self, step):
        self.steps.append(step)
        self.clock.now += COST.seconds(step.num_requests, int(step.context_lens.sum()), step.num_prefill_tokens)
        return torch.zeros(step.num_requests, CONFIG.vocab_size)

    def keep_sampled(self, tokens):
        pass

    def close(self):
        pass


def test_measured_steps_fit_the_known_cost():
    clock = Clock()
    executor = CostedExecutor(clock)
    engine = Engine(executor, None, EngineConfig(max_batch_size=32, page_size=16, overlap_steps=False))
    samples = measure(engine, batch_sizes=(1, 8, 32), prompt_lens=(16, 128), clock=clock)
    assert len(samples) == 12  # a prefill and a decode step for each of the 6 grid points
    for batch, context, prefill, seconds in samples:
        assert seconds == pytest.approx(COST.seconds(batch, context, prefill), rel=1e-9)
    assert {prefill > 0 for *_, prefill, _ in samples} == {True, False}
    model = fit(samples, source="test")
    for name in ("base", "per_request", "per_context_token", "per_prefill_token"):
        assert getattr(model, name) == pytest.approx(getattr(COST, name), rel=1e-6), name


def test_measure_refuses_an_overlapped_engine():
    engine = Engine(CostedExecutor(Clock()), None, EngineConfig())
    with pytest.raises(ValueError, match="overlap_steps=False"):
        measure(engine)
