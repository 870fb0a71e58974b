"""Structured outputs: does constraining every request by a JSON schema cost throughput? And how
long does xgrammar take to compile a 50-property schema?

python -m benchmarks.structured [--preset llama-2-7b] [--requests 32] [--prompt-len 128]
    [--max-tokens 256] [--repeats 2] [--tokenizer DIR] [--out results/structured]
python -m benchmarks.structured --plot results/structured/structured.json   # its PNG, beside it

The engine on the preset's shape with random weights (like benchmarks/textgen.py), rank-16 adapters
on all 7 projections, request i on adapter i (distinct), one batch of --requests, greedy. Two runs
of the same requests, alternated --repeats times: "unconstrained" (ignore_eos) and "json_schema",
where request i is constrained by its own schema of 50 required properties (strings, bounded
integers, enums, booleans; names differ per request), too long to complete within --max-tokens, so
both runs generate the same number of tokens. Throughput = generated tokens / wall time of the run
(the schemas are compiled when the requests are added, before the clock starts). The grammar masks
of step t+1 are built on the host while its forward pass runs (punica.engine.engine).

The tokenizer (--tokenizer, default the embedded model's: SmolLM2's byte-level BPE) only gives
xgrammar the text of each token id below the preset's vocabulary size; the random model never
sees text. Compile time: a fresh compiler (empty cache), the 50-property schema, median of 5
schemas with different names; then the same schema again (a cache hit).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.common import format_table, save_figure, warm_up, write_results
from punica.config import EngineConfig, preset_config
from punica.engine.constraint import GrammarLimits
from punica.engine.sampling_params import SamplingParams, StructuredOutputs
from punica.engine.structured import GrammarCompiler
from punica.factory import engine_on_model
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model
from punica.models.sources import resolve_model_dir


def schema_50(tag: str) -> dict:
    """50 required properties: strings, bounded integers, enums and booleans, named by `tag`."""
    kinds = ({"type": "string"}, {"type": "integer", "minimum": 0, "maximum": 10**6},
             {"enum": ["alpha", "beta", "gamma", "delta"]}, {"type": "boolean"})
    properties = {f"{tag}_field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def compile_times(tokenizer, vocab_size: int) -> dict:
    compiler = GrammarCompiler(tokenizer, vocab_size, {0}, GrammarLimits.of(EngineConfig())).pool
    cold = []
    for i in range(5):
        spec = StructuredOutputs(json=schema_50(f"c{i}"))
        start = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    compiler.compile(StructuredOutputs(json=schema_50("c0")))
    return {"compile_50_props_ms": 1e3 * statistics.median(cold), "compile_50_props_max_ms": 1e3 * max(cold),
            "compile_cached_ms": 1e3 * (time.perf_counter() - start)}


def run(engine, prompts: list[list[int]], max_tokens: int, constrained: bool) -> dict:
    ids = []
    for i, prompt in enumerate(prompts):
        spec = StructuredOutputs(json=schema_50(f"r{i}")) if constrained else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, structured_outputs=spec)
        ids.append(engine.add_request(prompt, params, f"lora{i}"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    finished = {}
    for outputs in engine.steps():
        finished.update((o.request_id, o) for o in outputs if o.finished)
    seconds = time.perf_counter() - start
    outs = [finished[i] for i in ids]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"run": "json_schema" if constrained else "unconstrained", "generated_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "finish_reasons": sorted({o.finish_reason for o in outs})}


def plot(result: Path) -> Path:
    """A bar per timed run (tokens/s), from a result JSON; the PNG lies beside it."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(result.read_text())
    rows, meta = data["rows"], data["meta"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    colors = {"unconstrained": "tab:gray", "json_schema": "tab:blue"}
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=[colors[r["run"]] for r in rows])
    ax.set_xticks(range(len(rows)), [f"{i + 1}. {r['run']}" for i, r in enumerate(rows)], fontsize=7)
    ax.set_ylabel("generated tokens/s", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    path = result.with_suffix(".png")
    save_figure(fig, path, f"{meta['preset']}, batch {meta['requests']} distinct adapters, {meta['device']}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", type=Path, default=None, help="only plot this result JSON")
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("results/structured"))
    args = parser.parse_args()
    if args.plot is not None:
        print(plot(args.plot))
        return
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or resolve_model_dir(None)))
    config = preset_config(args.preset)
    compile_row = compile_times(tokenizer, config.vocab_size)
    print(compile_row, flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test (--preset tiny)
    model = dummy_model(config, torch.bfloat16 if device == "cuda" else torch.float32, device)
    engine_config = EngineConfig(max_loras=args.requests, max_lora_rank=args.rank, max_batch_size=args.requests,
                                 kv_cache_tokens=args.requests * (args.prompt_len + args.max_tokens) + 4096)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size, (args.requests, args.prompt_len), generator=g).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(save_random_adapter(Path(tmp) / "lora", config, args.rank, seed=0))
        names = {f"lora{i}": path for i in range(args.requests)}
        engine = engine_on_model(model, engine_config, names, tokenizer=tokenizer)
        warm_up(engine, list(names))
        run(engine, prompts[:4], 8, True)  # warm-up of the constrained path
        run(engine, prompts, args.max_tokens, False)  # untimed: the first full-size run is slower (cold)
        for _ in range(args.repeats):
            for constrained in (False, True):
                rows.append(run(engine, prompts, args.max_tokens, constrained))
                print(rows[-1], flush=True)
    free = [r["tokens_per_s"] for r in rows if r["run"] == "unconstrained"]
    constrained = [r["tokens_per_s"] for r in rows if r["run"] == "json_schema"]
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "preset": args.preset,
            "requests": args.requests,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rank": args.rank,
            "overlaps_steps": engine.overlaps_steps, "cuda_graphs": engine.executor.worker.uses_cuda_graphs,
            "ratio": statistics.median(constrained) / statistics.median(free), **compile_row,
            "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "structured", rows, meta)
    print(format_table(rows, ["run", "generated_tokens", "seconds", "tokens_per_s"]))
    print(meta)


if __name__ == "__main__":
    main()
