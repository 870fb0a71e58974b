"""The benchmark's measurement loop (benchmarks.cluster_step_time.measure) on a real Engine whose
executor costs a known time per step (on a fake clock): the fitted model must recover that cost
exactly, and overlapped engines are refused; the shipped models load by name, and a JSON file with
a misspelt field is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cluster_step_time import measure
from punica.cluster.step_time import CPU_SMOLLM2, DEFAULT_MODEL, Sample, StepTimeModel, fit, load_model
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
    device = torch.device("cpu")
    chunk_sizes = row_sizes = ()
    query_tile = 1

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
    # whole prompts, one prefill step per point (32 x 128 tokens): the sample count below depends on it
    engine = Engine(executor, None, EngineConfig(max_batch_size=32, page_size=16, overlap_steps=False,
                                                 chunked_prefill=False, max_num_batched_tokens=4096))
    samples = measure(engine, batch_sizes=(1, 8, 32), prompt_lens=(16, 128), mixed_prefills=(40,), clock=clock)
    # per point: its prefill step(s), 4 decodes, and a mixed step where the batch has room (not at 32)
    assert len(samples) == 6 * 5 + 4
    for batch, context, prefill, lora, seconds in samples:
        assert not lora
        assert seconds == pytest.approx(COST.seconds(batch, context, prefill), rel=1e-9)
    mixed = [s for s in samples if s.prefill == 40]
    assert [s.batch for s in mixed] == [2, 2, 9, 9]
    assert all(s.context > 40 for s in mixed)  # beside the batch's decodes
    model = fit(samples, source="test")
    for name in ("base", "per_request", "per_context_token", "per_prefill_token"):
        assert getattr(model, name) == pytest.approx(getattr(COST, name), rel=1e-6), name
    assert model.lora_base == model.lora_per_request == model.lora_per_prefill_token == 0
    assert not engine.has_unfinished()


def test_measure_stops_at_the_deadline():
    clock = Clock()
    engine = Engine(CostedExecutor(clock), None, EngineConfig(max_batch_size=32, page_size=16, overlap_steps=False))
    assert measure(engine, batch_sizes=(1, 8), prompt_lens=(16,), deadline=-1.0, clock=clock) == []


def test_fit_separates_the_lora_terms():
    truth = StepTimeModel(0.005, 2e-5, 1.3e-7, 2e-5, lora_base=5e-4, lora_per_request=2e-5, lora_per_prefill_token=4e-6)
    samples = [Sample(b, c, p, lora, truth.seconds(b, c, p, lora))
               for b in (1, 8, 32) for c in (100, 30000) for p in (0, 1000) for lora in (False, True)]
    got = fit(samples, "synthetic", adapter_load_s=0.0015)
    for name in ("base", "per_request", "per_context_token", "per_prefill_token", "lora_base", "lora_per_request",
                 "lora_per_prefill_token"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert got.adapter_load_s == 0.0015


def test_models_load_by_name_or_file(tmp_path):
    gpu = load_model(DEFAULT_MODEL)
    assert "H200" in gpu.source and gpu.adapter_load_s > 0 and gpu.lora_base > 0
    assert gpu.seconds(32, 32 * 1024) < 0.02  # a 7B decode step at batch 32: milliseconds
    assert load_model("cpu-smollm2") == CPU_SMOLLM2
    CPU_SMOLLM2.to_json(tmp_path / "m.json")
    assert load_model(str(tmp_path / "m.json")) == CPU_SMOLLM2
    (tmp_path / "bad.json").write_text('{"base": 1, "per_request": 0, "per_context_token": 0, '
                                       '"per_prefill_token": 0, "per_requests": 1}')
    with pytest.raises(ValueError, match="per_requests"):
        load_model(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="neither a model name"):
        load_model("h100-llama")


def test_measure_refuses_an_overlapped_engine():
    engine = Engine(CostedExecutor(Clock()), None, EngineConfig(overlap_steps=True))
    with pytest.raises(ValueError, match="overlap_steps=False"):
        measure(engine)


@pytest.mark.slow
def test_the_benchmark_measures_fits_and_writes_a_loadable_model(tmp_path):
    command = [sys.executable, "-m", "benchmarks.cluster_step_time", "--preset", "tiny", "--batches", "4", "1",
               "--prompts", "32", "8", "--mixed", "8", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    model = load_model(str(tmp_path / "model.json"))
    # measured on a shared machine: the intercept alone may fit to 0, a one-request step never does
    assert model.base + model.per_request > 0 and model.adapter_load_s > 0 and model.adapter_read_s > 0
    data = json.loads((tmp_path / "cluster_step_time.json").read_text())
    assert {r["lora"] for r in data["rows"]} == {False, True}
    assert any(r["prefill"] and r["batch"] > 1 and r["context"] > r["prefill"] for r in data["rows"])  # mixed
    assert data["meta"]["fit_error"] and (tmp_path / "samples.jsonl").read_text().count("\n") == len(data["rows"])
