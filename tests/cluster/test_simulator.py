"""The simulator: exact timing on hand-checkable cases, token conservation under eviction,
the paper's finding (Punica needs fewer GPU-hours), and `punica simulate`'s files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from punica.cli import build_parser, main
from punica.cluster.policy_config import PolicyConfig
from punica.cluster.simulator import SimConfig, Simulator
from punica.cluster.step_time import Sample, StepTimeModel, fit
from punica.cluster.trace import Trace, fig13_trace

FLAT = StepTimeModel(base=0.1, per_request=0.0, per_context_token=0.0, per_prefill_token=0.0)
GROWING = StepTimeModel(base=0.02, per_request=0.001, per_context_token=1e-6, per_prefill_token=2e-5)


def run(trace, policy="punica", num_gpus=2, kv_tokens=4096, model=GROWING, **config):
    policy_config = PolicyConfig(**({"max_batch_size": 8, "light_load_batch": 4} | config))
    return Simulator(SimConfig(num_gpus, kv_tokens, model, policy, policy_config, gpu_startup_s=5.0), trace).run()


def test_lone_requests_take_output_len_steps():
    trace = Trace([0.0, 100.0], [5, 7], [10, 3], [0, 1], duration_s=200.0)
    result = run(trace, model=FLAT)
    assert result["latency_p50_s"] == pytest.approx(0.3) and result["latency_p99_s"] == pytest.approx(1.0)
    assert result["ttft_p50_s"] == pytest.approx(0.1)
    assert result["makespan_s"] == pytest.approx(100.3)


def test_a_request_joining_mid_step_is_charged_its_prefill_and_context():
    trace = Trace([0.0, 0.05], [100, 50], [4, 2], [0, 0], duration_s=1.0)
    model = StepTimeModel(base=0.1, per_request=0.01, per_context_token=0.001, per_prefill_token=0.002)
    result = run(trace, model=model)
    joint = 0.1 + 0.02 + 0.001 * (101 + 51) + 0.002 * 150   # the second joins the step in flight
    assert result["ttft_p50_s"] == pytest.approx(joint - 0.05) and result["ttft_p99_s"] == pytest.approx(joint)
    second = 0.1 + 0.02 + 0.001 * (102 + 52)                   # both decode, context one token longer
    assert result["latency_p50_s"] == pytest.approx(joint + second - 0.05)


@pytest.mark.parametrize("policy", ["punica", "round-robin", "least-loaded"])
def test_every_token_is_generated_once_even_with_evictions(policy):
    trace = fig13_trace(400, duration_s=300.0, seed=1, max_total=512)
    result = run(trace, policy, num_gpus=4, kv_tokens=1024)
    assert result["num_evictions"] > 0
    assert sum(result["series"]["tokens"]) == sum(trace.output_lens) == result["output_tokens"]
    assert sum(result["series"]["arrivals"]) == len(trace)
    assert result["ttft_p50_s"] <= result["ttft_p99_s"] <= result["latency_p99_s"]  # every request has both
    for sample in result["series"]["batch_sizes"]:
        assert max(sample) <= 8


def test_punica_packs_gpus_and_needs_fewer_gpu_hours():
    trace = fig13_trace(3000, duration_s=1200.0, seed=2, max_total=512)
    results = {p: run(trace, p, num_gpus=12, idle_release_s=30.0) for p in ("punica", "round-robin", "least-loaded")}
    assert results["punica"]["gpu_hours"] < 0.9 * min(r["gpu_hours"] for p, r in results.items() if p != "punica")
    mean_busy_batch = {}
    for policy, result in results.items():
        busy = [b for sample in result["series"]["batch_sizes"] for b in sample if b > 0]
        mean_busy_batch[policy] = sum(busy) / len(busy)
    # GPUs run near max batch or idle
    assert mean_busy_batch["punica"] > 1.5 * max(mean_busy_batch["round-robin"], mean_busy_batch["least-loaded"])


def test_fit_recovers_coefficients():
    truth = StepTimeModel(0.01, 0.002, 3e-6, 5e-5)
    samples = [Sample(b, c, p, False, truth.seconds(b, c, p))
               for b in (1, 4, 16) for c in (100, 5000) for p in (0, 300)]
    got = fit(samples, "synthetic")
    assert got.base == pytest.approx(0.01) and got.per_request == pytest.approx(0.002)
    assert got.per_context_token == pytest.approx(3e-6) and got.per_prefill_token == pytest.approx(5e-5)


def test_punica_simulate_writes_json_and_pngs(tmp_path, capsys):
    GROWING.to_json(tmp_path / "step.json")
    out = tmp_path / "sim"
    assert main(["simulate", "--gpus", "3", "--requests", "200", "--duration", "120", "--max-total", "256",
                 "--kv-tokens", "4096", "--step-time", str(tmp_path / "step.json"), "--out", str(out)]) == 0
    data = json.loads((out / "simulate.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["punica", "adapter-aware", "round-robin", "least-loaded"]
    assert data["meta"]["step_time"]["base"] == GROWING.base
    for policy in ("punica", "adapter-aware", "round-robin", "least-loaded"):
        assert (out / f"simulate-{policy}.png").stat().st_size > 10_000
    header = capsys.readouterr().out.splitlines()[0]
    assert "gpu_hours" in header and "loads_per_1k_requests" in header and "floor_loads_per_1k_requests" in header


def test_simulate_defaults_are_the_fig13_setting_on_the_gpu_model():
    args = build_parser().parse_args(["simulate", "--out", "x"])
    assert (args.gpus, args.duration, args.zipf_alpha, args.step_time) == (16, 3600.0, 1.5, "h200-llama-2-7b")
    assert args.policy == ["punica", "adapter-aware", "round-robin", "least-loaded"]


def test_simulate_without_matplotlib_writes_json_and_says_how_to_get_plots(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from punica.cli import main; "
            f"sys.exit(main(['simulate', '--gpus', '2', '--requests', '50', '--duration', '60', '--max-total', '128', "
            f"'--policy', 'punica', 'adapter-aware', '--out', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "pip install matplotlib" in done.stdout
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert [r["policy"] for r in data["results"]] == ["punica", "adapter-aware"]
    assert not list(tmp_path.glob("*.png"))


def test_a_request_that_outgrows_every_gpu_is_rejected_and_the_rest_are_served():
    trace = Trace([0.0, 1.0, 2.0], [100, 4000, 50], [10, 200, 5], [0, 0, 1], duration_s=10.0)
    result = run(trace, kv_tokens=4096)
    assert result["num_rejected"] == 1 and result["output_tokens"] == 15 == sum(result["series"]["tokens"])


def test_requests_that_can_never_be_placed_end_the_run_with_an_error():
    trace = Trace([0.0, 1.0], [100, 50], [10, 5], [0, 1], duration_s=10.0)
    sim = Simulator(SimConfig(2, 4096, GROWING, "punica", PolicyConfig(8, 4), gpu_startup_s=5.0), trace)
    sim.policy._candidates = lambda request: iter(())   # no GPU ever qualifies
    with pytest.raises(RuntimeError, match="2 requests can never be placed"):
        sim.run()


def test_the_spread_cap_finishes_with_one_try_per_held_adapter_not_per_held_request():
    trace = fig13_trace(1500, duration_s=300.0, seed=4, max_total=512, num_adapters=200, zipf_alpha=1.1)
    policy_config = PolicyConfig(max_batch_size=8, light_load_batch=4, max_loras=8, max_gpus_per_adapter=1)
    sim = Simulator(SimConfig(4, 8192, GROWING, "adapter-aware", policy_config, gpu_startup_s=5.0), trace)
    tries = []
    choose = sim.policy._choose
    sim.policy._choose = lambda request: tries.append(1) or choose(request)
    result = sim.run()
    assert result["output_tokens"] == sum(trace.output_lens) == sum(result["series"]["tokens"])
    assert len(tries) < 40 * len(trace), len(tries)   # 360 per request when each schedule tried every held one
