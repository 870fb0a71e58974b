"""A stream beside another client's long prompt, on the engine with `punica serve`'s defaults, or
through `punica serve` itself as its two clients see it (--server).

    python -m benchmarks.stream_beside_prompt [--model DIR] [--prompts 1024 4096] [--ratios 2.0 0]
                                              [--server] [--out results/stream_beside_prompt]

The embedded model by default (or --model), every engine setting at its default but --max-itl-ratio
(each of --ratios in turn; 0 is off: prompt chunks fill the 512-token budget). Per ratio and prompt
length: one request streams (a 40-token prompt, greedy, EOS ignored) until STEADY_TOKENS gaps
are timed, then a prompt of that many random tokens arrives and steps run until it has its first
token. Reported: the stream's steady gap (median before the prompt), its largest, 99th-percentile
and median gap while the prompt prefilled, largest / steady, the prompt's cached tokens when the
largest gap ended (None: after its last chunk), its time to first token and its steps.
Last, each prompt alone (no stream, one engine): its time to first token, and against the first
prompt's (--prompts 1024 8192 gives the 8k / 1k prefill ratio). Writes stream_beside_prompt.json.

With --server, per ratio a `punica serve` subprocess (its defaults but --max-itl-ratio) serves two
HTTP clients in this process: client A streams a completion of the same kind of prompt, and once A
has STEADY_TOKENS gaps client B sends the long prompt (token ids, one token wanted); A's gaps are
between the arrivals of its server-sent events (what a user of the stream sees), the steady one the
median before B was sent, and the largest while B waited, against A's largest gap before B (the
machine's own variation); B's time to first token is from its send to its answer. The server's
steps are not visible from there (no cached tokens or steps). Last, each prompt alone, sent to a
fresh server.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import format_table, random_prompt, write_results
from benchmarks.served import serving
from punica import LLM, SamplingParams
from punica.config import ModelConfig
from punica.models.sources import resolve_model_dir

STEADY_TOKENS = 8
STREAM_PROMPT = 40
MAX_STREAM_TOKENS = 4000  # client A's completion over HTTP, at most: it stops reading after B's answer
HTTP_TIMEOUT_S = 1800.0


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
    stats = gap_stats(stamps, arrival, first, steady)
    end = stats.pop("max_gap_end")
    engine.abort(stream)
    while engine.has_unfinished():
        engine.step()
    return {"prompt_tokens": prompt_len, **stats, "max_gap_at_cached": cached.get(end), "ttft_s": first - arrival,
            "steps": steps}


def gap_stats(stamps: list[float], arrival: float, first: float, steady: float) -> dict:
    """The stream's gaps (between its tokens' stamps) that overlap the prompt's wait, from its
    arrival to its first token, against the steady gap."""
    during = [(b - a, b) for a, b in zip(stamps, stamps[1:]) if b > arrival and a < first]
    largest, end = max(during)
    gaps = sorted(gap for gap, _ in during)
    return {"steady_gap_ms": 1e3 * steady, "max_gap_ms": 1e3 * largest,
            "p99_gap_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "median_gap_ms": 1e3 * statistics.median(gaps), "max_over_steady": largest / steady,
            "max_gap_end": end}


def served_beside_a_stream(url: str, model: str, prompt_len: int, vocab: int, rng: random.Random) -> dict:
    """beside_a_stream through a server (module docstring): client A streams, client B sends the
    prompt from another thread once A has STEADY_TOKENS gaps."""
    prompt = random_prompt(prompt_len, vocab, rng)
    b: dict = {}

    def client_b() -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as http:
            b["sent"] = time.perf_counter()
            response = http.post(url + "/v1/completions", json=body)
            b["answered"] = time.perf_counter()
        b["status"] = response.status_code

    sender = threading.Thread(target=client_b)
    stamps: list[float] = []
    body = {"model": model, "prompt": random_prompt(STREAM_PROMPT, vocab, rng), "max_tokens": MAX_STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as http, http.stream("POST", url + "/v1/completions",
                                                                   json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            if len(stamps) == STEADY_TOKENS + 2:
                sender.start()
            if "answered" in b and sum(t > b["answered"] for t in stamps) == 2:  # the gap past its answer
                break
    sender.join()
    if b.get("status") != 200 or "answered" not in b or stamps[-1] < b["answered"]:
        raise RuntimeError(f"the prompt was not answered while the stream ran: status {b.get('status')}")
    sent = b["sent"]
    before = [later - earlier for earlier, later in zip(stamps[1:], stamps[2:]) if later < sent]
    stats = gap_stats(stamps, sent, b["answered"], statistics.median(before))
    del stats["max_gap_end"]
    return {"prompt_tokens": prompt_len, **stats, "max_gap_before_ms": 1e3 * max(before),
            "ttft_s": b["answered"] - sent}


def alone(engine, prompt_len: int, vocab: int, rng: random.Random) -> float:
    start = time.perf_counter()
    engine.add_request(random_prompt(prompt_len, vocab, rng), SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def served_alone(url: str, model: str, prompt_len: int, vocab: int, rng: random.Random) -> float:
    """Seconds from sending a prompt of this many random tokens (one token wanted) to its answer."""
    body = {"model": model, "prompt": random_prompt(prompt_len, vocab, rng), "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    httpx.post(url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT_S).raise_for_status()
    return time.perf_counter() - start


def engine_runs(args, rng: random.Random) -> tuple[list[dict], dict[int, float]]:
    """Per ratio and prompt, beside_a_stream on an engine; then each prompt alone."""
    rows = []
    for ratio in args.ratios:
        engine = LLM(args.model, max_itl_ratio=ratio).engine
        vocab = engine.model_config.vocab_size
        alone(engine, 64, vocab, rng)  # the first step's one-time costs
        for length in args.prompts:
            rows.append({"max_itl_ratio": ratio, **beside_a_stream(engine, length, vocab, rng)})
            report(rows[-1])
        engine.close()
    engine = LLM(args.model).engine
    alone(engine, 64, engine.model_config.vocab_size, rng)
    prefill = {length: alone(engine, length, engine.model_config.vocab_size, rng) for length in args.prompts}
    engine.close()
    return rows, prefill


def server_runs(args, rng: random.Random) -> tuple[list[dict], dict[int, float]]:
    """Per ratio and prompt, served_beside_a_stream on a server; then each prompt alone on another."""
    vocab = ModelConfig.from_dir(resolve_model_dir(args.model)).vocab_size
    name = "base"
    flags = ["--served-model-name", name, *(["--model", args.model] if args.model else [])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in args.ratios:
            with serving([*flags, "--max-itl-ratio", str(ratio)], Path(tmp)) as url:
                served_alone(url, name, 64, vocab, rng)  # the first step's one-time costs
                for length in args.prompts:
                    rows.append({"max_itl_ratio": ratio, **served_beside_a_stream(url, name, length, vocab, rng)})
                    report(rows[-1])
        with serving(flags, Path(tmp)) as url:
            served_alone(url, name, 64, vocab, rng)
            prefill = {length: served_alone(url, name, length, vocab, rng) for length in args.prompts}
    return rows, prefill


def report(row: dict) -> None:
    print(f"ratio {row['max_itl_ratio']}, {row['prompt_tokens']} tokens: the stream's largest gap "
          f"{row['max_gap_ms']:.0f} ms, {row['max_over_steady']:.2f}x its steady {row['steady_gap_ms']:.0f} ms; "
          f"TTFT {row['ttft_s']:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ratios", type=float, nargs="+", default=[2.0, 0.0])
    parser.add_argument("--server", action="store_true", help="through a `punica serve` subprocess, as its clients")
    parser.add_argument("--out", type=Path, default=Path("results/stream_beside_prompt"))
    args = parser.parse_args()
    rng = random.Random(0)
    rows, prefill = (server_runs if args.server else engine_runs)(args, rng)
    first = args.prompts[0]
    alone_rows = [{"prompt_tokens": n, "ttft_s": s, f"over_{first}": s / prefill[first]} for n, s in prefill.items()]
    extra = ["max_gap_before_ms"] if args.server else ["max_gap_at_cached", "steps"]
    print(format_table(rows, ["max_itl_ratio", "prompt_tokens", "steady_gap_ms", "median_gap_ms", "p99_gap_ms",
                              "max_gap_ms", "max_over_steady", "ttft_s", *extra]))
    print(format_table(alone_rows, ["prompt_tokens", "ttft_s", f"over_{first}"]))
    meta = {"model": args.model or "embedded SmolLM2-135M-Instruct", "date": time.strftime("%Y-%m-%d"),
            "via": "punica serve, two HTTP clients" if args.server else "the engine"}
    write_results(args.out, "stream_beside_prompt", rows + [{"alone": True, **r} for r in alone_rows], meta)


if __name__ == "__main__":
    main()
