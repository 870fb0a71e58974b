"""Text generation throughput (the paper's Fig. 11): the engine on a model shape with random
weights, rank-r adapters on all 7 projections, the four popularity workloads and the backbone,
against HuggingFace transformers + PEFT.

python -m benchmarks.textgen [--preset llama-2-7b] [--requests 64] [--max-total 2048]
    [--workloads backbone distinct ...] [--hf-requests 32] [--hf-max-total 256] [--skip-hf]
    [--tensor-parallel-size 1] [--enforce-eager] [--no-overlap-steps] [--dora] [--quantizations none fp8 fp8+fp8kv]

Requests follow the paper's generator (prompt ~ lognorm(0.8, -1, 18), total ~ uniform up to
--max-total, fixed seed), FCFS, max batch 32, greedy with ignore_eos so every request runs its
full length. Throughput = (prompt + generated tokens) / wall time; also mean and p99 time to
first token and time per output token. On one GPU, for models without experts, each row also has
the run's memory floor as a throughput (`floor_tokens_per_s`, `floor_seconds`: its steps' weights
and KV cache at the copy bandwidth) and `of_floor`, the row's share of it. Workload "distinct"
gives request i adapter i (one adapter per request); the adapters' values come from --files files
(values do not change the work; each name still gets its own GPU slot and copy). The engines have
one GPU slot per request while those fit in --max-lora-bytes (48 GiB by default), and every adapter
of the workload is loaded before the clock starts (on-demand loading is benchmarks/adapter_load.py's
question). Where they do not fit (a MoE preset's adapters adapt every expert: ~1.3 GB each on
qwen3-30b-a3b), the first adapters the run uses are loaded before the clock starts, as many as the
slots hold, and the others load on demand during the run, as a server's would; `adapter_slots` in
the meta says how many slots there were. Each row counts the adapter reads (disk -> host tier) and
copies (host tier -> GPU slot) during its run, with their mean seconds from start to taken in by the
engine.

The JSON (--out) is written again after every run, so a run stopped midway (a time limit) leaves the
rows of the runs that finished.

--quantizations: the engine's runs (every workload) once per format, on the same dummy weights:
base weights none (the dtype's) or fp8 (e4m3, per-channel scales: punica.models.quantized), and
with "+fp8kv" an fp8 KV cache (punica.ops.kv_cache; the same --kv-cache-tokens); rows say which
(`quantization`). The HF+PEFT baseline runs in the dtype.

--dora: every adapter workload runs twice on the same model, with plain LoRA adapters and then
with DoRA adapters of the same A and B plus random magnitudes (punica.lora.dummy); rows say which
(`adapters`). The HF+PEFT baseline is plain LoRA.

--tensor-parallel-size N > 1: the engine under test is the tensor-parallel one
(punica.parallel.executor, N processes, rank r on cuda:r; gloo on CPU), each rank generating only
its shard of the dummy weights (a Llama-2-70B in bf16 never exists whole on one GPU or in host
memory). One such engine, with all adapter names registered, runs every workload in turn (a
fresh group per workload would rebuild the model each time); the pages of one workload are all
free before the next. The HF+PEFT baseline is skipped (it runs on one device).

HF+PEFT baseline (unless --skip-hf, and for Llama presets only; for backbone, distinct and
identical among --workloads): transformers' LlamaForCausalLM of the same shape with its own
random init (N(0, 0.02) weights like the engine's dummy model; bf16 on CUDA, fp32 on CPU; SDPA
attention), PEFT LoRA of rank --rank on all 7 projections (adapters in the model's dtype:
autocast_adapter_dtype=False),
`generate` greedy in static batches of 32 left-padded prompts, each batch running to its
longest output. distinct: PEFT's mixed-batch `adapter_names`, request i adapter i; identical:
one active adapter (PEFT's single-adapter path); backbone: the model before PEFT wraps it.
Its requests are --hf-requests fresh ones from the same generator with totals up to
--hf-max-total (default 256, shorter than the engine's: HF's step time grows with context, so
its throughput here is, if anything, higher than it would be on the engine's requests).
Throughput counts each request's prompt + requested output tokens (not the extra tokens a
static batch generates past them) over the wall time of all batches, after one 2-token
warm-up batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (
    FORMATS,
    copy_bandwidth,
    format_fields,
    format_label,
    format_table,
    percentile,
    warm_up,
    write_results,
)
from benchmarks.roofline import weight_bytes
from benchmarks.textgen_hf import HF_BATCH, hf_baseline
from punica.config import EngineArgs, EngineConfig, ModelConfig, preset_config
from punica.engine.engine import Engine
from punica.engine.runner import kv_bytes_per_token
from punica.engine.sampling_params import SamplingParams
from punica.factory import build_engine, engine_on_model
from punica.flags import add_arguments, from_arguments
from punica.lora.dummy import save_random_adapter
from punica.lora.pool import pool_slots
from punica.models.loader import dummy_model
from punica.parallel.tensor_parallel import rank_config
from punica.workloads import WORKLOADS, adapter_ids, textgen_lengths


def serve_all(engine: Engine, requests: list[tuple[list[int], int, str | None]],
              temperature: float = 0.0, top_p: float = 1.0) -> tuple[list, float]:
    """Run requests (prompt, output length, adapter) to completion, sampling at `temperature` (0:
    greedy) and `top_p`: (outputs, wall seconds)."""
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=temperature, top_p=top_p,
                                                     ignore_eos=True), adapter)
           for prompt, out, adapter in requests]
    finished = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for outputs in engine.steps():
        finished.update((o.request_id, o) for o in outputs if o.finished)
    return [finished[i] for i in ids], time.perf_counter() - start


def run(engine: Engine, requests: list[tuple[list[int], int, str | None]], **sampling: float) -> dict:
    outs, seconds = serve_all(engine, requests, **sampling)
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    ttft = [o.time_to_first_token for o in outs]
    tpot = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    return {"requests": len(outs), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "tpot_mean_ms": 1e3 * statistics.mean(tpot), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99)}


def floor_seconds(lengths: list[tuple[int, int]], weights: int, kv_per_token: int, bandwidth: float,
                  max_batch: int = EngineConfig.max_batch_size) -> float:
    """The run's memory floor: (prompt, output) lengths scheduled first come, first served, at most
    max_batch requests at a time, each step computing one token of every running request (a request's
    first step its prompt and first token), each step reading the `weights` bytes once and every
    running request's cached K and V (`kv_per_token` bytes a token), over `bandwidth` bytes per
    second. Adapters and compute are left out."""
    queue, running, steps, keys = list(lengths), [], 0, 0
    while queue or running:
        while queue and len(running) < max_batch:
            prompt, output = queue.pop(0)
            running.append([prompt, output])
        steps += 1
        keys += sum(context for context, _ in running)
        running = [[context + 1, left - 1] for context, left in running if left > 1]
    return (steps * weights + keys * kv_per_token) / bandwidth


def adapter_loads(engine: Engine) -> dict[str, tuple[int, float]]:
    """Per tier ("host": reads from disk, "gpu": copies into slots), the loads so far and their
    seconds from start to taken in, summed over the engine's adapters (its residency counters)."""
    adapters = engine.adapter_snapshot()["adapters"].values()
    return {tier: (sum(a["loads"][tier] for a in adapters), sum(a["load_seconds"][tier] for a in adapters))
            for tier in ("host", "gpu")}


