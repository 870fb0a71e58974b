"""Where a step's GPU time goes: the engine's steps profiled kernel by kernel (torch.profiler; the
kernels of replayed CUDA graphs included), grouped by kind, for steady decode steps and for
steps that also run a chunk of a long prompt.

    python -m benchmarks.step_profile [--preset llama-2-7b] [--decodes 31] [--prompt 16384]
        [--budgets 158 512] [--at 0 2048 15000] [--steps 10] [--out results/step_profile]
    python -m benchmarks.step_profile --decode-only --batches 1 32 --context 512 [--steps 10]
    either with [--quantization fp8] [--kv-cache-dtype fp8] [--files 4] [--no-pdl]

One engine (random weights, CUDA graphs, overlapped steps, rank-16 adapters on all 7 projections,
request i on its own adapter) serves --decodes requests that decode from 64-token prompts. Per
budget (max_num_batched_tokens): --steps steady decode steps are profiled; then one --prompt-token
prompt (on one more adapter) is added and, when its cached tokens first reach each --at point,
the next --steps steps (decodes + one chunk each) are profiled.

With --decode-only, steady decode steps alone are profiled for each of --batches requests decoding
from --context-token prompts, once on distinct adapters and once on the base model, each kernel
listed with its launches per step.

Per profiled point: wall ms per step (host scheduling, the graph replay, sampling), GPU ms per step
(the sum of kernel durations), the GPU's idle time per step (no kernel running; the largest gaps
with the kernels around them), the host's time in CUDA synchronize calls per step (reading each
step's tokens waits for the step before it; any other wait stalls the overlap), the time per step
in which only LoRA's kernels run (no other kernel hides them: the step pays that time in full, what
the side stream's overlap with the GEMMs leaves), and each kernel group's us per step; and,
without --decode-only, the decodes' mean context as the point starts (their attention reads it,
and it grows a token a step while the prompt's chunks run). Writes step_profile.json under --out
and prints a table per point.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import format_table, save_figure, write_results
from benchmarks.long_prompt import decodes_engine
from punica.config import KV_CACHE_DTYPES, QUANTIZATIONS
from punica.engine.sampling_params import SamplingParams
from punica.ops import lora_triton

GROUPS = (  # first match wins
    ("attention, prefill", r"prefill_(kernel|merge)"),
    ("attention, decode", r"decode_(partition|merge)_kernel"),
    ("expert lora", r"_expert_(shrink|expand)"),
    ("lora shrink", r"shrink"),
    ("lora expand", r"expand"),
    ("rope + kv append", r"rope|write_kv"),
    ("rms norm", r"rms_norm"),
    ("activation", r"silu|gelu"),
    ("gemm, fp8", r"fp8|e4m3"),
    ("moe grouped gemm", r"grouped_gemm"),
    ("gemm", r"gemm|gemv|cutlass|nvjet|xmma|sm90|splitK|cublas"),
)


DECODING = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)  # requests that keep decoding


def group_of(kernel: str) -> str:
    return next((name for name, pattern in GROUPS if re.search(pattern, kernel)), "other")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: overlaps count once."""
    total, until = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, until))
        until = max(until, end)
    return total


def lora_alone_us(kernels: list[dict]) -> float:
    """Kernel time (trace units) during which only LoRA's kernels run (its shrink and expand groups,
    experts' included): the LoRA time no other kernel hides, which the step pays in full. Told
    apart by kernel name, not by stream: a replayed CUDA graph's kernels do not report the stream
    they were captured on."""
    def spans(events: list[dict]) -> list[tuple[float, float]]:
        return [(e["ts"], e["ts"] + e["dur"]) for e in events]
    others = [e for e in kernels if not is_lora(e["name"])]
    return busy_time(spans(kernels)) - busy_time(spans(others))


def is_lora(kernel: str) -> bool:
    return group_of(kernel) in ("lora shrink", "lora expand", "expert lora")


