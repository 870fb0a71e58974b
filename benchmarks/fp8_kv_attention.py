"""Paged attention on an fp8 KV cache against the same cache in bf16 (the FP8 issue's attention
targets: decode on fp8 pages at least 1.3x faster than on bf16 pages at batch 32, context 2,048;
chunked-prefill attention on fp8 pages no slower than on bf16).

    python -m benchmarks.fp8_kv_attention --out results/fp8_kv_attention

Llama-7B heads (32 query and 32 KV heads, head_dim 128), page size 16, pages scattered over the
cache (benchmarks.attention's copies: each point's K copies together over 4x the L2, captured in one
CUDA graph). The fp8 cache is the bf16 one quantized (punica.ops.kv_cache.quantize_kv_ref: e4m3
values, one fp32 scale per key or value row), so both read the same tokens through the same page
tables; each kernel's output is checked against punica.ops.attention.paged_attention_ref on its
own cache first.

* decode: batch 1, 8, 32 of one query over contexts of 512 and 2,048 tokens. Floors: the cache's
  bytes / copy bandwidth (bf16: 2 bytes an element; fp8: 1, plus 4 bytes of scale a row).
* chunk: one prompt's chunk of 512 queries over 2,048 cached tokens (context 2,560), the prefill
  kernel.
* decode's split count over the keys on both caches at batch 1-16 (few programs, few bytes each),
  and the prefill's on chunks of 64-512 queries over 2-8k cached tokens.
* sweeps of the tiles on both caches: decode's (BLOCK_N, num_warps, num_stages) at batch 32 and 1,
  context 2,048; the prefill kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) on the chunk and
  on a fresh prompt of 2,048 tokens (punica.ops.attention_triton's DECODE_CONFIG, PREFILL_CONFIG and
  their FP8_ twins are the defaults).

Writes fp8_kv_attention.json and fp8_kv_attention.png (decode on both caches) under --out.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import triton

from benchmarks.attention import DTYPE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PAGE_SIZE, graph_us, make_copies
from benchmarks.common import copy_bandwidth, save_figure, style_axes
from punica.ops import attention_triton as kernels
from punica.ops.attention import paged_attention_ref
from punica.ops.kv_cache import kv_bytes_per_token, quantize_kv_ref

DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (512, 2048)
CHUNK, CHUNK_CACHED = 512, 2048
SPLITS = (1, 2, 3, 4, 6, 8, 16)
# (batch, context): decode with few programs (batch x 32 KV heads x splits), bound by latency, not bytes
SPLIT_POINTS = ((1, 2048), (4, 2048), (8, 2048), (16, 2048), (8, 512))
# (chunk queries, cached tokens): a prompt's chunk beside decodes, few query tiles over a long context
PREFILL_SPLIT_POINTS = ((CHUNK, CHUNK_CACHED), (128, 4096), (64, 8192))
# kind -> (module constants for bf16 and fp8 pages, configurations, points as (batch, queries each, context))
SWEEPS = {
    "decode": (("DECODE_CONFIG", "FP8_DECODE_CONFIG"), ((64, 2, 3), (64, 4, 3), (128, 4, 3), (128, 4, 4)),
               ((32, 1, 2048), (1, 1, 2048))),
    "chunk": (("PREFILL_CONFIG", "FP8_PREFILL_CONFIG"),
              ((128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 2),
               (32, 128, 4, 2), (64, 256, 8, 2)),
              ((1, CHUNK, CHUNK_CACHED + CHUNK), (1, 2048, 2048))),
}


def caches(copies):
    """(bf16 pages, None) and (e4m3 pages, scales) of the copies' shared cache."""
    kv = copies[0].kv
    values, scales = quantize_kv_ref(kv)
    return {"bf16": (kv, None), "fp8": (values, scales)}


def run(copy, pages, scales, num_splits=None, prefill_splits=None):
    return kernels.paged_attention_triton(copy.q, pages, copy.batch, copy.scale, kv_scales=scales,
                                          num_splits=num_splits, prefill_splits=prefill_splits)


def reference(copy, pages, scales) -> torch.Tensor:
    return paged_attention_ref(copy.q, pages, copy.batch, copy.scale, kv_scales=scales).float()


