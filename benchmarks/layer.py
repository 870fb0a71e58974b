"""One transformer layer with LoRA (the paper's Fig. 10): latency of a Llama layer whose 7
projections carry rank-r adapters, for the four adapter-popularity workloads and without LoRA.

    python -m benchmarks.layer [--preset llama-2-7b] [--batches 1 2 4 8 16 32] [--seq-lens 512 2048]

The layer is layer 0 of a one-layer dummy model of --preset (random weights; bf16 on CUDA,
fp32 on CPU). Its LoRA weights are a LoraPool with one slot per request of the largest batch,
each slot holding its own random PEFT-format adapter of rank --rank. Two phases, for every
batch size b and sequence length s:

* prefill: b prompts of s tokens, one batch of b * s tokens (writes their K/V, causal attention);
* decode: b requests with s cached tokens each, one new token each.

Workloads (punica.workloads): request i gets adapter_ids(workload)[i], requests ordered by slot
as the engine orders them; "none" gives every request slot -1 (the layer skips LoRA). Pages are
scattered over the cache. RoPE's cos/sin are computed once per point, outside the timing (the
model computes them once per step for all layers).

CUDA: median of triton.testing.do_bench of the layer's forward captured in a CUDA graph
(graph_us: the GPU time it costs inside a captured step) and called eagerly (eager_us: with
Python launch cost). CPU: median wall time of 3 eager calls after one warm-up. ratio = latency
/ the no-LoRA latency of the same phase, b and s. Writes layer.json and layer.png under --out,
prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import format_table, save_figure, style_axes, write_results
from punica.config import ceil_div, preset_config
from punica.lora.adapter import load_adapter
from punica.lora.batch import LoraBatch
from punica.lora.dummy import save_random_adapter
from punica.lora.layers import attach_pool
from punica.lora.pool import LoraPool
from punica.models.decoder import DecoderForCausalLM
from punica.models.forward_batch import ForwardBatch
from punica.models.loader import dummy_model
from punica.ops.attention import AttnBatch
from punica.workloads import WORKLOADS, adapter_ids

PAGE_SIZE = 16
PHASES = ("prefill", "decode")


def time_us(fn, device: torch.device, graph: bool) -> float:
    """Median microseconds per call of fn (see the module docstring)."""
    fn()  # compiles the kernels; a capture must not be the first call
    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    import triton

    captured = None
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
    us = triton.testing.do_bench(captured.replay if graph else fn, warmup=10, rep=50, return_mode="median") * 1e3
    del captured
    return us


def step_batches(phase: str, b: int, s: int, slots: list[int], num_pages: int, device, rng: random.Random):
    """AttnBatch and LoraBatch of one step of b requests over pages scattered in the cache."""
    need = ceil_div(s + 1, PAGE_SIZE)
    free = rng.sample(range(num_pages), b * need)
    tables = [free[i * need:(i + 1) * need] for i in range(b)]
    if phase == "prefill":
        query_lens, context_lens, num_prefills = [s] * b, [s] * b, b
    else:
        query_lens, context_lens, num_prefills = [1] * b, [s + 1] * b, 0
    attn = AttnBatch.build(query_lens, context_lens, tables, PAGE_SIZE, num_prefills, device)
    return attn, LoraBatch.build(slots, query_lens, device)


def build(preset: str, rank: int, num_slots: int, dtype: torch.dtype, device) -> DecoderForCausalLM:
    """A one-layer dummy model, attached to a LoraPool with a random rank-`rank` adapter in every slot."""
    config = dataclasses.replace(preset_config(preset), num_layers=1)
    model = dummy_model(config, dtype, device)
    pool = LoraPool(config, num_slots, rank, dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        for slot in range(num_slots):
            path = save_random_adapter(Path(tmp) / f"a{slot}", config, rank, seed=slot)
            pool.write(slot, load_adapter(path, config, dtype=dtype))
    attach_pool(model, pool)
    return model


def plot(rows: list[dict], key: str, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted({r["seq_len"] for r in rows})
    fig, axes = plt.subplots(len(PHASES), len(seq_lens), figsize=(4.5 * len(seq_lens), 7), squeeze=False)
    for i, phase in enumerate(PHASES):
        for j, s in enumerate(seq_lens):
            ax = axes[i][j]
            for workload in ("none",) + WORKLOADS:
                sel = [r for r in rows if r["phase"] == phase and r["seq_len"] == s and r["workload"] == workload]
                ax.plot([r["batch"] for r in sel], [r[key] / 1e3 for r in sel], marker="o", ms=3,
                        label=workload, linestyle="--" if workload == "none" else "-")
            style_axes(ax, f"{phase}, sequence {s}", "batch size", "ms per layer")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, title)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--out", type=Path, default=Path("results/layer"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    key = "graph_us" if device.type == "cuda" else "eager_us"
    model = build(args.preset, args.rank, max(args.batches), dtype, device)
    layer, config = model.layers[0], model.config
    num_pages = max(args.batches) * ceil_div(max(args.seq_lens) + 1, PAGE_SIZE)
    kv_cache = model.new_kv_cache(num_pages, PAGE_SIZE)
    rng = random.Random(0)
    started = time.time()
    rows = []
    for phase in PHASES:
        for s in args.seq_lens:
            for b in args.batches:
                for workload in ("none",) + WORKLOADS:
                    slots = [-1] * b if workload == "none" else sorted(adapter_ids(workload, b, rng))
                    attn, lora = step_batches(phase, b, s, slots, num_pages, device, rng)
                    x = torch.randn(attn.num_tokens, config.hidden_size, dtype=dtype, device=device)
                    residual = torch.randn_like(x)  # a middle layer: its input norm adds the residual
                    forward = partial(layer, x, residual, ForwardBatch(attn, lora, kv_cache))

                    row = {"phase": phase, "seq_len": s, "batch": b, "workload": workload,
                           "num_adapters": len(set(slots) - {-1}), "num_tokens": attn.num_tokens,
                           "eager_us": time_us(forward, device, graph=False)}
                    if device.type == "cuda":
                        row["graph_us"] = time_us(forward, device, graph=True)
                    rows.append(row)
                    del forward, attn, lora, x, residual
                base = rows[-1 - len(WORKLOADS)][key]
                for row in rows[-1 - len(WORKLOADS):]:
                    row["ratio"] = row[key] / base
                print(f"{phase} s={s} b={b}: " + " ".join(f"{r['workload']}={r[key]:.0f}us"
                                                       for r in rows[-1 - len(WORKLOADS):]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": args.preset,
            "rank": args.rank, "dtype": str(dtype), "timing": key, "seconds": time.time() - started,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    write_results(args.out, "layer", rows, meta)
    plot(rows, key, args.out / "layer.png",
         f"One {args.preset} layer, LoRA rank {args.rank} on 7 projections, {meta['device']} ({key})")
    print(meta)
    print(f"{key} without LoRA, and each workload's latency / that (ratio)")
    table = []
    for i in range(0, len(rows), 1 + len(WORKLOADS)):
        base, *loras = rows[i:i + 1 + len(WORKLOADS)]
        table.append({"phase": base["phase"], "seq_len": base["seq_len"], "batch": base["batch"],
                      "none_us": base[key], **{r["workload"]: f"{r['ratio']:.2f}x" for r in loras}})
    print(format_table(table, list(table[0])))


if __name__ == "__main__":
    main()