def profile_steps(engine, steps: int, trace_dir: Path) -> dict:
    """Run `steps` engine steps under torch.profiler: wall and kernel time per step, by group."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    path = trace_dir / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    by_group: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    waited = sum(e["dur"] for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"])
    for event in kernels:
        by_group[group_of(event["name"])] += event["dur"]
        by_kernel[event["name"][:80]] += event["dur"]
        launches[event["name"][:80]] += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:16]
    gaps, busy_until = [], kernels[0]["ts"] if kernels else 0.0
    for before, event in zip([None] + kernels, kernels):
        if before is not None and event["ts"] > busy_until:
            gaps.append((event["ts"] - busy_until, before["name"][:60], event["name"][:60]))
        busy_until = max(busy_until, event["ts"] + event["dur"])
    return {"wall_ms": 1e3 * wall / steps, "gpu_ms": sum(by_group.values()) / 1e3 / steps,
            "host_waits_ms": waited / 1e3 / steps, "launches_per_step": sum(launches.values()) / steps,
            "gpu_idle_ms": sum(g for g, _, _ in gaps) / 1e3 / steps,
            "lora_alone_ms": lora_alone_us(kernels) / 1e3 / steps,
            "largest_gaps_us": [{"us": g, "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:6]],
            "groups_us": {g: us / steps for g, us in sorted(by_group.items(), key=lambda kv: -kv[1])},
            "top_kernels_us": {k: us / steps for k, us in top},
            "top_kernels_launches": {k: launches[k] / steps for k, _ in top}}


def abort_all(engine, request_ids: list[str]) -> None:
    """Abort the requests and step until the engine has none left."""
    for rid in request_ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def profile_decodes(engine, config, batches: list[int], context: int, steps: int, trace_dir: Path,
                    rng: random.Random) -> list[dict]:
    """Steady decode steps of each batch size, on distinct adapters and on the base model."""
    rows = []
    for batch in batches:
        for adapters in ("distinct", "none"):
            ids = [engine.add_request([rng.randrange(3, config.vocab_size) for _ in range(context)], DECODING,
                                      f"lora{i}" if adapters == "distinct" else None)
                   for i in range(batch)]
            for _ in range(20):
                engine.step()
            rows.append({"batch": batch, "context": context, "adapters": adapters, "point": "decode",
                         **profile_steps(engine, steps, trace_dir)})
            abort_all(engine, ids)
    return rows


def mean_context(engine, request_ids: list[str]) -> float:
    """The requests' mean cached tokens: what their decode attention reads grows with it, step by step,
    while a prompt's chunks run beside them."""
    return statistics.fmean(engine.requests[rid].num_cached for rid in request_ids)


def profile_budgets(engine, config, args, trace_dir: Path, rng: random.Random) -> list[dict]:
    """Per step budget: steady decode steps of --decodes requests, then the steps that run chunks
    of one --prompt-token prompt beside them, from each --at point."""
    rows = []
    for budget in args.budgets:
        engine.scheduler.max_num_batched_tokens = budget
        ids = [engine.add_request([rng.randrange(3, config.vocab_size) for _ in range(64)], DECODING, f"lora{i}")
               for i in range(args.decodes)]
        for _ in range(20):
            engine.step()
        rows.append({"budget": budget, "point": "decode", "decode_context": mean_context(engine, ids),
                     **profile_steps(engine, args.steps, trace_dir)})
        long_id = engine.add_request([rng.randrange(3, config.vocab_size) for _ in range(args.prompt)],
                                     SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                     f"lora{args.decodes}")
        for at in args.at:
            while engine.requests[long_id].num_cached < at:
                engine.step()
            cached = engine.requests[long_id].num_cached
            context = mean_context(engine, ids)
            profile = profile_steps(engine, args.steps, trace_dir)
            chunk_tokens = (engine.requests[long_id].num_cached - cached) / args.steps
            rows.append({"budget": budget, "point": f"chunk after {cached}", "chunk_tokens": chunk_tokens,
                         "decode_context": context, **profile})
        abort_all(engine, ids + [long_id])
    return rows