def max_error(copy, pages, scales, ref=None, **splits) -> float:
    """The kernel's largest error against `ref` (the reference's output, computed when not given),
    with `splits` (run's num_splits, prefill_splits) forced."""
    ref = reference(copy, pages, scales) if ref is None else ref
    return (run(copy, pages, scales, **splits).float() - ref).abs().max().item()


def point(label, num_requests, query_len, context, num_prefills, bandwidth, l2, device, rng, gen) -> dict:
    copies, _ = make_copies(num_requests, query_len, context, num_prefills, l2, device, rng, gen)
    row = dict(kind=label, batch=num_requests, context=context, copies=len(copies))
    for kind, (pages, scales) in caches(copies).items():
        row[f"{kind}_max_abs_err"] = max_error(copies[0], pages, scales)
        row[f"{kind}_us"] = graph_us(copies, lambda c, p=pages, s=scales: run(c, p, s))
        if label == "decode":
            per_token = kv_bytes_per_token(1, NUM_KV_HEADS, HEAD_DIM, DTYPE, "fp8" if kind == "fp8" else "auto")
            row[f"{kind}_floor_us"] = num_requests * context * per_token / bandwidth * 1e6
    row["bf16_over_fp8"] = row["bf16_us"] / row["fp8_us"]
    print(json.dumps(row), flush=True)
    return row


def sweep(kind, l2, device, rng, gen) -> list[dict]:
    """Time each tile configuration of `kind` on bf16 and on fp8 pages (defaults restored after),
    output checked first."""
    names, configs, points = SWEEPS[kind]
    rows, defaults = [], [getattr(kernels, name) for name in names]
    for num_requests, query_len, context in points:
        copies, _ = make_copies(num_requests, query_len, context, int(kind == "chunk"), l2, device, rng, gen)
        for cache, (pages, scales) in caches(copies).items():
            name = names[cache == "fp8"]
            for config in configs:
                setattr(kernels, name, config)
                row = dict(kind=kind, cache=cache, batch=num_requests, queries=query_len, context=context,
                           config=list(config))
                try:
                    row["max_abs_err"] = max_error(copies[0], pages, scales)
                    row["us"] = graph_us(copies, lambda c, p=pages, s=scales: run(c, p, s))
                except triton.runtime.errors.OutOfResources as e:
                    row["error"] = str(e)
                rows.append(row)
                print(json.dumps(row), flush=True)
            setattr(kernels, name, defaults[cache == "fp8"])
    return rows


