"""`punica simulate`: run the simulator for each policy on one trace; write JSON, a table, and
(where matplotlib is installed) one PNG per policy."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from punica.cluster.placement import POLICIES
from punica.cluster.policy_config import PolicyConfig
from punica.cluster.simulator import SimConfig, Simulator
from punica.cluster.step_time import StepTimeModel, load_model
from punica.cluster.trace import fig13_trace

COLUMNS = ("policy", "gpu_hours", "throughput_tokens_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s",
           "ttft_p99_s", "num_evictions", "loads_per_1k_requests", "floor_loads_per_1k_requests", "sim_wall_s",
           "sim_cpu_s")
NO_PLOTS = "plots need matplotlib (pip install matplotlib); simulate.json holds every series they draw"


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def simulate(num_gpus: int, num_requests: int, duration_s: float, kv_tokens: int, policies: list[str],
             out_dir: Path, step_time: StepTimeModel | None = None, policy_config: PolicyConfig = PolicyConfig(),
             gpu_startup_s: float = 30.0, max_total: int = 2048, seed: int = 0, num_adapters: int | None = None,
             zipf_alpha: float = 1.5, host_tier_adapters: int = 48, plots: bool = True) -> list[dict]:
    """One result dict per policy; writes simulate.json and (`plots`, matplotlib installed) one
    PNG per policy, and returns the rows."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    step_time = step_time or load_model()
    trace = fig13_trace(num_requests, duration_s, seed=seed, max_total=max_total, num_adapters=num_adapters,
                        zipf_alpha=zipf_alpha)
    if max_total > kv_tokens:
        raise ValueError(f"a request may reach {max_total} tokens, more than one GPU's KV ({kv_tokens} tokens)")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in policies:
        config = SimConfig(num_gpus, kv_tokens, step_time, name, policy_config, gpu_startup_s,
                           host_tier_adapters=host_tier_adapters)
        result = Simulator(config, trace).run()
        if plots:
            plot(result, out_dir / f"simulate-{name}.png")
        results.append(result)
    meta = {"num_gpus": num_gpus, "num_requests": num_requests, "duration_s": duration_s,
            "kv_tokens": kv_tokens, "max_total": max_total, "seed": seed, "gpu_startup_s": gpu_startup_s,
            "num_adapters": num_adapters, "zipf_alpha": zipf_alpha, "host_tier_adapters": host_tier_adapters,
            "step_time": asdict(step_time), "policy_config": asdict(policy_config)}
    (out_dir / "simulate.json").write_text(json.dumps({"meta": meta, "results": results}))
    return results


def plot(result: dict, path: Path) -> None:
    """Three panels over time: request rate, throughput, and every GPU's batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, bin_s = result["series"], result["bin_s"]
    minutes = [i * bin_s / 60 for i in range(len(series["tokens"]))]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True, height_ratios=(1, 1, 2))
    axes[0].plot(minutes[:len(series["arrivals"])], [a / bin_s for a in series["arrivals"]])
    axes[0].set_ylabel("requests / s")
    axes[1].plot(minutes, [t / bin_s for t in series["tokens"]])
    axes[1].set_ylabel("tokens / s")
    batches = list(zip(*series["batch_sizes"]))  # [gpu][sample]
    cmap = matplotlib.colormaps["viridis"].with_extremes(under="white")
    image = axes[2].imshow(batches, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0,
                           extent=(0, len(series["batch_sizes"]) * bin_s / 60, len(batches), 0))
    fig.colorbar(image, ax=axes[2], orientation="horizontal", pad=0.15, label="batch size (white: GPU released)",
                 extend="min")
    axes[2].set_ylabel("GPU")
    axes[2].set_xlabel("minutes")
    axes[0].set_title(f"{result['policy']}: {result['num_requests']} requests on up to {result['num_gpus']} GPUs, "
                      f"{result['gpu_hours']:.0f} GPU-hours")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[dict]) -> str:
    rows = [COLUMNS] + [tuple(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS)
                        for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)
