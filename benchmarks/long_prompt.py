"""Long-prompt interference: --decodes requests decode, each on its own adapter, while prompts of
--prompts tokens arrive one at a time (on one more adapter); the running decodes' inter-token
latency with chunked prefill (each of --budgets as max_num_batched_tokens, under each of --ratios
as max_itl_ratio: 0 is off) and without it.

    python -m benchmarks.long_prompt [--preset llama-2-7b] [--decodes 31] [--prompts 2048 4096 8192 16384 32768]
        [--budgets 512] [--ratios 2.0] [--out results/long_prompt]

The defaults are the engine's (a 512-token budget under a 2.0 latency ratio).

One engine (random weights, CUDA graphs, overlapped steps, rank-16 adapters on all 7 projections)
runs every mode in turn; a mode sets the scheduler's budget, latency budget (a fresh cost model)
and chunking, which change no graph.
Per mode: the decodes start on 64-token prompts and run until every one has a token; then, for
each long prompt in turn, 20 steps measure the steady inter-token latency (ITL), the prompt is
added, and steps run until it has its first token and 3 steps more. Reported per prompt: the
running decodes' ITL p50/p99/max over their tokens between the prompt's arrival and its first
token, the steady ITL p50 before it, their ratio, the prompt's time to first token, the Triton
kernels compiled meanwhile (`compiles`: 0 on a warmed engine), and with a latency budget, how its
steps with prompt tokens ran against the cost model's prediction (`over_predicted_p50`/`_p90`: step
time over prediction, made before the step was fitted), their chunks (`chunk_p50`) and the slowest
one over the budget's decode-only step of its decodes (`over_budget_steady_max`: what the budget
holds within max_itl_ratio; the ratio over the steady ITL also counts the decodes' own growth while
the prompt prefills, and the host's delays in returning tokens), and Python's garbage collections
meanwhile (`gc_collections`, `gc_max_ms`: the longest, a pause of the host's step loop); each of
those steps is in the row's `chunk_steps` (chunk, prefix, decodes, ms, predicted_ms, steady_ms).
Once the prompt's request has finished, 20 more steps give the decodes' steady ITL after it
(`steady_after_itl_p50_ms`), and `p99_over_interpolated_steady` is the 99th percentile of each gap
over the steady ITL at its time, on a straight line from the one before the prompt to the one
after: the gaps over the decodes' own step as their contexts grew while the prompt prefilled.

The first mode is the first long-prompt traffic after start-up (graph capture, then one short
request per adapter to make the adapters resident): run the command with TRITON_CACHE_DIR set
to an empty directory and its first prompt is the fresh-machine case. Writes long_prompt.json
and long_prompt.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import triton

from benchmarks.common import format_table, percentile, save_figure, style_axes, warm_up, write_results
from punica.config import EngineConfig, preset_config
from punica.engine.sampling_params import SamplingParams
from punica.engine.step_cost import LatencyBudget, StepFeatures
from punica.factory import engine_on_model
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model

STEADY_STEPS = 20
AFTER_STEPS = 3


def times_over(measured: float, predicted: float) -> float:
    """measured over predicted (the same unit), inf where nothing was predicted."""
    return measured / predicted if predicted > 0 else math.inf


class Clock:
    """Steps the engine, stamping every new token of every request with the time its step returned;
    counts the Triton kernels compiled, and logs each step with prompt tokens that the scheduler's
    latency budget observes: its chunk tokens, the chunk's cached context (prefix), its decodes, its
    time (ms), the time the budget's model predicted for it and for a decode-only step of its
    decodes (the model as it stood before the step); and records Python's garbage collections as
    (start, end)."""

    def __init__(self, engine):
        self.engine = engine
        self.stamps: dict[str, list[float]] = {}
        self.compiled: list[str] = []
        self.chunk_steps: list[dict] = []
        self.collections: list[tuple[float, float]] = []
        started = []

        def collection(phase, info):
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                self.collections.append((started.pop(), time.perf_counter()))

        gc.callbacks.append(collection)
        scheduler = engine.scheduler
        observe = scheduler.observe

        def logged_observe(output, seconds):
            features = StepFeatures.of(output)
            if scheduler.latency is not None and features.prompt_tokens:
                predicted = scheduler.latency.model.predict(features)
                decodes = StepFeatures.decodes(list(output.num_computed[output.num_prefills:]))
                steady = scheduler.latency.steady(decodes)
                self.chunk_steps.append({"chunk": features.prompt_tokens, "prefix": features.prefix,
                                         "decodes": features.num_decodes, "ms": 1e3 * seconds,
                                         "predicted_ms": 1e3 * predicted, "steady_ms": 1e3 * steady})
            observe(output, seconds)

        scheduler.observe = logged_observe
        triton.knobs.runtime.jit_post_compile_hook = lambda **kwargs: self.compiled.append(kwargs["fn"].name)

    def step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            self.stamps.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))

    def gaps(self, request_ids: list[str], start: float, end: float) -> list[float]:
        """Inter-token gaps (ms) of these requests' tokens stamped in (start, end]."""
        return [gap for gap, _ in self.timed_gaps(request_ids, start, end)]

    def timed_gaps(self, request_ids: list[str], start: float, end: float) -> list[tuple[float, float]]:
        """(gap in ms, its end's stamp) of these requests' tokens stamped in (start, end]."""
        gaps = []
        for rid in request_ids:
            times = self.stamps.get(rid, [])
            gaps += [(1e3 * (b - a), b) for a, b in zip(times, times[1:]) if start < b <= end]
        return gaps


