"""FP8 GEMMs by token count: where the weight-only Triton GEMM gives way to torch._scaled_mm.

python -m benchmarks.fp8_gemm [--preset llama-2-7b] [--tokens 1 2 4 ... 2048] [--out results/fp8_gemm]

For each fused projection of one layer of --preset (qkv, o, gate_up, down) and each token count T:
the bf16 GEMM (F.linear), the weight-only fp8 GEMM (punica.ops.fp8_triton, per-channel scales, and
128 x 128 block scales), and the fp8 tensor-core path (per-token activation quantization +
torch._scaled_mm, per-channel scales), each timed with triton.testing.do_bench (median, CUDA events)
on bf16 activations. `weight_floor_us`: the fp8 weight's bytes over the copy bandwidth (as roofline's floor).
The crossover to put in punica.ops.fp8.WEIGHT_ONLY_MAX_TOKENS is the least T from which the
_scaled_mm GEMMs of a layer (its four projections) take less time in all than the weight-only
ones. CUDA only. Writes fp8_gemm.json and fp8_gemm.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import copy_bandwidth, format_table, layer_gemm_shapes, save_figure, style_axes, write_results
from punica.ops.fp8 import fp8_linear_scaled_mm, quantize_per_channel
from punica.ops.fp8_triton import fp8_linear_triton

TOKENS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048]


def main() -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--out", type=Path, default=Path("results/fp8_gemm"))
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name, (n, k) in layer_gemm_shapes(args.preset).items():
        w = torch.randn(n, k, device="cuda") * 0.02
        weight, scales = quantize_per_channel(w)
        block_scales = torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") * 1e-3
        w16 = w.to(torch.bfloat16)
        del w
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            timings = {
                "bf16_us": lambda: F.linear(x, w16),
                "weight_only_us": lambda: fp8_linear_triton(x, weight, scales, None),
                "weight_only_block_us": lambda: fp8_linear_triton(x, weight, block_scales, (128, 128)),
                "scaled_mm_us": lambda: fp8_linear_scaled_mm(x, weight, scales),
            }
            row = {"projection": name, "n": n, "k": k, "tokens": t, "weight_floor_us": 1e6 * n * k / bandwidth}
            row |= {key: 1e3 * triton.testing.do_bench(fn) for key, fn in timings.items()}
            rows.append(row)
            print(f"{name} T={t}: " + ", ".join(f"{key} {row[key]:.1f}" for key in timings), flush=True)
    def layer_us(t: int, key: str) -> float:
        return sum(r[key] for r in rows if r["tokens"] == t)

    crossover = next((t for t in args.tokens if all(layer_us(u, "scaled_mm_us") <= layer_us(u, "weight_only_us")
                                                    for u in args.tokens if u >= t)), None)
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "copy_bandwidth_Bps": bandwidth,
            "crossover_tokens": crossover, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__}
    write_results(args.out, "fp8_gemm", rows, meta)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, name in zip(axes, layer_gemm_shapes(args.preset)):
        sel = [r for r in rows if r["projection"] == name]
        for key in ("bf16_us", "weight_only_us", "weight_only_block_us", "scaled_mm_us", "weight_floor_us"):
            ax.plot([r["tokens"] for r in sel], [r[key] for r in sel], marker="o", ms=3, label=key[:-3])
        style_axes(ax, f"{name} [{sel[0]['n']} x {sel[0]['k']}]", "tokens", "us", log_y=True)
    axes[0].legend(fontsize=7)
    save_figure(fig, args.out / "fp8_gemm.png", f"fp8 GEMMs, {args.preset}, {meta['device']}")
    print(meta)
    print(format_table(rows, ["projection", "tokens", "bf16_us", "weight_only_us", "weight_only_block_us",
                              "scaled_mm_us", "weight_floor_us"]))


if __name__ == "__main__":
    main()
