"""The fused layer ops of punica.ops.layers against the unfused torch code they replace, as a
CUDA graph runs them (where each tiny kernel still costs a launch slot).

    python -m benchmarks.layers_ops --out results/layers_ops [--preset llama-2-7b] [--tokens 1 32 512 4096]

Shapes of --preset (default Llama-2-7B: hidden 4096, 32 q / 32 kv heads of 128, intermediate
11008), bf16, for T tokens:

* rms_norm      norm of x [T, h]                    unfused: rms_norm_ref (the old RMSNorm module)
* add_rms_norm  norm of x + residual, and the sum  unfused: x + residual, then rms_norm_ref
* rope          q [T, Hq, D] and k [T, Hkv, D]      unfused: the old apply_rope on q, then on k
                (views of one qkv row, as in the model; the fused op rotates them in place)
* silu_and_mul  gate_up [T, 2 I] -> [T, I]          unfused: F.silu(gate) * up
* quantize_h, quantize_i  fp8 (e4m3) per-token quantization of activations [T, h] and [T, I], the
                inputs of an fp8 layer's W8A8 GEMMs (punica.ops.fp8_quant_triton)
                                                    unfused: punica.ops.fp8.quantize_per_token

Each point: K copies of the call (own inputs, together over ROTATE_L2 times the L2 size where
K <= MAX_COPIES allows) captured in one CUDA graph; median of triton.testing.do_bench per
replay / K. Floor: bytes the op must move / copy bandwidth (1 GiB device-to-device copy, same
run). A Llama layer runs add_rms_norm twice, rope and silu_and_mul once each: the `layer` rows
sum those (a bf16 layer's: no quantization), and `model` multiplies by the preset's layer count.
Each fused op's output is checked against its reference first. Writes layers_ops.json and
layers_ops.png under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth, format_table, save_figure, style_axes, write_results
from punica.config import preset_config
from punica.ops import layers as ops
from punica.ops.fp8 import quantize_per_token
from punica.ops.fp8_quant_triton import quantize_per_token_triton

DTYPE = torch.bfloat16
ROTATE_L2 = 4
MAX_COPIES = 64
EPS = 1e-5
OPS = ("rms_norm", "add_rms_norm", "rope", "silu_and_mul", "quantize_h", "quantize_i")
QUANTIZED = {"quantize_h": "hidden_size", "quantize_i": "intermediate_size"}  # op -> its rows' width


def make_inputs(op: str, num_tokens: int, config, gen, device="cuda") -> dict:
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=DTYPE)

    h = config.hidden_size
    if op in ("rms_norm", "add_rms_norm"):
        return dict(x=randn(num_tokens, h), residual=randn(num_tokens, h), weight=randn(h))
    if op == "rope":
        heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
        qkv = randn(num_tokens, (heads + 2 * kv_heads) * d)
        positions = torch.randint(0, 4096, (num_tokens,), device=device, generator=gen).float()
        freqs = positions[:, None] / 10000.0 ** (torch.arange(0, d, 2, device=device) / d)[None, :]
        return dict(q=qkv[:, :heads * d].view(num_tokens, heads, d),
                    k=qkv[:, heads * d:(heads + kv_heads) * d].view(num_tokens, kv_heads, d),
                    cos=freqs.cos(), sin=freqs.sin())
    if op in QUANTIZED:
        return dict(x=randn(num_tokens, getattr(config, QUANTIZED[op])))
    return dict(gate_up=randn(num_tokens, 2 * config.intermediate_size))


def op_bytes(op: str, num_tokens: int, config) -> int:
    """Bytes the op must read and write at least."""
    h, e = config.hidden_size, DTYPE.itemsize
    if op == "rms_norm":
        return 2 * num_tokens * h * e + h * e
    if op == "add_rms_norm":
        return 4 * num_tokens * h * e + h * e
    if op == "rope":
        qk = num_tokens * (config.num_heads + config.num_kv_heads) * config.head_dim
        return 2 * qk * e + num_tokens * config.head_dim * 4  # q, k read + written; cos, sin fp32
    if op in QUANTIZED:
        return num_tokens * getattr(config, QUANTIZED[op]) * (e + 1) + num_tokens * 4  # x read, e4m3 + scales written
    return 3 * num_tokens * config.intermediate_size * e


def unfused(op: str, a: dict):
    if op == "rms_norm":
        return ops.rms_norm_ref(a["x"], a["weight"], EPS)
    if op == "add_rms_norm":
        summed = a["x"] + a["residual"]
        return ops.rms_norm_ref(summed, a["weight"], EPS), summed
    if op == "rope":
        return ops.rope_ref(a["q"], a["k"], a["cos"], a["sin"])  # the old apply_rope, twice
    if op in QUANTIZED:
        return quantize_per_token(a["x"])
    gate, up = a["gate_up"].chunk(2, dim=-1)
    return F.silu(gate) * up


def fused(op: str, a: dict):
    if op == "rms_norm":
        return ops.rms_norm(a["x"], a["weight"], EPS)
    if op == "add_rms_norm":
        return ops.rms_norm(a["x"], a["weight"], EPS, a["residual"])
    if op == "rope":
        return ops.rope_(a["q"], a["k"], a["cos"], a["sin"])
    if op in QUANTIZED:
        return quantize_per_token_triton(a["x"])
    return ops.silu_and_mul(a["gate_up"])


def check(op: str, a: dict) -> float:
    """Largest |fused - reference| over the op's outputs (rope on a copy of q, k)."""
    if op == "rope":
        a = dict(a, q=a["q"].clone(), k=a["k"].clone())
    expect = unfused(op, a)
    got = fused(op, a)
    if op == "rope":
        got = (a["q"], a["k"])
    pairs = zip(got, expect) if isinstance(expect, tuple) else [(got, expect)]
    return max((g.float() - e.float()).abs().max().item() for g, e in pairs)


