"""Decode's GEMMs: cuBLAS (F.linear) against the Triton GEMMs' tiles, by the weight bytes' floor.

    python -m benchmarks.decode_gemm [--preset llama-2-7b] [--tokens 1 8 32] [--weights bf16|fp8]
                                     [--out results/decode_gemm]

For each fused projection of --preset (qkv, o, gate_up, down) and lm_head, and each token count:
bf16 F.linear (cuBLAS), and with --weights bf16 punica.ops.linear_triton.skinny_linear_triton with
every tile of TILES (block_n, block_k, split_k, num_warps, num_stages); with --weights fp8 the
weights quantized per channel, punica.ops.fp8_triton.fp8_linear_triton (the weight-only kernel)
with every tile of fp8_tiles(tokens), the W8A8 Triton GEMM (`w8a8_us`) and torch._scaled_mm
(`scaled_mm_us`), both with the activation quantization kernel, and punica.ops.fp8.fp8_linear,
the path the model runs (`path`, `path_us`; a last table sums it over the layer per token count).
Each Triton output is checked against the reference's (F.linear over the bf16 or dequantized
weight; relative Frobenius error).
Each point is timed as the model runs it: K calls on their own weights and inputs (together over
ROTATE_L2 times the L2 size, so every call reads its weight from memory) captured in one CUDA
graph, median replay (triton.testing.do_bench) / K. floor_us = the Triton kernels' weight bytes
(2 or 1 a weight) / copy bandwidth (read + written, 1 GiB device-to-device, same run). `default`
is the tile punica picks (skinny_tile: None where cuBLAS runs it; fp8_tile), default_us its time.
CUDA only. Writes decode_gemm.json and decode_gemm.png, and prints a table last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import (
    copy_bandwidth,
    format_table,
    graph_us,
    layer_gemm_shapes,
    save_figure,
    style_axes,
    write_results,
)
from punica.config import preset_config
from punica.ops.fp8 import dequantize, fp8_linear, fp8_linear_scaled_mm, gemm_path, quantize_per_channel
from punica.ops.fp8_triton import Fp8Tile, fp8_linear_triton, fp8_tile
from punica.ops.fp8_w8a8_triton import fp8_linear_w8a8_triton
from punica.ops.linear_tiles import Tile, skinny_tile
from punica.ops.linear_triton import skinny_linear_triton
from punica.ops.triton_env import num_sms

TILES = [Tile(*t) for t in (
    (16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (16, 128, 1, 4, 6), (32, 256, 1, 4, 4), (32, 128, 1, 4, 5),
    (32, 512, 1, 8, 3), (64, 128, 1, 4, 4), (64, 256, 1, 8, 3), (128, 128, 1, 8, 3), (16, 256, 2, 4, 4),
    (32, 256, 2, 4, 4), (64, 256, 4, 4, 3),
)]
FP8_TILES = [  # (block_n, block_k, split_k, num_warps, num_stages); block_m from the token count
    (32, 256, 1, 4, 3), (16, 256, 1, 4, 4), (16, 256, 2, 4, 4), (32, 256, 2, 4, 4), (32, 256, 4, 4, 3),
    (64, 256, 2, 4, 3), (64, 256, 4, 4, 3), (64, 128, 1, 4, 3), (64, 128, 4, 4, 4), (128, 128, 4, 8, 3),
    (32, 512, 2, 4, 3), (128, 256, 8, 8, 3),
]
ROTATE_L2 = 4
DTYPE = torch.bfloat16


def fp8_tiles(tokens: int) -> list[Fp8Tile]:
    """FP8_TILES with a block_m of 16 up to 16 tokens, else 32 and (over 32 tokens) 64."""
    block_ms = [16] if tokens <= 16 else [32, 64] if tokens > 32 else [32]
    return [Fp8Tile(block_m, *t) for block_m in block_ms for t in FP8_TILES]


class Weights:
    """One kind of weight the Triton kernels read: its K copies, reference, tiles and call."""

    def __init__(self, kind: str, n: int, k: int, copies: int, device: torch.device):
        self.kind, self.n, self.k, self.device = kind, n, k, device
        dense = [torch.randn(n, k, device=device) * 0.02 for _ in range(copies)]
        if kind == "bf16":
            self.dense = [w.to(DTYPE) for w in dense]
            self.quantized = None
        else:
            self.quantized = [quantize_per_channel(w) for w in dense]
            self.dense = [dequantize(w8, scales, None, DTYPE) for w8, scales in self.quantized]
        self.bytes_per_weight = 2 if kind == "bf16" else 1

    def tiles(self, tokens: int) -> list:
        return TILES if self.kind == "bf16" else fp8_tiles(tokens)

    def default(self, tokens: int):
        if self.kind == "bf16":
            return skinny_tile(tokens, self.n, self.k, DTYPE)
        return fp8_tile(tokens, self.n, self.k, per_channel=True, sms=num_sms(self.device))

    def calls(self, xs: list[torch.Tensor], tile) -> list:
        if self.kind == "bf16":
            return [lambda x=x, w=w: skinny_linear_triton(x, w, None, tile) for x, w in zip(xs, self.dense)]
        return [lambda x=x, q=q: fp8_linear_triton(x, q[0], q[1], None, tile=tile)
                for x, q in zip(xs, self.quantized)]

    def fp8_calls(self, xs: list[torch.Tensor], gemm) -> list:
        return [lambda x=x, q=q: gemm(x, q[0], q[1]) for x, q in zip(xs, self.quantized)]


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each fused projection and of lm_head."""
    c = preset_config(preset)
    return layer_gemm_shapes(preset) | {"lm_head": (c.vocab_size, c.hidden_size)}


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
    parser.add_argument("--weights", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--out", type=Path, default=Path("results/decode_gemm"))
    args = parser.parse_args()
    device = torch.device("cuda")
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    bandwidth = copy_bandwidth(device)
    started = time.time()
    rows = []
    for name, (n, k) in shapes(args.preset).items():
        if args.weights == "fp8" and name == "lm_head":
            continue  # quantization leaves lm_head in bf16
        copies = max(1, triton.cdiv(ROTATE_L2 * l2_bytes, n * k * (1 if args.weights == "fp8" else DTYPE.itemsize)))
        weights = Weights(args.weights, n, k, copies, device)
        for tokens in args.tokens:
            xs = [torch.randn(tokens, k, device=device, dtype=DTYPE) for _ in range(copies)]
            expect = F.linear(xs[0], weights.dense[0]).float()
            default = weights.default(tokens)
            row = {"shape": name, "n": n, "k": k, "tokens": tokens, "copies": copies,
                   "floor_us": n * k * weights.bytes_per_weight / bandwidth * 1e6,
                   "cublas_us": graph_us([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights.dense)]),
                   "default": None if default is None else list(default)}
            if args.weights == "fp8":
                row["path"] = gemm_path(xs[0], weights.quantized[0][0], None)
                row["path_us"] = graph_us(weights.fp8_calls(xs, lambda x, w, s: fp8_linear(x, w, s, None)))
                row["w8a8_us"] = graph_us(weights.fp8_calls(xs, fp8_linear_w8a8_triton))
                row["scaled_mm_us"] = graph_us(weights.fp8_calls(xs, fp8_linear_scaled_mm))
            tiles = {}
            for tile in weights.tiles(tokens):
                try:
                    got = weights.calls(xs[:1], tile)[0]().float()
                except triton.runtime.errors.OutOfResources:  # the tile's pipeline needs more shared memory
                    continue
                error = ((got - expect).norm() / expect.norm()).item()
                tiles[",".join(map(str, tile))] = {"us": graph_us(weights.calls(xs, tile)), "rel_error": error}
            best = min(tiles, key=lambda t: tiles[t]["us"])
            default_us = tiles.get(",".join(map(str, default)), {}).get("us") if default else None
            row.update(tiles=tiles, best_tile=best, best_triton_us=tiles[best]["us"], default_us=default_us)
            rows.append(row)
            print(f"{name} N={n} K={k} tokens {tokens}: cuBLAS {row['cublas_us']:.1f} us, best Triton {best} "
                  f"{row['best_triton_us']:.1f} us, default {default_us} us, floor {row['floor_us']:.1f} us"
                  + (f", W8A8 {row['w8a8_us']:.1f} us, _scaled_mm {row['scaled_mm_us']:.1f} us, fp8_linear "
                     f"({row['path']}) {row['path_us']:.1f} us" if "path" in row else ""), flush=True)
        del weights
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "dtype": str(DTYPE), "weights": args.weights,
            "copy_bandwidth_Bps": bandwidth, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "seconds": time.time() - started}
    path = write_results(args.out, "decode_gemm", rows, meta)
    plot(rows, path.with_suffix(".png"), f"{args.preset} decode GEMMs, {meta['device']}")
    print(meta)
    table = [{**r, "cublas/floor": f"{r['cublas_us'] / r['floor_us']:.2f}",
              "triton/floor": f"{r['best_triton_us'] / r['floor_us']:.2f}",
              "default_us": "cuBLAS" if r["default_us"] is None else r["default_us"]} for r in rows]
    print(format_table(table, ["shape", "tokens", "floor_us", "cublas_us", "default_us", "best_triton_us", "best_tile",
                               "cublas/floor", "triton/floor"]
                       + (["w8a8_us", "scaled_mm_us", "path", "path_us"] if args.weights == "fp8" else [])))
    if args.weights == "fp8":
        layer = {t: {key: sum(r[key] for r in rows if r["tokens"] == t) for key in ("floor_us", "cublas_us", "path_us")}
                 for t in args.tokens}
        print(format_table([{"tokens": t, **v, "fp8/bf16": f"{v['path_us'] / v['cublas_us']:.2f}",
                             "fp8/floor": f"{v['path_us'] / v['floor_us']:.2f}"} for t, v in layer.items()],
                           ["tokens", "floor_us", "cublas_us", "path_us", "fp8/bf16", "fp8/floor"]))


if __name__ == "__main__":
    main()
