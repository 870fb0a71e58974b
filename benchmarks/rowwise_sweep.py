"""Configurations of the row-wise (BGMV) LoRA kernels, timed where decode runs them: one layer's
decode step with LoRA on its 7 projections.

    python -m benchmarks.rowwise_sweep [--preset llama-2-7b] [--batches 1 8 32] [--seq-len 512]
        [--tiles 4096 8192 16384] [--warps 2 4 8] [--compare-delta] [--out results/rowwise_sweep]

For each kernel (shrink, expand) and each (tile, warps) of --tiles x --warps, that kernel's
SHRINK_/EXPAND_ROWWISE_TILE and _WARPS (punica.ops.lora_triton) are set to it, the other kernel
keeps the module's values, and layer 0 of a one-layer dummy model of --preset runs a decode step
of each batch (--seq-len cached tokens per request) for distinct and identical rank-16 adapters,
captured in a CUDA graph (benchmarks.layer.time_us: median us per replay); the layer without LoRA
is timed once per batch. lora_us = the layer's us - the no-LoRA layer's. Writes
rowwise_sweep.json under --out and prints the configurations best first.

With --compare-delta, the kernels keep the module's configurations and the layer runs with the
expand's delta beside the base GEMM (punica.lora.layers.SIDE_STREAM_DELTA_MAX_TOKENS) and
without, twice each in turn.
"""

from __future__ import annotations

import argparse
import random
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import format_table, write_results
from benchmarks.layer import PAGE_SIZE, build, step_batches, time_us
from punica.config import ceil_div
from punica.lora import layers as lora_layers
from punica.models.forward_batch import ForwardBatch
from punica.ops import lora_triton
from punica.workloads import adapter_ids

WORKLOADS = ("distinct", "identical")


def layer_us(model, kv_cache, num_pages, batch, seq_len, slots, rng) -> float:
    attn, lora = step_batches("decode", batch, seq_len, slots, num_pages, "cuda", rng)
    x = torch.randn(attn.num_tokens, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    return time_us(partial(model.layers[0], x, torch.randn_like(x), ForwardBatch(attn, lora, kv_cache)),
                   torch.device("cuda"), graph=True)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--tiles", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--compare-delta", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("results/rowwise_sweep"))
    args = parser.parse_args()
    started = time.time()
    model = build(args.preset, 16, max(args.batches), torch.bfloat16, "cuda")
    num_pages = max(args.batches) * ceil_div(args.seq_len + 1, PAGE_SIZE)
    kv_cache = model.new_kv_cache(num_pages, PAGE_SIZE)
    rng = random.Random(0)
    measure = partial(layer_us, model, kv_cache, num_pages, seq_len=args.seq_len, rng=rng)
    base = {b: measure(batch=b, slots=[-1] * b) for b in args.batches}
    in_use = {k: (getattr(lora_triton, f"{k}_ROWWISE_TILE"), getattr(lora_triton, f"{k}_ROWWISE_WARPS"))
              for k in ("SHRINK", "EXPAND")}
    rows = []

    def lora_row(row: dict) -> dict:
        for b in args.batches:
            for workload in WORKLOADS:
                slots = sorted(adapter_ids(workload, b, rng))
                row[f"{workload}_b{b}_lora_us"] = measure(batch=b, slots=slots) - base[b]
        row["sum_lora_us"] = sum(v for k, v in row.items() if k.endswith("_lora_us"))
        print(row, flush=True)
        return row

    if args.compare_delta:
        max_tokens = lora_layers.SIDE_STREAM_DELTA_MAX_TOKENS
        for _ in range(2):
            for side_delta in (True, False):
                lora_layers.SIDE_STREAM_DELTA_MAX_TOKENS = max_tokens if side_delta else 0
                rows.append(lora_row({"kernel": "side-stream delta" if side_delta else "expand after the GEMM",
                                      "tile": in_use["EXPAND"][0], "warps": in_use["EXPAND"][1], "in_use": True}))
        lora_layers.SIDE_STREAM_DELTA_MAX_TOKENS = max_tokens
    else:
        for kernel in ("SHRINK", "EXPAND"):
            for tile in args.tiles:
                for warps in args.warps:
                    setattr(lora_triton, f"{kernel}_ROWWISE_TILE", tile)
                    setattr(lora_triton, f"{kernel}_ROWWISE_WARPS", warps)
                    rows.append(lora_row({"kernel": kernel.lower(), "tile": tile, "warps": warps,
                                          "in_use": (tile, warps) == in_use[kernel]}))
            setattr(lora_triton, f"{kernel}_ROWWISE_TILE", in_use[kernel][0])
            setattr(lora_triton, f"{kernel}_ROWWISE_WARPS", in_use[kernel][1])
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "seq_len": args.seq_len,
            "no_lora_layer_us": base, "seconds": time.time() - started, "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__}
    write_results(args.out, "rowwise_sweep", rows, meta)
    print(f"layer without LoRA (us): {base}")
    columns = ["kernel", "tile", "warps", "in_use"] + [f"{w}_b{b}_lora_us" for b in args.batches
                                                       for w in WORKLOADS] + ["sum_lora_us"]
    print(format_table(sorted(rows, key=lambda r: (r["kernel"], r["sum_lora_us"])), columns))


if __name__ == "__main__":
    main()