def over_interpolated(gaps: list[tuple[float, float]], start: float, end: float, before: float,
                      after: float) -> list[float]:
    """Each gap (ms, its end's stamp in [start, end]) over the steady gap at its time, from `before`
    at start to `after` at end in a straight line: the decodes' own step as their contexts grew."""
    span = max(end - start, 1e-9)
    return [gap / (before + (after - before) * min(max((stamp - start) / span, 0.0), 1.0)) for gap, stamp in gaps]


def run_mode(clock: Clock, name: str, prompt_lens: list[int], decodes: int, vocab: int,
             rng: random.Random) -> list[dict]:
    engine = clock.engine
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(3, vocab) for _ in range(64)], params, f"lora{i}") for i in range(decodes)]
    while any(len(clock.stamps.get(rid, [])) == 0 for rid in ids):
        clock.step()
    rows = []
    for length in prompt_lens:
        prompt = [rng.randrange(3, vocab) for _ in range(length)]  # made before the gaps are timed
        steady_start = time.perf_counter()
        for _ in range(STEADY_STEPS):
            clock.step()
        arrival = time.perf_counter()
        long_id = engine.add_request(prompt, SamplingParams(max_tokens=AFTER_STEPS + 2, temperature=0, ignore_eos=True),
                                     f"lora{decodes}")
        steps, compiled, logged = 0, len(clock.compiled), len(clock.chunk_steps)
        while not clock.stamps.get(long_id):
            clock.step()
            steps += 1
        first = clock.stamps[long_id][0]
        for _ in range(AFTER_STEPS):
            clock.step()
        while long_id in engine.requests:  # the prompt's last tokens: then decode-only steps
            clock.step()
        after_start = time.perf_counter()
        for _ in range(STEADY_STEPS):
            clock.step()
        # read from the stamps once the prompt is done: between two steps, reading them all would
        # delay the next step (milliseconds, the more the longer the run) and show in the gaps timed
        steady = statistics.median(clock.gaps(ids, steady_start, arrival))
        steady_after = statistics.median(clock.gaps(ids, after_start, time.perf_counter()))
        timed = clock.timed_gaps(ids, arrival, first)
        during = [gap for gap, _ in timed]
        over_then = over_interpolated(timed, arrival, first, steady, steady_after)
        row = {"mode": name, "prompt_tokens": length, "steady_itl_p50_ms": steady,
               "steady_after_itl_p50_ms": steady_after, "p99_over_interpolated_steady": percentile(over_then, 0.99),
               "itl_p50_ms": statistics.median(during), "itl_p99_ms": percentile(during, 0.99),
               "itl_max_ms": max(during), "ttft_ms": 1e3 * (first - arrival), "steps": steps,
               "compiles": len(clock.compiled) - compiled}
        row["p99_over_steady"] = row["itl_p99_ms"] / row["steady_itl_p50_ms"]
        pauses = [end - begin for begin, end in clock.collections if arrival < end <= first]
        row |= {"gc_collections": len(pauses), "gc_max_ms": 1e3 * max(pauses, default=0.0)}
        if chunk_steps := clock.chunk_steps[logged:]:
            over = [times_over(s["ms"], s["predicted_ms"]) for s in chunk_steps]
            row |= {"chunk_p50": statistics.median(s["chunk"] for s in chunk_steps),
                    "over_predicted_p50": statistics.median(over), "over_predicted_p90": percentile(over, 0.9),
                    "over_budget_steady_max": max(times_over(s["ms"], s["steady_ms"]) for s in chunk_steps),
                    "chunk_steps": chunk_steps}
        rows.append(row)
        print(f"{name} {length}: ITL p99 {row['itl_p99_ms']:.1f} ms ({row['p99_over_steady']:.2f}x steady "
              f"{row['steady_itl_p50_ms']:.1f}; {row['p99_over_interpolated_steady']:.2f}x the steady ITL at its "
              f"time, {row['steady_after_itl_p50_ms']:.1f} after), max {row['itl_max_ms']:.1f}, "
              f"TTFT {row['ttft_ms']:.0f} ms, "
              f"{row['compiles']} kernels compiled {sorted(set(clock.compiled[compiled:]))}, "
              f"{row['gc_collections']} collections (longest {row['gc_max_ms']:.1f} ms)"
              + (f", chunk p50 {row['chunk_p50']:.0f}, step / predicted p50 {row['over_predicted_p50']:.2f} "
                 f"p90 {row['over_predicted_p90']:.2f}, slowest / budget's steady {row['over_budget_steady_max']:.2f}"
                 if chunk_steps else ""), flush=True)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["prompt_tokens"] for r in mine], [r["p99_over_steady"] for r in mine], marker="o", label=mode)
    ax.axhline(2.0, color="gray", linestyle="--", linewidth=1)
    style_axes(ax, "running decodes' ITL p99 / steady ITL while a long prompt prefills", "prompt tokens",
               "ITL p99 / steady", log_y=True)
    ax.legend(fontsize=7)
    save_figure(fig, path, title)


