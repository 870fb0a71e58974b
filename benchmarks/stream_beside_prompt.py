"""A stream beside another client's long prompt, on the engine with `punica serve`'s defaults.

    python -m benchmarks.stream_beside_prompt [--model DIR] [--prompts 1024 4096] [--ratios 2.0 0]
                                              [--out results/stream_beside_prompt]

The embedded model by default (or --model), every engine setting at its default but --max-itl-ratio
(each of --ratios in turn; 0 is off: prompt chunks fill the 512-token budget). Per ratio and prompt
length: one request streams (a 40-token prompt, greedy, EOS ignored) until STEADY_TOKENS gaps
are timed, then a prompt of that many random tokens arrives and steps run until it has its first
token. Reported: the stream's steady gap (median before the prompt), its largest, 99th-percentile
and median gap while the prompt prefilled, largest / steady, the prompt's cached tokens when the
largest gap ended (None: after its last chunk), its time to first token and its steps.
Last, each prompt alone (no stream, one engine): its time to first token, and against the first
prompt's (--prompts 1024 8192 gives the 8k / 1k prefill ratio). Writes stream_beside_prompt.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import format_table, random_prompt, write_results
from punica import LLM, SamplingParams

STEADY_TOKENS = 8
STREAM_PROMPT = 40


def stream_stamps(engine, stream: str) -> list[float]:
    """One step: the time it returned, once per new token of `stream`."""
    outputs = engine.step()
    now = time.perf_counter()
    return [now for out in outputs if out.request_id == stream for _ in out.new_token_ids]


def beside_a_stream(engine, prompt_len: int, vocab: int, rng: random.Random) -> dict:
    stream = engine.add_request(random_prompt(STREAM_PROMPT, vocab, rng),
                                SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
    stamps: list[float] = []
    while len(stamps) < STEADY_TOKENS + 2:
        stamps += stream_stamps(engine, stream)
    steady = statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))  # the first gap holds the prompt
    arrival = time.perf_counter()
    prompt = engine.add_request(random_prompt(prompt_len, vocab, rng),
                                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    first, steps, cached = None, 0, {}
    while first is None:
        outputs = engine.step()
        steps += 1
        now = time.perf_counter()
        cached[now] = next((r.num_cached for r in engine.scheduler.running if r.request_id == prompt), None)
        for out in outputs:
            if out.request_id == stream:
                stamps += [now] * len(out.new_token_ids)
            elif out.request_id == prompt and out.new_token_ids:
                first = now
    for _ in range(2):  # the gap that ends after the prompt's last chunk
        stamps += stream_stamps(engine, stream)
    during = [(b - a, b) for a, b in zip(stamps, stamps[1:]) if b > arrival and a < first]
    largest, end = max(during)
    gaps = sorted(gap for gap, _ in during)
    engine.abort(stream)
    while engine.has_unfinished():
        engine.step()
    return {"prompt_tokens": prompt_len, "steady_gap_ms": 1e3 * steady, "max_gap_ms": 1e3 * largest,
            "p99_gap_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "median_gap_ms": 1e3 * statistics.median(gaps), "max_over_steady": largest / steady,
            "max_gap_at_cached": cached.get(end), "ttft_s": first - arrival, "steps": steps}


def alone(engine, prompt_len: int, vocab: int, rng: random.Random) -> float:
    start = time.perf_counter()
    engine.add_request(random_prompt(prompt_len, vocab, rng), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0, 0.0])
    parser.add_argument("--out", type=Path, default=Path("results/stream_beside_prompt"))
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for ratio in args.ratios:
        engine = LLM(args.model, max_itl_ratio=ratio).engine
        vocab = engine.model_config.vocab_size
        alone(engine, 64, vocab, rng)  # the first step's one-time costs
        for length in args.prompts:
            row = {"max_itl_ratio": ratio, **beside_a_stream(engine, length, vocab, rng)}
            rows.append(row)
            print(f"ratio {ratio}, {length} tokens: the stream's largest gap {row['max_gap_ms']:.0f} ms, "
                  f"{row['max_over_steady']:.2f}x its steady {row['steady_gap_ms']:.0f} ms; TTFT {row['ttft_s']:.1f} s "
                  f"in {row['steps']} steps", flush=True)
        engine.close()
    engine = LLM(args.model).engine
    alone(engine, 64, engine.model_config.vocab_size, rng)
    prefill = {length: alone(engine, length, engine.model_config.vocab_size, rng) for length in args.prompts}
    engine.close()
    first = args.prompts[0]
    alone_rows = [{"prompt_tokens": n, "ttft_s": s, f"over_{first}": s / prefill[first]} for n, s in prefill.items()]
    print(format_table(rows, ["max_itl_ratio", "prompt_tokens", "steady_gap_ms", "median_gap_ms", "p99_gap_ms",
                              "max_gap_ms", "max_over_steady", "max_gap_at_cached", "ttft_s", "steps"]))
    print(format_table(alone_rows, ["prompt_tokens", "ttft_s", f"over_{first}"]))
    meta = {"model": args.model or "embedded SmolLM2-135M-Instruct", "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "stream_beside_prompt", rows + [{"alone": True, **r} for r in alone_rows], meta)


if __name__ == "__main__":
    main()
