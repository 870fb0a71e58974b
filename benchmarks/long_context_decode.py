"""Decode steps after a long prompt, on the engine with `punica serve`'s defaults.

    python -m benchmarks.long_context_decode [--model DIR] [--contexts 1024 2048 4096 8000]
                                             [--steps 24] [--out results/long_context_decode]

The embedded model by default (or --model). Per context length, one request: a prompt of that many
random tokens, prefilled, then --steps decode steps of it alone, timed one by one (the first two
left out). Reported: the median and fastest step, the step over the shortest context's (the first
of --contexts), and whether the request's pages were one run (the CPU attention reads such a
context in place: punica.ops.attention_cpu). Writes long_context_decode.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import format_table, random_prompt, write_results
from punica import LLM, SamplingParams

WARMUP_STEPS = 2


def decode_steps(engine, context: int, steps: int, rng: random.Random) -> dict:
    vocab = engine.model_config.vocab_size
    rid = engine.add_request(random_prompt(context, vocab, rng),
                             SamplingParams(max_tokens=2 * (steps + WARMUP_STEPS), temperature=0, ignore_eos=True))
    while not any(r.request_id == rid and r.num_cached >= context for r in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps + WARMUP_STEPS):
        start = time.perf_counter()
        engine.step()
        times.append(1e3 * (time.perf_counter() - start))
    pages = next(r.pages for r in engine.scheduler.running if r.request_id == rid)
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    times = times[WARMUP_STEPS:]
    return {"context": context, "median_ms": statistics.median(times), "fastest_ms": min(times),
            "pages_one_run": pages == list(range(pages[0], pages[0] + len(pages)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("results/long_context_decode"))
    args = parser.parse_args()
    rng = random.Random(0)
    engine = LLM(args.model).engine
    rows = []
    for context in args.contexts:
        rows.append(decode_steps(engine, context, args.steps, rng))
        rows[-1]["over_first"] = rows[-1]["median_ms"] / rows[0]["median_ms"]
        print(f"context {context}: a decode step {rows[-1]['median_ms']:.1f} ms (median), "
              f"pages one run: {rows[-1]['pages_one_run']}", flush=True)
    engine.close()
    print(format_table(rows, ["context", "median_ms", "fastest_ms", "over_first", "pages_one_run"]))
    meta = {"model": args.model or "embedded SmolLM2-135M-Instruct", "steps": args.steps,
            "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "long_context_decode", rows, meta)


if __name__ == "__main__":
    main()