@contextlib.contextmanager
def decodes_engine(preset: str, decodes: int, longest_prompt: int, budget: int, dtype: torch.dtype, device: str,
                   quantization: str = "none", kv_cache_dtype: str = "auto", files: int | None = None):
    """An engine of --preset's shapes with dummy weights (`quantization` of the base weights, a
    `kv_cache_dtype` KV cache) for `decodes` requests decoding beside one prompt of up to
    `longest_prompt` tokens: a rank-16 adapter per request (`lora0` ... in a temporary directory;
    with `files`, the names share that many files, each name still its own pool slot),
    KV room for the prompt and 1,024 tokens per decode, the step budget `budget`, warmed up (graphs
    captured, every adapter resident). Yields (engine, model config)."""
    longest = longest_prompt + 2048
    config = dataclasses.replace(preset_config(preset), max_position_embeddings=longest)
    model = dummy_model(config, dtype, device, quantization=quantization)
    engine_config = EngineConfig(max_batch_size=decodes + 1, max_loras=decodes + 1, max_model_len=longest,
                                 kv_cache_tokens=longest_prompt + decodes * 1024, max_num_batched_tokens=budget,
                                 kv_cache_dtype=kv_cache_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [save_random_adapter(Path(tmp) / f"a{i}", config, 16, seed=i) for i in range(files or decodes + 1)]
        names = {f"lora{i}": str(paths[i % len(paths)]) for i in range(decodes + 1)}
        engine = engine_on_model(model, engine_config, names)
        warm_up(engine, list(names))
        yield engine, config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--decodes", type=int, default=31)
    parser.add_argument("--prompts", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512])
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0])
    parser.add_argument("--out", type=Path, default=Path("results/long_prompt"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rng = random.Random(0)
    rows = []
    start = time.perf_counter()
    with decodes_engine(args.preset, args.decodes, max(args.prompts), args.budgets[0], dtype, device) as setup:
        engine, config = setup
        print(f"start-up (weights, graphs, adapters) {time.perf_counter() - start:.1f} s", flush=True)
        modes = [(f"chunked {b}" + (f", max_itl_ratio {r}" if r else ""), True, b, r)
                 for r in args.ratios for b in args.budgets] + [("unchunked", False, max(args.prompts), 0)]
        clock = Clock(engine)  # one per engine: it wraps the scheduler's observe
        for name, chunked, budget, ratio in modes:
            engine.scheduler.chunked_prefill, engine.scheduler.max_num_batched_tokens = chunked, budget
            engine.scheduler.latency = LatencyBudget.of_executor(ratio, engine.executor) if ratio else None
            rows += run_mode(clock, name, args.prompts, args.decodes, config.vocab_size, rng)
    columns = ["mode", "prompt_tokens", "steady_itl_p50_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
               "p99_over_steady", "steady_after_itl_p50_ms", "p99_over_interpolated_steady", "ttft_ms", "steps",
               "compiles", "chunk_p50", "over_predicted_p50",
               "over_budget_steady_max", "gc_collections", "gc_max_ms"]
    print(format_table(rows, columns))
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": device_name, "preset": args.preset, "decodes": args.decodes, "date": time.strftime("%Y-%m-%d"),
            "first_mode_is_first_traffic": True}
    path = write_results(args.out, "long_prompt", rows, meta)
    plot(rows, path.with_suffix(".png"), f"{args.preset}, {args.decodes} decodes on distinct adapters, {device_name}")


if __name__ == "__main__":
    main()