def loads_between(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> dict:
    """The adapter reads and copies between two `adapter_loads`, with their mean seconds (None: none)."""
    row = {}
    for tier, count, mean in (("host", "reads", "read_s_mean"), ("gpu", "copies", "copy_s_mean")):
        n, seconds = after[tier][0] - before[tier][0], after[tier][1] - before[tier][1]
        row[count], row[mean] = n, (round(seconds / n, 4) if n else None)
    return row


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(row: dict) -> str:
        return row["workload"] + (" (DoRA)" if row.get("adapters") == "dora" else "") + (
            f" {row['quantization']}" if row.get("quantization", "none") != "none" else "")

    workloads = list(dict.fromkeys(label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for k, system in enumerate(("punica", "hf+peft")):
        value = {label(r): r["tokens_per_s"] for r in rows if r["system"] == system}
        ax.bar([i + 0.4 * k for i in range(len(workloads))], [value.get(w, 0) for w in workloads], 0.4,
               label=system)
    ax.set_xticks([i + 0.2 for i in range(len(workloads))], workloads)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (prompt + generated)")
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def engine_runs(engine_args: EngineArgs, config: ModelConfig, dtype: torch.dtype, device: str,
                runs: list[tuple[str, str]], names: dict[str, dict[str, str]], prompts: list[list[int]],
                lengths: list[tuple[int, int]], rows: list[dict], finished: Callable[[], None],
                bandwidth: float | None = None, **sampling: float) -> None:
    """Append to `rows` the engine's row of every (workload, adapter kind) run on one model (one
    tensor-parallel engine with all names registered, or one model in this process under an engine
    per run), calling `finished` after each. With `bandwidth` (given on one GPU for models without
    experts), each row's floor_tokens_per_s: its tokens over floor_seconds of this model's weights
    and KV cache, and of_floor, its tokens per second over that. `sampling`: serve_all's
    temperature and top_p."""
    tp, num_requests = engine_args.tensor_parallel_size, len(prompts)
    quantization = format_label(engine_args.quantization, engine_args.kv_cache_dtype)
    model = dummy_model(config, dtype, device, quantization=engine_args.quantization) if tp == 1 else None
    floor = None
    if bandwidth:
        floor = floor_seconds(lengths, weight_bytes(model, 1), kv_bytes_per_token(model, engine_args.kv_cache_dtype),
                              bandwidth)
    if tp > 1:
        parallel_engine = build_engine(engine_args, names["lora"])
    try:
        for workload, kind in runs:
            if tp > 1:
                engine = parallel_engine
            else:
                engine = engine_on_model(model, engine_args.engine_config(),
                                         None if workload == "backbone" else names[kind])
            if workload == "backbone":
                adapters = [None] * num_requests
            else:
                adapters = [f"{kind}{i}" for i in adapter_ids(workload, num_requests, random.Random(1))]
            # the workload's adapters in first-use order, as many as the slots hold (the rest load
            # during the run)
            slots = engine.adapter_snapshot()["gpu_slots"]["total"]
            warm_up(engine, list(dict.fromkeys(adapters))[:slots] if workload != "backbone" else [None] * 32)
            before = adapter_loads(engine)
            rows.append({"system": "punica", "workload": workload, "adapters": kind if adapters[0] else "none",
                         "quantization": quantization,
                         **run(engine, [(p, o, a) for p, (_, o), a in zip(prompts, lengths, adapters)], **sampling)})
            rows[-1].update(loads_between(before, adapter_loads(engine)))
            if floor:
                rows[-1]["floor_tokens_per_s"] = rows[-1]["tokens"] / floor
                rows[-1]["of_floor"] = rows[-1]["tokens_per_s"] / rows[-1]["floor_tokens_per_s"]
            print(f"punica {workload} ({rows[-1]['adapters']}, {quantization}): "
                  f"{rows[-1]['tokens_per_s']:.1f} tokens/s; during the run {rows[-1]['reads']} adapter reads "
                  f"(mean {rows[-1]['read_s_mean']} s), {rows[-1]['copies']} copies into slots "
                  f"(mean {rows[-1]['copy_s_mean']} s)", flush=True)
            finished()
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        if tp > 1:
            parallel_engine.close()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-total", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", choices=("backbone",) + WORKLOADS,
                        default=["backbone", *WORKLOADS])
    parser.add_argument("--hf-requests", type=int, default=32)
    parser.add_argument("--hf-max-total", type=int, default=256)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dora", action="store_true", help="also run every adapter workload on DoRA adapters")
    parser.add_argument("--quantizations", nargs="+", choices=FORMATS, default=["none"],
                        help="run the engine once per format: base weights none|fp8, +fp8kv: an fp8 KV cache")
    add_arguments(parser, EngineArgs, only=("enforce_eager", "overlap_steps", "tensor_parallel_size", "max_lora_bytes",
                                         "lora_host_bytes"))
    # one slot per request unless that passes 48 GiB: a MoE preset's adapters (~1.3 GB each on
    # qwen3-30b-a3b) would otherwise take the memory of the weights and the KV cache
    parser.set_defaults(max_lora_bytes=48 << 30)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="every request's nucleus (default 1.0: the whole vocabulary)")
    parser.add_argument("--out", type=Path, default=Path("results/textgen"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tp = args.tensor_parallel_size
    config = preset_config(args.preset)
    # the floor's bandwidth: only where a floor is computed (a MoE step reads only its routed experts)
    bandwidth = copy_bandwidth(device) if device == "cuda" and tp == 1 and not config.moe_layers else None
    rng = random.Random(0)
    lengths = textgen_lengths(args.requests, rng, max_total=args.max_total)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(p)] for p, _ in lengths]
    engine_args = from_arguments(EngineArgs, args, model=args.preset, load_format="dummy", max_loras=args.requests,
                                 max_lora_rank=args.rank,
                                 kv_cache_tokens=EngineConfig.max_batch_size * args.max_total + 1024)
    hf_ran = not args.skip_hf and tp == 1 and config.family == "llama"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": device_name if tp == 1 else f"{tp}x {device_name}", "preset": args.preset,
            "tensor_parallel_size": tp,
            "overlaps_steps": tp == 1 and engine_args.engine_config().overlaps_steps_on(device),
            "requests": args.requests, "max_total": args.max_total, "rank": args.rank,
            "adapter_slots": pool_slots(rank_config(config, tp), args.requests, args.rank,
                                        dtype, args.max_lora_bytes),
            "quantizations": args.quantizations, "temperature": args.temperature, "top_p": args.top_p,
            "hf_requests": args.hf_requests if hf_ran else 0, "hf_max_total": args.hf_max_total,
            "hf_batch": HF_BATCH, "date": time.strftime("%Y-%m-%d")}
    rows = []

    def save() -> None:
        write_results(args.out, "textgen", rows, meta)

    with tempfile.TemporaryDirectory() as tmp:
        kinds = ("lora", "dora") if args.dora else ("lora",)
        names = {}
        for kind in kinds:
            files = [save_random_adapter(Path(tmp) / f"{kind}{i}", config, args.rank, seed=i, dora=kind == "dora")
                     for i in range(args.files)]
            names[kind] = {f"{kind}{i}": str(files[i % len(files)]) for i in range(args.requests)}
        runs = [(w, kind) for w in ("backbone", *WORKLOADS) if w in args.workloads
                for kind in (("lora",) if w == "backbone" else kinds)]
        for label in args.quantizations:
            engine_runs(dataclasses.replace(engine_args, **format_fields(label)), config, dtype, device, runs, names,
                        prompts, lengths, rows, save, bandwidth, temperature=args.temperature, top_p=args.top_p)
    if not args.skip_hf and tp > 1:
        print(f"HF+PEFT baseline skipped: it runs on one device, the engine on {tp}", flush=True)
    elif not args.skip_hf and config.family != "llama":
        print(f"HF+PEFT baseline skipped: it builds a Llama, and {args.preset} is {config.family}", flush=True)
    elif not args.skip_hf:
        rows += hf_baseline(config, args.workloads, args.hf_requests, args.hf_max_total, args.rank, dtype, device)
        save()
    plot(rows, args.out / "textgen.png", f"{args.preset}, rank {args.rank}, {meta['device']}, TP={tp}")
    print(meta)
    engine_rows = [r for r in rows if r["system"] == "punica"]
    hf_rows = [r for r in rows if r["system"] == "hf+peft"]
    if engine_rows:
        print(format_table(engine_rows, ["workload", "adapters", "quantization", "requests", "tokens", "seconds",
                                         "tokens_per_s", "floor_tokens_per_s", "of_floor", "ttft_mean_ms",
                                         "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms", "reads", "read_s_mean",
                                         "copies", "copy_s_mean"]))
    if hf_rows:
        print(format_table(hf_rows, ["system", "workload", "requests", "tokens", "seconds", "tokens_per_s"]))
    first = args.quantizations[0]
    distinct = {r["system"]: r["tokens_per_s"] for r in rows if r["workload"] == "distinct"
                and r.get("adapters", "lora") == "lora" and r.get("quantization", first) == first}
    dora = {r["workload"]: r["tokens_per_s"] for r in engine_rows if r["adapters"] == "dora"
            and r["quantization"] == first}
    for workload, tokens_per_s in dora.items():
        lora = next(r["tokens_per_s"] for r in engine_rows if r["workload"] == workload and r["adapters"] == "lora"
                    and r["quantization"] == first)
        print(f"{workload}: DoRA / LoRA = {tokens_per_s / lora:.3f} tokens/s")
    for quantization in args.quantizations[1:]:
        for r in engine_rows:
            if r["quantization"] == quantization:
                base = next(b["tokens_per_s"] for b in engine_rows if b["quantization"] == first
                            and (b["workload"], b["adapters"]) == (r["workload"], r["adapters"]))
                print(f"{r['workload']} ({r['adapters']}): {quantization} / {first} = "
                      f"{r['tokens_per_s'] / base:.2f}x tokens/s")
    if len(distinct) == 2:
        print(f"distinct: punica / HF+PEFT = {distinct['punica'] / distinct['hf+peft']:.1f}x tokens/s")


if __name__ == "__main__":
    main()
