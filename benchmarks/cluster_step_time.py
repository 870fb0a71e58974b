"""The cluster simulator's GPU model, measured: step times of the real engine and adapter load times.

python -m benchmarks.cluster_step_time [--preset llama-2-7b] [--batches 32 1 16 8] [--prompts 2048 128 1024]
    [--mixed 64 1024] [--rank 16] [--budget-s 150] [--out DIR]

The engine (punica.factory.build_engine: --preset with random weights, bf16 and CUDA graphs on
CUDA, overlap_steps=False so each step() is one whole step, max batch = the largest --batches)
serves one distinct rank --rank adapter per request slot (all 7 projections; the names share
--files adapter files, the values do not change the work), all made resident before timing.
`measure` then runs every batch x prompt point without and with LoRA:
prefill steps, 4 decode-only steps, and one mixed step per --mixed prompt length; each step is
timed with the wall clock around engine.step() (which waits for the step's tokens). Points stop
starting once --budget-s seconds have passed since the script started; each sample is printed
and appended to samples.jsonl as it is taken. Then the adapter load time
(benchmarks.adapter_load.load_latency: a rank --rank adapter from the page-locked host tier
into a GPU slot, and its read from disk into the host tier). The fitted model
(punica.cluster.step_time.fit; steps over OUTLIER x the first fit are dropped as compilations
and the rest fitted again) goes to model.json (the simulator's format) and, with the samples and
each one's fit error, to cluster_step_time.json. --refit JSON fits again from such a file.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.adapter_load import load_latency
from benchmarks.common import format_table, save_figure, warm_up, write_results
from punica.cluster.step_time import Sample, fit, fit_errors
from punica.config import EngineArgs, preset_config
from punica.engine.sampling_params import SamplingParams
from punica.factory import build_engine
from punica.lora.dummy import save_random_adapter

OUTLIER = 3.0  # a step this many times slower than the fit is a compilation, not the steady state


def measure(engine, batch_sizes: Sequence[int] = (1, 8, 32), prompt_lens: Sequence[int] = (16, 128),
            mixed_prefills: Sequence[int] = (), adapters: Sequence[str] = (), num_decode_steps: int = 4,
            deadline: float | None = None, on_sample: Callable[[Sample], None] | None = None, seed: int = 0,
            clock: Callable[[], float] = time.perf_counter) -> list[Sample]:
    """Steps of a real engine (punica.engine.engine.Engine, built with overlap_steps=False so that
    each `step` runs and finishes one whole step) over a grid of batch x prompt length, each point
    without LoRA and, when `adapters` are given, with a distinct adapter per request (they must
    be resident already, or the first steps wait for loads). Per point: `batch` requests are
    prefilled (their prefill steps, and decodes beside later prefills, are samples), then
    `num_decode_steps` decode-only steps, then one mixed step per `mixed_prefills` entry (a new
    prompt of that many tokens beside the batch's decodes, while the batch has room); then every
    request is aborted. The first point runs once more before, unrecorded (warm-up). What a step
    ran is the engine's own record of it (`Engine.last_step`). Stops starting points at `deadline`
    (a `clock` time)."""
    if engine.overlaps_steps:
        raise ValueError("measure step times on an engine built with overlap_steps=False: an overlapped "
                         "step returns (and waits for) the step before it")
    max_batch = engine.config.max_batch_size
    needed = max(batch_sizes) + len(mixed_prefills)
    if adapters and len(adapters) < min(needed, max_batch):
        raise ValueError(f"distinct adapters for batches up to {min(needed, max_batch)} requests, got {len(adapters)}")
    rng = random.Random(seed)
    samples: list[Sample] = []
    modes = [False, True] if adapters else [False]
    grid = [(batch_sizes[0], prompt_lens[0], lora, False) for lora in modes]
    grid += [(b, p, lora, True) for b in batch_sizes for p in prompt_lens for lora in modes]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(engine.vocab_size) for _ in range(n)]

    def run_step(lora: bool, record: bool) -> bool:
        start = clock()
        engine.step()
        seconds = clock() - start
        shape = engine.last_step
        if shape is None:
            return False
        if record:
            sample = Sample(shape.num_requests, shape.num_context_tokens, shape.num_prefill_tokens, lora, seconds)
            samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
        return shape.num_prefill_tokens == 0

    for batch, prompt_len, lora, record in grid:
        if deadline is not None and clock() > deadline:
            break
        params = SamplingParams(max_tokens=max(1, engine.max_model_len - prompt_len), temperature=0, ignore_eos=True)
        ids = [engine.add_request(prompt(prompt_len), params, adapters[i] if lora else None) for i in range(batch)]
        decodes = 0
        while decodes < num_decode_steps and engine.has_unfinished():
            decodes += run_step(lora, record)
        for k, mixed in enumerate(mixed_prefills):
            if batch + k + 1 > max_batch:
                break
            one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            ids.append(engine.add_request(prompt(mixed), one, adapters[batch + k] if lora else None))
            run_step(lora, record)
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    return samples


def main() -> None:
    start = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    # the largest first: points stop at --budget-s, and the corners matter most to the fit
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 1, 16, 8])
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 128, 1024])
    parser.add_argument("--mixed", type=int, nargs="*", default=[64, 1024])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no grid point after this")
    parser.add_argument("--out", type=Path, default=Path("results/cluster_step_time"))
    parser.add_argument("--refit", type=Path, default=None, metavar="JSON",
                        help="measure nothing: fit again from this cluster_step_time.json")
    args = parser.parse_args()
    if args.refit is not None:
        refit(args.refit, args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset_config(args.preset)
    max_batch = max(args.batches)
    num_adapters = max_batch + len(args.mixed)
    longest = max(args.prompts) + max([0, *args.mixed])
    with tempfile.TemporaryDirectory() as tmp:
        files = [save_random_adapter(Path(tmp) / f"file{i}", config, args.rank, seed=i) for i in range(args.files)]
        names = {f"a{i}": str(files[i % len(files)]) for i in range(num_adapters)}
        engine_args = EngineArgs(model=args.preset, load_format="dummy", overlap_steps=False, max_batch_size=max_batch,
                                 max_loras=num_adapters, max_lora_rank=args.rank, max_model_len=longest + 256,
                                 kv_cache_tokens=max_batch * (max(args.prompts) + 64) + sum(args.mixed) + 1024)
        engine = build_engine(engine_args, names)
        print(f"engine built: {time.perf_counter() - start:.1f} s", flush=True)
        try:
            warm_up(engine, list(names)[:max_batch])
            warm_up(engine, list(names)[max_batch:])
            print(f"warmed up, {engine.adapters.num_loads} adapter loads: {time.perf_counter() - start:.1f} s",
                  flush=True)
            log = (args.out / "samples.jsonl").open("w")

            def on_sample(sample) -> None:
                line = json.dumps(sample._asdict())
                print(line, flush=True)
                log.write(line + "\n")
                log.flush()

            samples = measure(engine, args.batches, args.prompts, args.mixed, list(names), args.decode_steps,
                              deadline=start + args.budget_s, on_sample=on_sample)
        finally:
            engine.close()
        print(f"measured {len(samples)} steps: {time.perf_counter() - start:.1f} s", flush=True)
        latency = load_latency(config, args.rank, files[:1], device)
        print(json.dumps(latency), flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    dtype = "bf16" if device.type == "cuda" else "fp32"
    meta = {"device": device_name, "preset": args.preset, "rank": args.rank, "dtype": dtype,
            "cuda_graphs": device.type == "cuda", "batches": args.batches, "prompts": args.prompts,
            "mixed": args.mixed, "date": time.strftime("%Y-%m-%d"), "latency": latency,
            "seconds": time.perf_counter() - start, "torch": torch.__version__}
    report(samples, meta, args.out)


def report(samples: list[Sample], meta: dict, out: Path) -> None:
    """Fit, drop the steps slower than OUTLIER x their fitted time (a shape's first eager run
    compiles kernels), fit again; write model.json and cluster_step_time.json, print the errors."""
    def fitted(kept: list[Sample]):
        source = (f"{meta['device']}, {meta['preset']} random weights, {meta['dtype']} "
                  f"({'CUDA graphs' if meta['cuda_graphs'] else 'eager'}), rank-{meta['rank']} distinct adapters, "
                  f"{len(kept)} steps of benchmarks/cluster_step_time.py, {meta['date']}")
        return fit(kept, source, adapter_load_s=meta["latency"]["load_ms"] / 1e3,
                   adapter_read_s=meta["latency"]["disk_to_host_ms"] / 1e3)

    first = fitted(samples)
    outliers = [s.seconds > OUTLIER * first.seconds(s.batch, s.context, s.prefill, s.lora) for s in samples]
    model = fitted([s for s, slow in zip(samples, outliers) if not slow])
    model.to_json(out / "model.json")
    rows = [{**s._asdict(), "model_s": s.seconds * (1 + e), "error": e, "outlier": slow}
            for s, e, slow in zip(samples, fit_errors(model, samples), outliers)]
    kinds = {"decode": [r for r in rows if not r["prefill"] and not r["outlier"]],
             "prefill or mixed": [r for r in rows if r["prefill"] and not r["outlier"]]}
    summary = [{"steps": name, "lora": lora, "n": len(sel),
                "median_abs_error_pct": 100 * statistics.median(abs(r["error"]) for r in sel),
                "p90_abs_error_pct": 100 * sorted(abs(r["error"]) for r in sel)[int(0.9 * (len(sel) - 1))],
                "max_abs_error_pct": 100 * max(abs(r["error"]) for r in sel)}
               for name, part in kinds.items() for lora in (False, True)
               if (sel := [r for r in part if r["lora"] == lora])]
    meta = {**meta, "model": asdict(model), "fit_error": summary, "num_outliers": sum(outliers),
            "outlier_rule": f"measured > {OUTLIER} x the first fit; excluded from the fit and the errors"}
    write_results(out, "cluster_step_time", rows, meta)
    print(json.dumps(asdict(model)))
    print(f"{sum(outliers)} outliers excluded: " + ", ".join(
        f"{r['batch']} requests {r['prefill']} prefill tokens lora={r['lora']} {r['seconds']:.3f} s"
        for r in rows if r["outlier"]))
    print(format_table(summary, list(summary[0])))


def refit(path: Path, out: Path) -> None:
    """Fit again from a cluster_step_time.json (its samples and meta) into `out`."""
    data = json.loads(path.read_text())
    samples = [Sample(r["batch"], r["context"], r["prefill"], r["lora"], r["seconds"]) for r in data["rows"]]
    meta = {k: v for k, v in data["meta"].items() if k not in ("model", "fit_error", "num_outliers", "outlier_rule")}
    meta.setdefault("dtype", "bf16")
    meta.setdefault("cuda_graphs", meta["device"] != "cpu")
    out.mkdir(parents=True, exist_ok=True)
    report(samples, meta, out)
    plot_fit(json.loads((out / "cluster_step_time.json").read_text())["rows"], out / "cluster_step_time.png")


def plot_fit(rows: list[dict], path: Path) -> None:
    """Measured against fitted step time, decode and prefill/mixed steps, with and without LoRA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5))
    for prefill, lora, marker in ((False, False, "o"), (False, True, "x"), (True, False, "s"), (True, True, "+")):
        sel = [r for r in rows if bool(r["prefill"]) == prefill and r["lora"] == lora and not r["outlier"]]
        ax.scatter([1e3 * r["seconds"] for r in sel], [1e3 * r["model_s"] for r in sel], marker=marker, s=14,
                   label=f"{'prefill/mixed' if prefill else 'decode'}{', LoRA' if lora else ''}")
    lims = [4, 300]
    ax.plot(lims, lims, "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=lims, ylim=lims, xlabel="measured step (ms)", ylabel="model (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, "cluster step-time model vs the H200 engine (llama-2-7b, bf16)")

if __name__ == "__main__":
    main()