def graph_us(copies: list[dict], call) -> float:
    """Microseconds per call: all copies captured in one graph, median replay / copies."""
    call(copies[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in copies:
            call(a)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms * 1e3 / len(copies)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(3.5 * len(OPS), 3.5))
    for ax, op in zip(axes, OPS):
        sel = [r for r in rows if r["op"] == op]
        for key, style in (("unfused_us", "o-"), ("fused_us", "o-"), ("floor_us", "k--")):
            ax.plot([r["tokens"] for r in sel], [r[key] for r in sel], style, ms=3, label=key[:-3])
        style_axes(ax, op, "tokens", log_y=True)
    axes[0].set_ylabel("us per call (CUDA graph)", fontsize=8)
    axes[0].legend(fontsize=7)
    save_figure(fig, path, title)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/layers_ops"))
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = preset_config(args.preset)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    started = time.time()
    bandwidth = copy_bandwidth(device)
    print(f"{props.name}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, L2 {props.L2_cache_size >> 20} MiB",
          flush=True)
    rows = []
    for num_tokens in args.tokens:
        layer = dict(op="layer", tokens=num_tokens, unfused_us=0.0, fused_us=0.0, floor_us=0.0)
        for op in OPS:
            nbytes = op_bytes(op, num_tokens, config)
            num_copies = max(1, min(MAX_COPIES, triton.cdiv(ROTATE_L2 * props.L2_cache_size, nbytes)))
            copies = [make_inputs(op, num_tokens, config, gen) for _ in range(num_copies)]
            row = dict(op=op, tokens=num_tokens, max_abs_err=check(op, copies[0]),
                       unfused_us=graph_us(copies, lambda a: unfused(op, a)),
                       fused_us=graph_us(copies, lambda a: fused(op, a)),
                       floor_us=nbytes / bandwidth * 1e6)
            row["speedup"] = row["unfused_us"] / row["fused_us"]
            rows.append(row)
            print(row, flush=True)
            times = {"add_rms_norm": 2, "rope": 1, "silu_and_mul": 1}.get(op, 0)
            for key in ("unfused_us", "fused_us", "floor_us"):
                layer[key] += times * row[key]
        layer["speedup"] = layer["unfused_us"] / layer["fused_us"]
        rows.append(layer)
        rows.append(dict(layer, op=f"model ({config.num_layers} layers)",
                         **{k: layer[k] * config.num_layers for k in ("unfused_us", "fused_us", "floor_us")}))
    meta = dict(device=props.name, preset=args.preset, dtype=str(DTYPE), copy_bandwidth=bandwidth,
                seconds=time.time() - started, date=time.strftime("%Y-%m-%d"))
    write_results(args.out, "layers_ops", rows, meta)
    plot([r for r in rows if r["op"] in OPS], args.out / "layers_ops.png",
         f"Fused layer ops vs unfused torch, {args.preset}, bf16, {props.name}")
    shown = [dict(r, speedup=f"{r['speedup']:.2f}", floor_us=f"{r['floor_us']:.2f}",
                  max_abs_err=f"{r['max_abs_err']:.3g}" if "max_abs_err" in r else "") for r in rows]
    print(format_table(shown, ["op", "tokens", "unfused_us", "fused_us", "speedup", "floor_us", "max_abs_err"]))


if __name__ == "__main__":
    main()
