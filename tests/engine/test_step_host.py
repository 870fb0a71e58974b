"""benchmarks.step_host on the CPU: its wrappers time the phases a step runs and leave every
method as it was."""

import random

import pytest

from benchmarks.step_host import PHASES, measure, timed_phases
from punica.config import EngineArgs, preset_config
from punica.factory import engine_on_model
from punica.models.loader import dummy_model


def test_measure_times_the_phases_and_restores_the_methods():
    config = preset_config("tiny")
    engine = engine_on_model(dummy_model(config), EngineArgs(model="tiny", max_batch_size=2).engine_config())
    before = [owner.__dict__[attr] for _, owner, attr in PHASES]
    row = measure(engine, batch=2, context=8, steps=3, vocab=config.vocab_size, rng=random.Random(0))
    assert [owner.__dict__[attr] for _, owner, attr in PHASES] == before
    assert row["batch"] == 2 and row["steps"] == 3 and row["step_us"] > 0
    for phase in ("poll", "schedule", "step_input", "sample", "update"):  # what a CPU step runs
        assert row[f"{phase}_us"] > 0, phase
    assert row["fill_us"] is None and row["replay_us"] is None and row["launch_us"] is None  # no graphs on a CPU
    assert not engine.has_unfinished()


def test_timed_phases_restores_after_an_error():
    before = [owner.__dict__[attr] for _, owner, attr in PHASES]
    with pytest.raises(RuntimeError, match="inside"), timed_phases({}, {}):
        assert [owner.__dict__[attr] for _, owner, attr in PHASES] != before
        raise RuntimeError("inside")
    assert [owner.__dict__[attr] for _, owner, attr in PHASES] == before
