"""The paper's operator benchmark: SGMV/BGMV (shrink + expand) against Loop, Gather-BMM and
the memory floor, for the four adapter-popularity workloads.

    python -m benchmarks.lora_op --out results/lora_op

Decode batches are 1..64 requests of one token; prefill batches are 256..4096 tokens in 16
requests of equal length. h_in = 4096, h_out in {4096, 11008}, rank 16, bf16; then a rank
sweep. Each point is timed two ways, median of triton.testing.do_bench:

* graph: K copies of the operation (each with its own x, y and adapters, together over
  ROTATE_L2 times the L2 size, so every copy starts cold) captured in one CUDA graph;
  time per replay / K. This is the cost of one LoRA op inside a captured model step.
* eager: the same K calls from Python, time / K.

Loop is one (x @ A.T) @ B.T per segment; Gather-BMM gathers every token's A and B and runs
torch.bmm twice. The floor is the bytes the op must move (x, each distinct adapter's A and
B, y read and written, v written and read) over the device-to-device copy bandwidth measured
in the same run; prefill points also time the SGMV shrink and expand alone, each against its
own bytes, beside two plain kernels that move the same bytes and do no LoRA work (a Triton row
sum of x, torch's y.add_(1)): what a streaming kernel of that size reaches on this device.
Writes lora_op.json and lora_op.png under --out, prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import copy_bandwidth, save_figure, style_axes
from punica.lora.batch import LoraBatch
from punica.ops import lora_triton as kernels
from punica.workloads import WORKLOADS, adapter_ids

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 48, 64)
PREFILL_TOKENS = (256, 512, 1024, 2048, 4096)
PREFILL_REQUESTS = 16
H_IN = 4096
H_OUTS = (4096, 11008)
RANK = 16
RANK_SWEEP = (8, 16, 32, 64)
ROTATE_L2 = 4
MAX_COPIES = 256
METHODS = ("sgmv", "bgmv", "loop", "gather_bmm")


@triton.jit
def _row_sum_kernel(x, out, num_cols, stride_x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[rows] = sum of x[rows]: the read-only probe (one load of BLOCK_M whole rows)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    tile = tl.load(x + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=(cols < num_cols)[None, :],
                   other=0.0)
    tl.store(out + rows, tl.sum(tile.to(tl.float32), axis=1))


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


class Instance:
    """One copy of the operation: its own tensors and adapters."""

    def __init__(self, slots, lens, num_adapters, h_out, rank, device, gen):
        dtype = torch.bfloat16
        self.num_tokens = sum(lens)
        self.lora_a = torch.randn(num_adapters, rank, H_IN, device=device, generator=gen, dtype=dtype)
        self.lora_a /= H_IN**0.5
        self.lora_b = torch.randn(num_adapters, h_out, rank, device=device, generator=gen, dtype=dtype)
        self.lora_b *= 1e-2
        self.scales = torch.rand(num_adapters, device=device, generator=gen) + 0.5
        self.x = torch.randn(self.num_tokens, H_IN, device=device, generator=gen, dtype=dtype)
        self.y = torch.randn(self.num_tokens, h_out, device=device, generator=gen, dtype=dtype)
        self.v = torch.empty(self.num_tokens, rank, device=device)
        self.row_sums = torch.empty(self.num_tokens, device=device)
        self.batch = LoraBatch.build(slots, lens, device=device, kernel="sgmv")  # segments for SGMV and Loop
        # host-side segments for Loop (fixed per capture, as a Python loop must be)
        bounds = self.batch.seg_indptr.tolist()
        self.segments = [(s, bounds[i], bounds[i + 1]) for i, s in enumerate(self.batch.seg_slots.tolist())]

    def sgmv(self):
        self.sgmv_shrink()
        self.sgmv_expand()

    def sgmv_shrink(self):
        b = self.batch
        kernels.sgmv_shrink_triton(self.x, self.lora_a, b.seg_indptr, b.seg_slots, out=self.v)

    def sgmv_expand(self):
        b = self.batch
        kernels.sgmv_expand_triton(self.y, self.v, self.lora_b, b.seg_indptr, b.seg_slots, self.scales)

    def bgmv(self):
        b = self.batch
        kernels.bgmv_shrink_triton(self.x, self.lora_a, b.token_slots, out=self.v)
        kernels.bgmv_expand_triton(self.y, self.v, self.lora_b, b.token_slots, self.scales)

    def read_x(self):
        block_m = 2  # whole rows, two per program: the fastest of the shapes tried on the H200
        _row_sum_kernel[(triton.cdiv(self.num_tokens, block_m),)](
            self.x, self.row_sums, H_IN, self.x.stride(0), BLOCK_M=block_m, BLOCK_K=triton.next_power_of_2(H_IN))

    def add_y(self):
        self.y.add_(1.0)

    def loop(self):
        for slot, lo, hi in self.segments:
            v = self.x[lo:hi] @ self.lora_a[slot].T
            self.y[lo:hi] += (v @ self.lora_b[slot].T) * self.scales[slot]

    def gather_bmm(self):
        slots = self.batch.token_slots.long()
        a = self.lora_a[slots]                            # [T, r, h_in]
        b = self.lora_b[slots]                            # [T, h_out, r]
        v = torch.bmm(self.x.unsqueeze(1), a.transpose(1, 2))   # [T, 1, r]
        delta = torch.bmm(v, b.transpose(1, 2)).squeeze(1)      # [T, h_out]
        self.y += delta * self.scales[slots].unsqueeze(1).to(delta.dtype)


def part_bytes(num_tokens, num_distinct, h_out, rank) -> dict[str, int]:
    """Bytes each kernel must move: the shrink reads x and A and writes v; the expand reads v
    and B and reads and writes y."""
    return {"sgmv_shrink": num_tokens * H_IN * 2 + num_distinct * rank * H_IN * 2 + num_tokens * rank * 4,
            "sgmv_expand": num_tokens * rank * 4 + num_distinct * h_out * rank * 2 + num_tokens * h_out * 2 * 2}


def probe_bytes(num_tokens, h_out) -> dict[str, int]:
    """Bytes of the plain kernels: the shrink's x read, the expand's y read and written."""
    return {"read_x": num_tokens * H_IN * 2, "add_y": num_tokens * h_out * 2 * 2}


def floor_bytes(num_tokens, num_distinct, h_out, rank) -> int:
    return sum(part_bytes(num_tokens, num_distinct, h_out, rank).values())


def measure_point(kind, workload, size, h_out, rank, bandwidth, l2_bytes, device, rng):
    if kind == "decode":
        num_requests, lens = size, [1] * size
    else:
        num_requests, lens = PREFILL_REQUESTS, [size // PREFILL_REQUESTS] * PREFILL_REQUESTS
    ids = sorted(adapter_ids(workload, num_requests, rng))
    num_distinct = len(set(ids))
    num_tokens = sum(lens)
    nbytes = floor_bytes(num_tokens, num_distinct, h_out, rank)
    copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_L2 * l2_bytes / nbytes)))
    gen = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
    # ids are renumbered 0..num_distinct-1 so each copy holds only the adapters it uses
    renumber = {a: i for i, a in enumerate(sorted(set(ids)))}
    slots = [renumber[a] for a in ids]
    instances = [Instance(slots, lens, num_distinct, h_out, rank, device, gen) for _ in range(copies)]
    point = dict(kind=kind, workload=workload, size=size, num_tokens=num_tokens, h_in=H_IN, h_out=h_out,
                 rank=rank, num_distinct=num_distinct, num_segments=instances[0].batch.seg_slots.numel(),
                 sgmv_block_m=kernels.sgmv_block_m(num_tokens, instances[0].batch.seg_slots.numel()),
                 copies=copies, floor_bytes=nbytes, floor_us=nbytes / bandwidth * 1e6)
    parts = {}  # prefill: each SGMV kernel alone, and the probes, against their own bytes
    if kind == "prefill":
        parts = part_bytes(num_tokens, num_distinct, h_out, rank) | probe_bytes(num_tokens, h_out)
    for part, part_nbytes in parts.items():
        point[f"{part}_floor_us"] = part_nbytes / bandwidth * 1e6
    for method in METHODS + tuple(parts):
        run_all = [getattr(inst, method) for inst in instances]

        def eager():
            for f in run_all:
                f()

        eager()  # compile / warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        point[f"{method}_graph_us"] = median_ms(graph.replay) * 1e3 / copies
        point[f"{method}_eager_us"] = median_ms(eager) * 1e3 / copies
        del graph
    del instances
    torch.cuda.empty_cache()
    return point


def plot(points, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(2, 4, figsize=(14, 6.5), sharey="row")
    for row, kind in enumerate(("decode", "prefill")):
        for col, workload in enumerate(WORKLOADS):
            ax = axes[row][col]
            sel = [p for p in points if p["kind"] == kind and p["workload"] == workload
                   and p["h_out"] == 4096 and p["rank"] == RANK]
            xs = [p["size"] for p in sel]
            for method in METHODS:
                ax.plot(xs, [p[f"{method}_graph_us"] for p in sel], marker="o", ms=3, label=method)
            ax.plot(xs, [p["floor_us"] for p in sel], "k--", label="memory floor")
            style_axes(ax, f"{workload}, {kind}", "batch size (requests)" if kind == "decode" else "tokens",
                       "us per op (graph replay)" if col == 0 else None, log_y=True)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, f"LoRA shrink+expand, h={H_IN}->4096, r={RANK}, bf16, {torch.cuda.get_device_name()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/lora_op")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    rng = random.Random(args.seed)
    started = time.time()
    bandwidth = copy_bandwidth(device)
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, L2 {props.L2_cache_size >> 20} MiB")
    grid = [("decode", w, b, h, RANK) for h in H_OUTS for w in WORKLOADS for b in DECODE_BATCHES]
    grid += [("prefill", w, t, h, RANK) for h in H_OUTS for w in WORKLOADS for t in PREFILL_TOKENS]
    grid += [("decode", "distinct", 64, 4096, r) for r in RANK_SWEEP if r != RANK]
    grid += [("prefill", "uniform", 4096, 4096, r) for r in RANK_SWEEP if r != RANK]
    points = []
    for spec in grid:
        points.append(measure_point(*spec, bandwidth, props.L2_cache_size, device, rng))
        p = points[-1]
        print(f"{p['kind']:7} {p['workload']:9} {p['size']:5} h_out={p['h_out']:5} r={p['rank']:3} "
              + " ".join(f"{m}={p[f'{m}_graph_us']:.1f}/{p[f'{m}_eager_us']:.1f}" for m in METHODS)
              + f" floor={p['floor_us']:.1f} us", flush=True)
    result = dict(device=props.name, date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  triton=triton.__version__, copy_bandwidth_Bps=bandwidth, l2_bytes=props.L2_cache_size,
                  seconds=time.time() - started, points=points)
    (out / "lora_op.json").write_text(json.dumps(result, indent=1))
    plot(points, out / "lora_op.png")
    print_table(points)


def print_table(points):
    print("\nus per op, CUDA-graph replay (eager in the JSON); h_out=4096, r=16, bf16")
    print(f"{'workload':9} {'batch':>5} {'sgmv':>7} {'bgmv':>7} {'loop':>8} {'gbmm':>8} {'floor':>6} "
          f"{'%bw':>4} {'gbmm/best':>9} {'loop/best':>9}")
    for p in points:
        if p["h_out"] != 4096 or p["rank"] != RANK or p["size"] not in (1, 8, 16, 32, 64, 1024, 4096):
            continue
        best = min(p["sgmv_graph_us"], p["bgmv_graph_us"])
        print(f"{p['workload']:9} {p['size']:5} {p['sgmv_graph_us']:7.1f} {p['bgmv_graph_us']:7.1f} "
              f"{p['loop_graph_us']:8.1f} {p['gather_bmm_graph_us']:8.1f} {p['floor_us']:6.1f} "
              f"{100 * p['floor_us'] / best:4.0f} {p['gather_bmm_graph_us'] / best:9.1f} "
              f"{p['loop_graph_us'] / best:9.1f}")
    print("\nprefill 4096 tokens, graph replay, us and share of copy bandwidth: each SGMV kernel alone, and "
          "plain kernels of the same bytes (read_x: the shrink's x; add_y: the expand's y)")
    for p in points:
        if p["kind"] == "prefill" and p["size"] == 4096 and p["rank"] == RANK:
            print(f"{p['workload']:9} h_out={p['h_out']:5} " + " ".join(
                f"{part}={p[f'{part}_graph_us']:.1f} ({100 * p[f'{part}_floor_us'] / p[f'{part}_graph_us']:.0f}%)"
                for part in ("sgmv_shrink", "sgmv_expand", "read_x", "add_y")))
    decode = [p for p in points if p["kind"] == "decode" and p["h_out"] == 4096 and p["rank"] == RANK]
    worst = max(decode, key=lambda p: min(p["sgmv_graph_us"], p["bgmv_graph_us"]))
    print(f"worst decode point (batch 1..64, 4 workloads): {worst['workload']} batch {worst['size']}: "
          f"{min(worst['sgmv_graph_us'], worst['bgmv_graph_us']):.1f} us")


if __name__ == "__main__":
    main()
