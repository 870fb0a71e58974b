"""Engine throughput on CPU: the embedded model, the four adapter-popularity workloads.

python -m benchmarks.engine_cpu [--requests 32] [--out results/engine_cpu]
Throughput = (prompt + generated tokens) / wall time of the whole batch; the same requests
also run without LoRA (backbone only) in the same process.
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, write_results
from punica import LLM, SamplingParams
from punica.lora.dummy import save_random_adapter
from punica.workloads import WORKLOADS, adapter_ids, textgen_lengths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-total", type=int, default=160, help="prompt + output tokens at most")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("results/engine_cpu"))
    args = parser.parse_args()

    rng = random.Random(0)
    lengths = textgen_lengths(args.requests, rng, max_total=args.max_total)
    vocab_rng = random.Random(1)
    prompts = [[vocab_rng.randrange(100, 40000) for _ in range(p)] for p, _ in lengths]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        base = LLM()
        config = base.engine.model_config
        paths = {f"lora{i}": str(save_random_adapter(Path(tmp) / f"lora{i}", config, args.rank, seed=i))
                 for i in range(args.requests)}
        llm = LLM(adapters=paths, max_loras=args.requests)
        rows = []
        for workload in ("backbone",) + WORKLOADS:
            engine_llm = base if workload == "backbone" else llm
            adapters = (None if workload == "backbone"
                        else [f"lora{i}" for i in adapter_ids(workload, args.requests, rng)])
            start = time.perf_counter()
            outs = engine_llm.generate(prompts, params, adapter=adapters)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outs)
            rows.append({"workload": workload, "requests": args.requests, "tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds})
    meta = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "model": "SmolLM2-135M-Instruct fp32", "rank": args.rank,
            "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "engine_cpu", rows, meta)
    print(meta)
    print(format_table(rows, ["workload", "requests", "tokens", "seconds", "tokens_per_s"]))


if __name__ == "__main__":
    main()
