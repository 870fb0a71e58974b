"""Paged attention on the H200: the Triton kernels against the memory floor and against torch's
scaled_dot_product_attention (SDPA).

    python -m benchmarks.attention --out results/attention

Llama-7B shapes (32 query and 32 KV heads, head_dim 128), bf16, page size 16, pages scattered
over the cache. Decode: batch 1..32 of one query each over contexts of 512 and 2048 tokens;
prefill: one fresh prompt of 2048 tokens (causal). Each point is timed with K copies of the
call (own queries and pages, together over ROTATE_L2 times the L2 size, so every copy starts
cold) captured in one CUDA graph, median of triton.testing.do_bench per replay / K.

* triton: punica.ops.attention_triton.paged_attention_triton (decode: partitions + merge; with
  one split, as the default gives batch 32 here, the partition kernel alone).
* sdpa: SDPA on K/V already contiguous as [batch, heads, context, head_dim] (what a
  non-paged cache would give; no gather).
* gather_sdpa: gather each request's pages into that layout, then SDPA (a paged cache
  without a paged kernel).

Floors: decode moves the KV cache once: bytes / copy bandwidth (1 GiB device-to-device copy,
bytes read + written, same run). Prefill: the larger of causal FLOPs / measured bf16 matmul
rate (8192^3, same run) and (q, k, v, out) bytes / copy bandwidth. A sweep of the decode split
count at context 2048 (splits 1: one launch, no merge) checks the default policy
(punica.ops.attention_triton.decode_partition), and a sweep of tile configurations
(PREFILL_CONFIG, DECODE_CONFIG there) at a few points checks the defaults, each
configuration's output checked against the reference first.
Writes attention.json under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth
from punica.ops import attention_triton as kernels
from punica.ops.attention import AttnBatch, paged_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 32, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (512, 2048)
PREFILL_TOKENS = 2048
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
ROTATE_L2 = 4
MAX_COPIES = 64
METHODS = ("triton", "sdpa", "gather_sdpa")
TUNE = {  # kind -> (module constant, configurations, points as (batch, context))
    "decode": ("DECODE_CONFIG", ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 2, 3)),
               ((32, 2048), (4, 2048))),
    "prefill": ("PREFILL_CONFIG", ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                                   (128, 32, 4, 4)), ((1, 2048),)),
}


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def matmul_flops(device) -> float:
    """bf16 8192^3 matrix product on random data, FLOP per second."""
    a = torch.randn(8192, 8192, device=device, dtype=DTYPE)
    b = torch.randn(8192, 8192, device=device, dtype=DTYPE)
    return 2 * 8192**3 / (median_ms(lambda: a @ b) * 1e-3)


class Copy:
    """One copy of the call: its queries, its scattered pages in the shared cache, and the same
    K/V gathered contiguously for SDPA."""

    def __init__(self, kv, pages, query_lens, context_lens, num_prefills, gen):
        device = kv.device
        self.batch = AttnBatch.build(query_lens, context_lens, pages, PAGE_SIZE, num_prefills, device=device)
        self.q = torch.randn(self.batch.num_tokens, NUM_HEADS, HEAD_DIM, device=device, generator=gen, dtype=DTYPE)
        self.kv = kv
        self.context = context_lens[0]
        self.num_requests = len(query_lens)
        self.query_len = query_lens[0]
        self.k, self.v = self.gather()
        self.q_sdpa = self.q.reshape(self.num_requests, self.query_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        self.scale = HEAD_DIM ** -0.5

    def gather(self):
        cached = self.kv[self.batch.page_table.long()]  # [B, pages, 2, page_size, Hkv, D]
        shape = (self.num_requests, -1, NUM_KV_HEADS, HEAD_DIM)
        k = cached[:, :, 0].reshape(shape)[:, :self.context].transpose(1, 2)
        v = cached[:, :, 1].reshape(shape)[:, :self.context].transpose(1, 2)
        return k, v

    def triton(self, num_splits=None):
        kernels.paged_attention_triton(self.q, self.kv, self.batch, self.scale, num_splits=num_splits)

    def sdpa(self):
        F.scaled_dot_product_attention(self.q_sdpa, self.k, self.v, is_causal=self.query_len > 1,
                                       scale=self.scale)

    def gather_sdpa(self):
        k, v = self.gather()
        F.scaled_dot_product_attention(self.q_sdpa, k, v, is_causal=self.query_len > 1, scale=self.scale)


def make_copies(num_requests, query_len, context, num_prefills, l2_bytes, device, rng, gen):
    kv_bytes = num_requests * context * 2 * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = max(1, min(MAX_COPIES, triton.cdiv(ROTATE_L2 * l2_bytes, kv_bytes)))
    pages_each = triton.cdiv(context, PAGE_SIZE)
    num_pages = copies * num_requests * pages_each
    kv = torch.randn(num_pages, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, generator=gen, dtype=DTYPE)
    order = list(range(num_pages))
    rng.shuffle(order)
    out = []
    for c in range(copies):
        base = c * num_requests * pages_each
        tables = [order[base + r * pages_each: base + (r + 1) * pages_each] for r in range(num_requests)]
        out.append(Copy(kv, tables, [query_len] * num_requests, [context] * num_requests, num_prefills, gen))
    return out, kv_bytes


def graph_us(copies, call) -> float:
    """Microseconds per call: all copies captured in one graph, median replay / copies."""
    for c in copies[:1]:
        call(c)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            call(c)
    us = median_ms(graph.replay) * 1e3 / len(copies)
    del graph
    return us


def measure(kind, num_requests, context, bandwidth, flops, l2_bytes, device, rng, gen, split_sweep=()):
    query_len = context if kind == "prefill" else 1
    copies, kv_bytes = make_copies(num_requests, query_len, context, int(kind == "prefill"), l2_bytes,
                                   device, rng, gen)
    point = dict(kind=kind, batch=num_requests, context=context, copies=len(copies))
    for method in METHODS:
        point[f"{method}_us"] = graph_us(copies, getattr(Copy, method))
    if kind == "decode":
        point["floor_us"] = kv_bytes / bandwidth * 1e6
        block_n = kernels._decode_blocks(HEAD_DIM, DTYPE)[0]
        point["default_splits"] = kernels.decode_partition(num_requests, NUM_KV_HEADS, context, block_n, device)[1]
        for splits in split_sweep:
            point[f"triton_splits{splits}_us"] = graph_us(copies, lambda c: c.triton(num_splits=splits))
    else:
        causal_flops = 4 * NUM_HEADS * HEAD_DIM * context * (context + 1) / 2
        io_bytes = 4 * context * NUM_HEADS * HEAD_DIM * DTYPE.itemsize
        point["floor_us"] = max(causal_flops / flops, io_bytes / bandwidth) * 1e6
        point["triton_tflops"] = causal_flops / point["triton_us"] / 1e6
        point["sdpa_tflops"] = causal_flops / point["sdpa_us"] / 1e6
    return point


def tune(kind, l2_bytes, device, rng, gen) -> list[dict]:
    """Time each tile configuration of `kind` (default restored after), output checked first."""
    name, configs, sizes = TUNE[kind]
    default = getattr(kernels, name)
    rows = []
    for num_requests, context in sizes:
        query_len = context if kind == "prefill" else 1
        copies, _ = make_copies(num_requests, query_len, context, int(kind == "prefill"), l2_bytes, device, rng, gen)
        c = copies[0]
        ref = paged_attention_ref(c.q, c.kv, c.batch, c.scale).float()
        for config in configs:
            setattr(kernels, name, config)
            row = dict(kind=kind, batch=num_requests, context=context, config=list(config))
            try:
                out = kernels.paged_attention_triton(c.q, c.kv, c.batch, c.scale)
            except triton.runtime.errors.OutOfResources as e:
                rows.append(dict(row, error=str(e)))
                continue
            row["max_abs_err"] = (out.float() - ref).abs().max().item()
            row["us"] = graph_us(copies, Copy.triton)
            rows.append(row)
            print(json.dumps(row), flush=True)
        setattr(kernels, name, default)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/attention")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    started = time.time()
    bandwidth, flops = copy_bandwidth(device), matmul_flops(device)
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s, "
          f"L2 {props.L2_cache_size >> 20} MiB", flush=True)
    points = []
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            sweep = SPLIT_SWEEP if context == 2048 and batch in (1, 32) else ()
            points.append(measure("decode", batch, context, bandwidth, flops, props.L2_cache_size, device,
                                  rng, gen, sweep))
            print(json.dumps(points[-1]), flush=True)
    points.append(measure("prefill", 1, PREFILL_TOKENS, bandwidth, flops, props.L2_cache_size, device, rng, gen))
    print(json.dumps(points[-1]), flush=True)
    tuning = [row for kind in TUNE for row in tune(kind, props.L2_cache_size, device, rng, gen)]
    result = dict(device=props.name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  triton=triton.__version__, copy_bandwidth_Bps=bandwidth, matmul_flops=flops,
                  l2_bytes=props.L2_cache_size, seconds=time.time() - started, points=points,
                  tuning=tuning)
    (out / "attention.json").write_text(json.dumps(result, indent=1))
    print_table(points, tuning)


def print_table(points, tuning):
    print("\ntile configurations (us; * = default):")
    for row in tuning:
        mark = "*" if tuple(row["config"]) == getattr(kernels, TUNE[row["kind"]][0]) else " "
        result = f"{row['us']:8.1f} err {row['max_abs_err']:.1e}" if "us" in row else row["error"][:40]
        print(f"{mark} {row['kind']:7} {row['batch']:3} x {row['context']:5} {str(row['config']):17} {result}")
    print("\nus per call, CUDA-graph replay; Llama-7B heads (32/32, head_dim 128), bf16, page 16")
    print(f"{'kind':7} {'batch':>5} {'context':>7} {'triton':>8} {'sdpa':>8} {'gather+sdpa':>11} "
          f"{'floor':>7} {'triton/floor':>12} {'sdpa/triton':>11}")
    for p in points:
        print(f"{p['kind']:7} {p['batch']:5} {p['context']:7} {p['triton_us']:8.1f} {p['sdpa_us']:8.1f} "
              f"{p['gather_sdpa_us']:11.1f} {p['floor_us']:7.1f} {p['triton_us'] / p['floor_us']:11.2f}x "
              f"{p['sdpa_us'] / p['triton_us']:10.2f}x")


if __name__ == "__main__":
    main()