def split_sweep(l2, device, rng, gen) -> list[dict]:
    """Decode's split count over the keys (punica.ops.attention_triton.decode_partition) on both
    caches, where few programs read few bytes each; then the prefill's (prefill_split_count) on
    chunks over long cached contexts, each forced count's output checked first."""
    rows = []
    for num_requests, context in SPLIT_POINTS:
        copies, _ = make_copies(num_requests, 1, context, 0, l2, device, rng, gen)
        for cache, (pages, scales) in caches(copies).items():
            block_n = kernels._decode_blocks(HEAD_DIM, DTYPE, cache == "fp8")[0]
            default = kernels.decode_partition(num_requests, NUM_KV_HEADS, context, block_n, device)[1]
            row = dict(kind="splits", cache=cache, batch=num_requests, context=context, default_splits=default)
            for splits in SPLITS:
                row[f"splits{splits}_us"] = graph_us(copies, lambda c, p=pages, s=scales: run(c, p, s, splits))
            rows.append(row)
            print(json.dumps(row), flush=True)
    for chunk, cached in PREFILL_SPLIT_POINTS:
        context = chunk + cached
        copies, _ = make_copies(1, chunk, context, 1, l2, device, rng, gen)
        for cache, (pages, scales) in caches(copies).items():
            block_m = kernels._prefill_blocks(HEAD_DIM, DTYPE, cache == "fp8")[0]
            max_context = copies[0].batch.page_table.shape[1] * PAGE_SIZE
            default = kernels.prefill_split_count(chunk, block_m, NUM_HEADS, max_context, device)
            row = dict(kind="prefill_splits", cache=cache, queries=chunk, context=context, default_splits=default)
            ref = reference(copies[0], pages, scales)
            for splits in SPLITS:
                row[f"splits{splits}_max_abs_err"] = max_error(copies[0], pages, scales, ref, prefill_splits=splits)
                row[f"splits{splits}_us"] = graph_us(copies, lambda c, p=pages, s=scales: run(c, p, s, None, splits))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def plot(result: dict, path: Path) -> None:
    """Decode us against batch on both caches with the fp8 floor, one panel per context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    decodes = [p for p in result["points"] if p["kind"] == "decode"]
    contexts = sorted({p["context"] for p in decodes})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 3.4))
    for ax, context in zip(axes, contexts):
        rows = sorted((p for p in decodes if p["context"] == context), key=lambda p: p["batch"])
        batches = [p["batch"] for p in rows]
        for key, label, style in (("bf16_us", "bf16 pages", "o-"), ("fp8_us", "fp8 pages", "s-"),
                                  ("fp8_floor_us", "fp8 floor", "k--")):
            ax.plot(batches, [p[key] for p in rows], style, label=label)
        style_axes(ax, f"decode, context {context}", "batch", "us per call", log_y=True)
        ax.legend(fontsize=7)
    save_figure(fig, path, f"paged attention on an fp8 KV cache ({result['device']})")
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/fp8_kv_attention")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweeps", nargs="*", choices=[*SWEEPS, "splits"], default=[*SWEEPS, "splits"],
                        help="the fp8 tile sweeps to run (none: --sweeps with no value)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    rng, gen = random.Random(args.seed), torch.Generator(device=device).manual_seed(args.seed)
    started = time.time()
    bandwidth, l2 = copy_bandwidth(device), props.L2_cache_size
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, L2 {l2 >> 20} MiB", flush=True)
    points = [point("decode", b, 1, c, 0, bandwidth, l2, device, rng, gen)
              for c in DECODE_CONTEXTS for b in DECODE_BATCHES]
    points.append(point("chunk", 1, CHUNK, CHUNK_CACHED + CHUNK, 1, bandwidth, l2, device, rng, gen))
    tiles = [row for kind in args.sweeps if kind in SWEEPS for row in sweep(kind, l2, device, rng, gen)]
    splits = split_sweep(l2, device, rng, gen) if "splits" in args.sweeps else []
    result = dict(device=props.name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  triton=triton.__version__, copy_bandwidth_Bps=bandwidth, l2_bytes=l2,
                  fp8_decode_config=list(kernels.FP8_DECODE_CONFIG),
                  fp8_prefill_config=list(kernels.FP8_PREFILL_CONFIG), seconds=time.time() - started,
                  points=points, sweep=tiles, splits=splits)
    (out / "fp8_kv_attention.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "fp8_kv_attention.png")
    print(f"\nus per call, CUDA-graph replay; 32/32 heads, head_dim 128, page 16 ({props.name})")
    print(f"{'kind':7} {'batch':>5} {'context':>7} {'bf16':>8} {'fp8':>8} {'bf16/fp8':>8} {'fp8 floor':>9} "
          f"{'fp8/floor':>9}")
    for p in points:
        floor = p.get("fp8_floor_us")
        tail = f"{floor:9.1f} {p['fp8_us'] / floor:8.2f}x" if floor else ""
        print(f"{p['kind']:7} {p['batch']:5} {p['context']:7} {p['bf16_us']:8.1f} {p['fp8_us']:8.1f} "
              f"{p['bf16_over_fp8']:7.2f}x {tail}")
    for row in tiles:
        mark = "*" if tuple(row["config"]) == getattr(kernels, SWEEPS[row["kind"]][0][row["cache"] == "fp8"]) else " "
        print(f"{mark} {row['cache']:4} {row['kind']:6} {row['batch']:3} x {row['queries']:4} / {row['context']:5} "
              f"{str(row['config']):17} "
              + (f"{row['us']:8.1f} err {row['max_abs_err']:.1e}" if "us" in row else row["error"][:40]))
    for row in splits:
        times = "  ".join(f"{n}: {row[f'splits{n}_us']:6.1f}" for n in SPLITS)
        kind, count = ("decode", row["batch"]) if row["kind"] == "splits" else ("chunk ", row["queries"])
        print(f"  {row['cache']:4} {kind} {count:3} x {row['context']:5} splits "
              f"(default {row['default_splits']}) {times}")


if __name__ == "__main__":
    main()
