"""Decode's GEMMs as a step runs them: a chain of --layers layers' four projections, one CUDA graph.

    python -m benchmarks.decode_gemm_chain [--preset llama-2-7b] [--tokens 1 16 24 32 48 64] [--layers 32]
                                           [--out results/decode_gemm_chain]

Each layer of --preset runs qkv, o, gate_up and down (fused as the engine runs them), each GEMM's
input the first K columns of the previous GEMM's output, on its own layer's weights: the GEMMs follow
each other as in a decode step, so each kernel's ramp, tail and launch count as they do there, which
benchmarks.decode_gemm (each GEMM's calls side by side) does not show. Per token count, us a layer
(the chain's median replay, triton.testing.do_bench, / --layers), for these paths over the same
weights (random, scaled by 1/sqrt(K) so that values stay in range over the chain, quantized per
channel; bf16 holds their dequantized values):

  bf16        F.linear (cuBLAS)
  fp8         punica.ops.fp8.fp8_linear, the path the model runs (`path`: gemm_path's)
  weight_only punica.ops.fp8_triton.fp8_linear_triton with fp8_tile's tile
  w8a8        punica.ops.fp8_w8a8_triton.fp8_linear_w8a8_triton, activation quantization included

floor_us: a layer's weight bytes (1 a weight for fp8, 2 for bf16) / copy bandwidth (read + written,
1 GiB device-to-device, same run). Each path's output after the chain is compared with fp8's
(`rel_error`: largest absolute difference over fp8's largest value; w8a8 quantizes the activations,
so it differs more). CUDA only. Writes decode_gemm_chain.json and prints a table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth, format_table, graph_us, layer_gemm_shapes, write_results
from punica.ops.fp8 import dequantize, fp8_linear, gemm_path, quantize_per_channel
from punica.ops.fp8_triton import fp8_linear_triton
from punica.ops.fp8_w8a8_triton import fp8_linear_w8a8_triton

DTYPE = torch.bfloat16
PATHS = {
    "bf16": lambda x, w: F.linear(x, w["dense"]),
    "fp8": lambda x, w: fp8_linear(x, w["fp8"], w["scales"], None),
    "weight_only": lambda x, w: fp8_linear_triton(x, w["fp8"], w["scales"], None),
    "w8a8": lambda x, w: fp8_linear_w8a8_triton(x, w["fp8"], w["scales"]),
}


def make_layers(shapes: dict[str, tuple[int, int]], layers: int, device: torch.device) -> list[list[dict]]:
    """Per layer, per GEMM: the fp8 weight, its per-channel scales and the bf16 weight of the same values."""
    out = []
    for _ in range(layers):
        layer = []
        for n, k in shapes.values():
            fp8, scales = quantize_per_channel(torch.randn(n, k, device=device) / k ** 0.5)
            layer.append({"fp8": fp8, "scales": scales, "dense": dequantize(fp8, scales, None, DTYPE)})
        out.append(layer)
    return out


def chain(path, x0: torch.Tensor, layers: list[list[dict]], ks: list[int]):
    """The whole chain as one call: every layer's GEMMs in order, each on the previous output."""
    def run():
        x = x0
        for layer in layers:
            for weights, k in zip(layer, ks):
                x = path(x[:, :k], weights)
        return x
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 24, 32, 48, 64])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/decode_gemm_chain"))
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    started = time.time()
    shapes = layer_gemm_shapes(args.preset)
    ks = [k for _, k in shapes.values()]
    layers = make_layers(shapes, args.layers, device)
    weight_bytes = sum(n * k for n, k in shapes.values())
    rows = []
    for tokens in args.tokens:
        x0 = torch.randn(tokens, ks[0], device=device, dtype=DTYPE)
        expect = chain(PATHS["fp8"], x0, layers, ks)().float()
        scale = expect.abs().max().item()
        row = {"tokens": tokens, "path": gemm_path(x0, layers[0][0]["fp8"], None),
               "floor_us": weight_bytes / bandwidth * 1e6, "bf16_floor_us": 2 * weight_bytes / bandwidth * 1e6}
        for name, path in PATHS.items():
            run = chain(path, x0, layers, ks)
            row[f"{name}_rel_error"] = (run().float() - expect).abs().max().item() / scale
            row[f"{name}_us"] = graph_us([run]) / args.layers
        rows.append(row)
        print(f"tokens {tokens}: " + ", ".join(f"{name} {row[f'{name}_us']:.1f} us" for name in PATHS)
              + f" (fp8 runs {row['path']}), floor {row['floor_us']:.1f} us", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "layers": args.layers, "dtype": str(DTYPE),
            "copy_bandwidth_Bps": bandwidth, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "seconds": time.time() - started}
    write_results(args.out, "decode_gemm_chain", rows, meta)
    print(meta)
    table = [{**r, "fp8/floor": f"{r['fp8_us'] / r['floor_us']:.2f}", "fp8/bf16": f"{r['fp8_us'] / r['bf16_us']:.2f}"}
             for r in rows]
    print(format_table(table, ["tokens", "floor_us", "bf16_us", "fp8_us", "path", "weight_only_us", "w8a8_us",
                               "fp8/floor", "fp8/bf16"]))


if __name__ == "__main__":
    main()
