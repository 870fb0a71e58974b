"""The CPU paths of punica.ops.linear on a model's four projections over all its layers, per row
count: F.linear, W @ x^T (the unpacked path up to MAX_CPU_SKINNY_ROWS rows) and the packed weight
(oneDNN's blocked layout, punica.ops.linear.PackedWeight).

    python -m benchmarks.cpu_linear [--model DIR] [--rows 1 2 3 4 8 9 16 17 32 512] [--rounds 5]
        [--out results/cpu_linear]

Random fp32 weights of the model's shapes (qkv, o, gate_up, down; the embedded model by default),
one set per layer so that a pass streams them from memory as a step does. A point is one pass of
x [rows, K] through every layer's weight of each projection, summed over the four; rounds
interleave the paths and the row counts, and each point is the fastest round (a 2-core machine's
other work only ever slows a round). Each path's output is checked against F.linear first. Writes
cpu_linear.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import format_table, gemm_shapes, write_results
from punica.config import ModelConfig
from punica.models.sources import resolve_model_dir
from punica.ops.linear import MAX_CPU_SKINNY_ROWS, PackedWeight, cpu_packing_available, linear, packed_linear


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 9, 12, 16, 17, 24, 32, 64, 512,
                                                                2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/cpu_linear"))
    args = parser.parse_args()
    if not cpu_packing_available():
        raise SystemExit("this CPU build of torch has no oneDNN fp32 weight reorder (x86 with AVX2 or AVX-512)")

    config = ModelConfig.from_dir(resolve_model_dir(args.model))
    gen = torch.Generator().manual_seed(0)
    shapes = gemm_shapes(config)
    weights = {name: [torch.randn(*shape, generator=gen) for _ in range(config.num_layers)]
               for name, shape in shapes.items()}
    packs = {name: [PackedWeight(w) for w in ws] for name, ws in weights.items()}
    # linear() without a packed weight is W @ x^T up to MAX_CPU_SKINNY_ROWS fp32 rows (the only rows run)
    paths = {"F.linear": lambda x, w, p: F.linear(x, w), "W @ x^T": lambda x, w, p: linear(x, w),
             "packed": lambda x, w, p: packed_linear(x, w, None, p)}

    inputs = {rows: {name: torch.randn(rows, shape[1], generator=gen) for name, shape in shapes.items()}
              for rows in args.rows}
    for rows in args.rows:
        for path, run in paths.items():
            if path != "W @ x^T" or rows <= MAX_CPU_SKINNY_ROWS:
                x, w = inputs[rows]["qkv"], weights["qkv"][0]
                torch.testing.assert_close(run(x, w, packs["qkv"][0]), F.linear(x, w), rtol=1e-4, atol=1e-4)

    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            for path, run in paths.items():
                if path == "W @ x^T" and rows > MAX_CPU_SKINNY_ROWS:
                    continue
                start = time.perf_counter()
                for name in shapes:
                    x = inputs[rows][name]
                    for w, p in zip(weights[name], packs[name]):
                        run(x, w, p)
                times.setdefault((rows, path), []).append(time.perf_counter() - start)

    flops_per_row = 2 * config.num_layers * sum(n * k for n, k in shapes.values())
    result_rows = []
    for rows in args.rows:
        row = {"rows": rows}
        for path in paths:
            if (rows, path) in times:
                row[f"{path} ms"] = round(min(times[rows, path]) * 1e3, 1)
        row["packed GFLOP/s"] = round(rows * flops_per_row / min(times[rows, "packed"]) / 1e9, 1)
        result_rows.append(row)
    meta = {"model": str(resolve_model_dir(args.model)), "layers": config.num_layers, "shapes": shapes,
            "rounds": args.rounds, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "capability": torch.backends.cpu.get_cpu_capability()}
    path = write_results(args.out, "cpu_linear", result_rows, meta)
    print(f"wrote {path}")
    print(format_table(result_rows, ["rows", *(f"{p} ms" for p in paths), "packed GFLOP/s"]))


if __name__ == "__main__":
    main()
