"""benchmarks.sampler on the CPU: a row per batch and setting, its times measured."""

import json
import sys

from benchmarks import sampler


def test_sampler_benchmark_times_every_batch_and_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["sampler", "--batches", "1", "3", "--vocab", "64", "--repeat", "2",
                                      "--out", str(tmp_path)])
    sampler.main()
    rows = json.loads((tmp_path / "sampler.json").read_text())["rows"]
    assert [(r["batch"], r["setting"]) for r in rows] == [(b, s) for b in (1, 3) for s in sampler.SETTINGS]
    assert all(0 < r["host_ms"] <= r["step_ms"] for r in rows)
