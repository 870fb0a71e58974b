"""Text generation throughput (the paper's Fig. 11): the engine on a model shape with random
weights, rank-r adapters on all 7 projections, the four popularity workloads and the backbone.

python -m benchmarks.textgen [--preset llama-2-7b] [--requests 64] [--max-total 2048]

Requests follow the paper's generator (prompt ~ lognorm(0.8, -1, 18), total ~ uniform up to
--max-total, fixed seed), FCFS, max batch 32, greedy with ignore_eos so every request runs its
full length. Throughput = (prompt + generated tokens) / wall time; also mean and p99 time to
first token and time per output token. Workload "distinct" gives request i adapter i (one
adapter per request); the adapters' values come from --files files (values do not change the
work; each name still gets its own GPU slot and copy).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, warm_up, write_results
from punica.config import EngineConfig, preset_config
from punica.engine.engine import Engine
from punica.engine.sampling_params import SamplingParams
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model
from punica.workloads import WORKLOADS, adapter_ids, textgen_lengths


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def serve_all(engine: Engine, requests: list[tuple[list[int], int, str | None]]) -> tuple[list, float]:
    """Run requests (prompt, output length, adapter) to completion: (outputs, wall seconds)."""
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True), adapter)
           for prompt, out, adapter in requests]
    finished = {}
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():
        outputs = engine.step()
        if not outputs:
            time.sleep(0.0005)
        finished.update((o.request_id, o) for o in outputs if o.finished)
    return [finished[i] for i in ids], time.perf_counter() - start


def run(engine: Engine, requests: list[tuple[list[int], int, str | None]]) -> dict:
    outs, seconds = serve_all(engine, requests)
    tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
    ttft = [o.time_to_first_token for o in outs]
    tpot = [o.time_per_output_token for o in outs if o.time_per_output_token is not None]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p99_ms": 1e3 * p99(ttft),
            "tpot_mean_ms": 1e3 * statistics.mean(tpot), "tpot_p99_ms": 1e3 * p99(tpot)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-total", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("results/textgen"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = preset_config(args.preset)
    rng = random.Random(0)
    lengths = textgen_lengths(args.requests, rng, max_total=args.max_total)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(p)] for p, _ in lengths]
    model = dummy_model(config, torch.bfloat16 if device == "cuda" else torch.float32, device)
    engine_config = EngineConfig(max_batch_size=32, max_loras=min(64, args.requests), max_lora_rank=args.rank,
                                 kv_cache_tokens=32 * args.max_total + 1024)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [save_random_adapter(Path(tmp) / f"f{i}", config, args.rank, seed=i) for i in range(args.files)]
        names = {f"lora{i}": str(files[i % len(files)]) for i in range(args.requests)}
        backbone = Engine(model, None, engine_config)
        warm_up(backbone, [None] * 32)
        rows.append({"workload": "backbone", **run(backbone, [(p, o, None) for p, (_, o) in zip(prompts, lengths)])})
        del backbone
        for workload in WORKLOADS:
            engine = Engine(model, None, engine_config, names)
            adapters = [f"lora{i}" for i in adapter_ids(workload, args.requests, random.Random(1))]
            warm_up(engine, list(dict.fromkeys(adapters)))  # compiled kernels, resident adapters
            rows.append({"workload": workload, **run(engine, [(p, o, a) for p, (_, o), a in
                                                                  zip(prompts, lengths, adapters)])})
            del engine
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "preset": args.preset,
            "requests": args.requests, "max_total": args.max_total, "rank": args.rank, "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "textgen", rows, meta)
    print(meta)
    print(format_table(rows, ["workload", "tokens", "seconds", "tokens_per_s", "ttft_mean_ms", "ttft_p99_ms",
                              "tpot_mean_ms", "tpot_p99_ms"]))


if __name__ == "__main__":
    main()
