"""Decode's GEMMs: cuBLAS (F.linear) against the skinny Triton GEMM's tiles, by the weight bytes' floor.

    python -m benchmarks.decode_gemm [--preset llama-2-7b] [--tokens 1 8 32] [--out results/decode_gemm]

For each fused projection of --preset (qkv, o, gate_up, down) and lm_head, and each token count:
F.linear and punica.ops.linear_triton.skinny_linear_triton with every tile of TILES (block_n,
block_k, split_k, num_warps, num_stages), bf16, each output checked against F.linear's first
(relative Frobenius error). Each point is timed as the model runs it: K calls on their own
weights and inputs (together over ROTATE_L2 times the L2 size, so every call reads its weight
from memory) captured in one CUDA graph, median replay (triton.testing.do_bench) / K.
floor_us = weight bytes / copy bandwidth (read + written, 1 GiB device-to-device, same run).
`default` is the tile punica.ops.linear_tiles.skinny_tile picks (None: cuBLAS runs it), default_us
its time. CUDA only. Writes decode_gemm.json and decode_gemm.png, and prints a table last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth, format_table, graph_us, save_figure, style_axes, write_results
from punica.config import preset_config
from punica.ops.linear_tiles import Tile, skinny_tile
from punica.ops.linear_triton import skinny_linear_triton

TILES = [Tile(*t) for t in (
    (16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (16, 128, 1, 4, 6), (32, 256, 1, 4, 4), (32, 128, 1, 4, 5),
    (32, 512, 1, 8, 3), (64, 128, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 3), (16, 256, 2, 4, 4),
    (32, 256, 2, 4, 4), (64, 256, 4, 4, 3),
)]
ROTATE_L2 = 4
DTYPE = torch.bfloat16


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each fused projection and of lm_head."""
    c = preset_config(preset)
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        sel = [r for r in rows if r["shape"] == name]
        tokens = [r["tokens"] for r in sel]
        ax.plot(tokens, [r["cublas_us"] for r in sel], marker="o", ms=3, label="cuBLAS")
        ax.plot(tokens, [r["best_triton_us"] for r in sel], marker="o", ms=3, label="best Triton tile")
        ax.plot(tokens, [r["floor_us"] for r in sel], linestyle="--", label="floor")
        style_axes(ax, name, "tokens", "us")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--out", type=Path, default=Path("results/decode_gemm"))
    args = parser.parse_args()
    device = torch.device("cuda")
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    bandwidth = copy_bandwidth(device)
    started = time.time()
    rows = []
    for name, (n, k) in shapes(args.preset).items():
        copies = max(1, triton.cdiv(ROTATE_L2 * l2_bytes, n * k * DTYPE.itemsize))
        weights = [torch.randn(n, k, device=device, dtype=DTYPE) * 0.02 for _ in range(copies)]
        for tokens in args.tokens:
            xs = [torch.randn(tokens, k, device=device, dtype=DTYPE) for _ in range(copies)]
            expect = F.linear(xs[0], weights[0]).float()
            row = {"shape": name, "n": n, "k": k, "tokens": tokens, "copies": copies,
                   "floor_us": n * k * DTYPE.itemsize / bandwidth * 1e6,
                   "cublas_us": graph_us([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]),
                   "default": None if (tile := skinny_tile(tokens, n, k, DTYPE)) is None else list(tile)}
            tiles = {}
            for tile in TILES:
                got = skinny_linear_triton(xs[0], weights[0], None, tile).float()
                error = ((got - expect).norm() / expect.norm()).item()
                us = graph_us([lambda x=x, w=w, t=tile: skinny_linear_triton(x, w, None, t)
                               for x, w in zip(xs, weights)])
                tiles[",".join(map(str, tile))] = {"us": us, "rel_error": error}
            best = min(tiles, key=lambda t: tiles[t]["us"])
            default = tiles.get(",".join(map(str, row["default"])), {}).get("us") if row["default"] else None
            row.update(tiles=tiles, best_tile=best, best_triton_us=tiles[best]["us"], default_us=default)
            rows.append(row)
            print(f"{name} N={n} K={k} tokens {tokens}: cuBLAS {row['cublas_us']:.1f} us, best Triton {best} "
                  f"{row['best_triton_us']:.1f} us, floor {row['floor_us']:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "dtype": str(DTYPE),
            "copy_bandwidth_Bps": bandwidth, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "seconds": time.time() - started}
    path = write_results(args.out, "decode_gemm", rows, meta)
    plot(rows, path.with_suffix(".png"), f"{args.preset} decode GEMMs, {meta['device']}")
    print(meta)
    table = [{**r, "cublas/floor": f"{r['cublas_us'] / r['floor_us']:.2f}",
              "triton/floor": f"{r['best_triton_us'] / r['floor_us']:.2f}",
              "default_us": "cuBLAS" if r["default_us"] is None else r["default_us"]} for r in rows]
    print(format_table(table, ["shape", "tokens", "floor_us", "cublas_us", "default_us", "best_triton_us", "best_tile",
                               "cublas/floor", "triton/floor"]))


if __name__ == "__main__":
    main()