def plot_decodes(rows: list[dict], path: Path, title: str) -> None:
    """--decode-only: each point's kernel time per step as a stack of kernel groups."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [name for name, _ in GROUPS] + ["other"]
    labels = [f"b{r['batch']} {r['adapters']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8.5, 4))
    bottom = [0.0] * len(rows)
    for group in groups:
        ms = [r["groups_us"].get(group, 0.0) / 1e3 for r in rows]
        if any(ms):
            ax.bar(labels, ms, bottom=bottom, label=group)
            bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_ylabel("kernel time per step (ms)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--decodes", type=int, default=31)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--budgets", type=int, nargs="+", default=[158, 512])
    parser.add_argument("--at", type=int, nargs="+", default=[0, 2048, 15000])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="of the base weights")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--files", type=int, help="adapter files behind the distinct names (default: one per name)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the LoRA kernels without programmatic dependent launch, so that each kernel's "
                             "profiled time is its own (with it, a kernel's time includes its wait for the one before)")
    parser.add_argument("--out", type=Path, default=Path("results/step_profile"))
    args = parser.parse_args()
    lora_triton.ENABLE_PDL = not args.no_pdl
    if args.decode_only and args.context > 1024:
        parser.error("--context: at most 1024 (the KV room per decode)")
    rng = random.Random(0)
    decodes = max(args.batches) if args.decode_only else args.decodes
    setup = decodes_engine(args.preset, decodes, args.prompt, args.budgets[0], torch.bfloat16, "cuda",
                           args.quantization, args.kv_cache_dtype, args.files)
    with setup as (engine, config), tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        if args.decode_only:
            engine.scheduler.max_num_batched_tokens = max(args.budgets[0], max(args.batches) * args.context)
            rows = profile_decodes(engine, config, args.batches, args.context, args.steps, trace_dir, rng)
        else:
            rows = profile_budgets(engine, config, args, trace_dir, rng)
    for row in rows:
        where = (f"batch {row['batch']}, context {row['context']}, {row['adapters']} adapters"
                 if args.decode_only else f"budget {row['budget']}")
        detail = f" ({row['chunk_tokens']:.0f} prompt tokens a step)" if "chunk_tokens" in row else ""
        if "decode_context" in row:
            detail += f", decodes at context {row['decode_context']:.0f}"
        print(f"{where}, {row['point']}{detail}: {row['launches_per_step']:.0f} kernels, "
              f"wall {row['wall_ms']:.2f} ms/step, GPU {row['gpu_ms']:.2f} ms/step, "
              f"idle {row['gpu_idle_ms']:.2f} ms/step, LoRA alone {row['lora_alone_ms']:.2f} ms/step, "
              f"host waiting on the device {row['host_waits_ms']:.2f} ms/step")
        for gap in row["largest_gaps_us"]:
            print(f"  gap {gap['us']:.0f} us after {gap['after']} before {gap['before']}")
        print(format_table([{"group": g, "us_per_step": us} for g, us in row["groups_us"].items()],
                           ["group", "us_per_step"]))
        print(format_table([{"kernel": k, "us_per_step": us, "launches": row["top_kernels_launches"][k]}
                            for k, us in row["top_kernels_us"].items()], ["kernel", "us_per_step", "launches"]))
    shape = ({"batches": args.batches, "context": args.context} if args.decode_only
             else {"decodes": args.decodes, "prompt": args.prompt})
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, **shape, "pdl": not args.no_pdl,
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    path = write_results(args.out, "step_profile", rows, meta)
    if args.decode_only:
        plot_decodes(rows, path.with_suffix(".png"),
                     f"{args.preset} decode steps at context {args.context}, kernel time by group, {meta['device']}")


if __name__ == "__main__":
    main()
