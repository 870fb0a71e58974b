"""A MoE layer's experts at decode: the grouped GEMMs against the floor of the expert weights they read.

    python -m benchmarks.moe_gemm [--preset qwen3-30b-a3b] [--tokens 1 2 4 8 16 32 64] [--out results/moe_gemm]

For each token count T: random router logits [T, E] and hidden states [T, H] (bf16, fixed seed), run
as punica.models.moe.MoeBlock runs its experts (punica.lora.experts.LoraExperts), three ways:

    block   punica.ops.moe.route + the experts: rows = x[pair_tokens], grouped_matmul by w_gate_up
            [E, 2I, H], silu_and_mul, grouped_matmul by w_down [E, H, I], combine
    gemms   the two grouped_matmul calls alone (the same routings, rows and activations; each
            routing's block layout is made before the graph is captured, and kept on the routing)
    lora    block with each token's expert LoRA (rank LORA_RANK, every token its own adapter slot, as
            the engine passes them: a LoraBatch of one slot per token and the pool's ExpertWeights)

Each point is timed as decode runs it: K calls, each with its own routing, captured in one CUDA graph,
median replay (triton.testing.do_bench) / K. Consecutive calls alternate between two copies of the
layer's weights (one copy where a single expert's weights exceed ROTATE_L2 times the L2 size), and K
is the fewest calls (a multiple of the copies) whose active weights together exceed ROTATE_L2 times
L2: every call reads its experts' weights from memory. floor_us = the bytes a call must read (each
distinct routed expert's gate_up and down weights; for lora also each distinct (slot, expert)'s A and
B), mean over the K calls, / copy bandwidth (read + written, 1 GiB device-to-device, same run); ratio
= time_us / floor_us; active_experts = the distinct experts per call (mean over the K calls).
rel_error: the relative Frobenius error of the first call's output against a float32 reference (block,
lora: each token's top-k experts' SwiGLU computed from the logits by the definition; gemms: each
projection against grouped_matmul_ref); the run fails if one exceeds MAX_REL_ERROR.

Without CUDA it checks correctness only, no times (`--preset tiny-moe`: the smoke run). Writes
moe_gemm.json and, on CUDA, moe_gemm.png (time and floor against tokens), and prints a table last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import copy_bandwidth, format_table, graph_us, save_figure, style_axes, write_results
from punica.config import PRESETS, ModelConfig, preset_config
from punica.lora.batch import LoraBatch
from punica.lora.experts import LoraExperts
from punica.lora.pool import ExpertWeights
from punica.models.moe import Experts
from punica.ops.layers import silu_and_mul
from punica.ops.moe import grouped_matmul, grouped_matmul_ref, route
from punica.ops.moe_routing import ExpertRouting

MOE_PRESETS = [name for name in PRESETS if preset_config(name).moe_layers]
VARIANTS = ("block", "gemms", "lora")
ROTATE_L2 = 4
MAX_REL_ERROR = 0.03
LORA_RANK = 16
LORA_SCALE = 2.0  # every slot's lora_alpha / r
DTYPE = torch.bfloat16
SEED = 0


def expert_bytes(c: ModelConfig) -> int:
    """One expert's gate_up and down weights."""
    return 3 * c.moe_intermediate_size * c.hidden_size * DTYPE.itemsize


def lora_pair_bytes(c: ModelConfig) -> int:
    """One (slot, expert)'s A and B of both projections."""
    return LORA_RANK * (2 * c.hidden_size + 3 * c.moe_intermediate_size) * DTYPE.itemsize


def make_layer(c: ModelConfig, lora: ExpertWeights, device: torch.device) -> LoraExperts:
    base = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, device=device, dtype=DTYPE)
    base.gate_up_proj.normal_(std=0.02)
    base.down_proj.normal_(std=0.02)
    layer = LoraExperts(base, layer=0)
    layer.weights = lora
    return layer


def make_lora(c: ModelConfig, num_slots: int, device: torch.device) -> ExpertWeights:
    e, h, i, r = c.num_experts, c.hidden_size, c.moe_intermediate_size, LORA_RANK

    def weight(*shape):
        return torch.randn(*shape, device=device, dtype=DTYPE) * 0.02

    return ExpertWeights(gate_up_a=weight(num_slots, e, r, h), gate_up_b=weight(num_slots, e, 2 * i, r),
                         down_a=weight(num_slots, e, r, i), down_b=weight(num_slots, e, h, r),
                         scales=torch.full((num_slots,), LORA_SCALE, device=device))


def lora_delta(rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, expert: int,
               scales: torch.Tensor) -> torch.Tensor:
    """rows [n, h_in] float32  ->  [n, h_out]: each row's delta by its slot's A and B of `expert`."""
    shrunk = torch.einsum("nh,nrh->nr", rows, a[slots, expert].float())
    return torch.einsum("nr,nor->no", shrunk, b[slots, expert].float()) * scales[:, None]


def reference(x: torch.Tensor, logits: torch.Tensor, c: ModelConfig, layer: LoraExperts,
              lora: LoraBatch | None) -> torch.Tensor:
    """float32 by the definition: each token's top-k experts' SwiGLU MLPs (each projection plus the
    token's LoRA delta where `lora`), weighted by the router's softmax (renormalised), summed."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, chosen = torch.topk(probs, c.num_experts_per_tok, dim=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    w_gate_up, w_down, w = layer.base.gate_up_weight(), layer.base.down_weight(), layer.weights
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in chosen.unique().tolist():
        tokens, ranks = torch.nonzero(chosen == expert, as_tuple=True)
        rows = x[tokens].float()
        gate_up = rows @ w_gate_up[expert].float().T
        if lora is not None:
            slots = lora.token_slots[tokens].long()
            scales = lora.token_scales[tokens] * w.scales[slots]
            gate_up += lora_delta(rows, w.gate_up_a, w.gate_up_b, slots, expert, scales)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        down = hidden @ w_down[expert].float().T
        if lora is not None:
            down += lora_delta(hidden, w.down_a, w.down_b, slots, expert, scales)
        out.index_add_(0, tokens, down * weights[tokens, ranks, None])
    return out


def rel_error(got: torch.Tensor, expect: torch.Tensor) -> float:
    expect = expect.float()
    return ((got.float() - expect).norm() / expect.norm()).item()


def num_active(routing: ExpertRouting) -> int:
    return int((routing.expert_indptr.diff() > 0).sum())


def measure(c: ModelConfig, tokens: int, layers: list[LoraExperts], num_slots: int, min_bytes: int,
            bandwidth: float | None, device: torch.device) -> list[dict]:
    """The rows of one token count: each variant's time, floor and error (times only with `bandwidth`)."""
    top_k, renormalize = c.num_experts_per_tok, c.norm_topk_prob
    xs, logits, routings = [], [], []
    # the fewest calls (a multiple of the copies) whose active experts' weights exceed min_bytes
    while not xs or len(xs) % len(layers) or sum(map(num_active, routings)) * expert_bytes(c) < min_bytes:
        xs.append(torch.randn(tokens, c.hidden_size, device=device, dtype=DTYPE))
        logits.append(torch.randn(tokens, c.num_experts, device=device))
        routings.append(route(logits[-1], top_k, renormalize))
    num_calls = len(xs)
    call_layers = [layers[i % len(layers)] for i in range(num_calls)]
    no_lora = LoraBatch.build([-1] * tokens, [1] * tokens, device, num_prefills=0)
    # every token its own slot, each call's tokens on other slots than the call before's where there are enough
    lora_batches = [LoraBatch.build([(i * tokens + t) % num_slots for t in range(tokens)], [1] * tokens, device,
                                    num_prefills=0) for i in range(num_calls)]
    rows = [x[r.pair_tokens] for x, r in zip(xs, routings)]
    hidden = [silu_and_mul(grouped_matmul(p, layer.base.gate_up_weight(), r))
              for p, layer, r in zip(rows, call_layers, routings)]

    def block(i: int, lora: LoraBatch) -> torch.Tensor:
        return call_layers[i](xs[i], route(logits[i], top_k, renormalize), lora)

    def gemms(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = call_layers[i].base
        return (grouped_matmul(rows[i], base.gate_up_weight(), routings[i]),
                grouped_matmul(hidden[i], base.down_weight(), routings[i]))

    base0 = call_layers[0].base
    expect_gemms = (grouped_matmul_ref(rows[0], base0.gate_up_weight(), routings[0]),
                    grouped_matmul_ref(hidden[0], base0.down_weight(), routings[0]))
    errors = {"block": rel_error(block(0, no_lora), reference(xs[0], logits[0], c, call_layers[0], None)),
              "gemms": max(rel_error(got, expect) for got, expect in zip(gemms(0), expect_gemms)),
              "lora": rel_error(block(0, lora_batches[0]),
                                reference(xs[0], logits[0], c, call_layers[0], lora_batches[0]))}
    active_experts = sum(map(num_active, routings)) / num_calls
    active_pairs = sum(int(torch.unique(b.token_slots[r.pair_tokens].long() * c.num_experts + r.pair_experts).numel())
                       for b, r in zip(lora_batches, routings)) / num_calls
    base_bytes = active_experts * expert_bytes(c)
    read = {"block": base_bytes, "gemms": base_bytes, "lora": base_bytes + active_pairs * lora_pair_bytes(c)}
    if bandwidth is not None:
        times = {"block": graph_us([lambda i=i: block(i, no_lora) for i in range(num_calls)]),
                 "gemms": graph_us([lambda i=i: gemms(i) for i in range(num_calls)]),
                 "lora": graph_us([lambda i=i: block(i, lora_batches[i]) for i in range(num_calls)])}
    out = []
    for variant in VARIANTS:
        row = {"variant": variant, "tokens": tokens, "calls": num_calls, "copies": len(layers),
               "active_experts": active_experts, "active_lora_pairs": active_pairs if variant == "lora" else 0,
               "bytes": read[variant], "rel_error": errors[variant]}
        if bandwidth is not None:
            floor = read[variant] / bandwidth * 1e6
            row.update(floor_us=floor, time_us=times[variant], ratio=times[variant] / floor)
        out.append(row)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, ratios) = plt.subplots(1, 2, figsize=(7, 3.2))
    for variant in VARIANTS:
        sel = [r for r in rows if r["variant"] == variant]
        tokens = [r["tokens"] for r in sel]
        line, = times.plot(tokens, [r["time_us"] for r in sel], marker="o", ms=3, label=variant)
        if variant != "gemms":  # gemms reads what block reads: the same floor
            times.plot(tokens, [r["floor_us"] for r in sel], linestyle="--", color=line.get_color(),
                       label=f"{variant} floor")
        ratios.plot(tokens, [r["ratio"] for r in sel], marker="o", ms=3, label=variant)
    ratios.axhline(1.5, color="grey", linestyle=":", label="1.5x")
    style_axes(times, "time per layer", "tokens", "us")
    style_axes(ratios, "time / floor", "tokens")
    times.set_ylim(bottom=0)
    ratios.set_ylim(bottom=0)
    times.legend(fontsize=7)
    ratios.legend(fontsize=7)
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=MOE_PRESETS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--out", type=Path, default=Path("results/moe_gemm"))
    args = parser.parse_args()
    if min(args.tokens) < 1:
        parser.error(f"--tokens must be positive, got {args.tokens}")
    c = preset_config(args.preset)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA device: checking correctness only, no times", flush=True)
    torch.manual_seed(SEED)
    started = time.time()
    bandwidth = copy_bandwidth(device) if cuda else None
    min_bytes, num_copies = 0, 1
    if cuda:
        min_bytes = ROTATE_L2 * torch.cuda.get_device_properties(device).L2_cache_size
        num_copies = 1 if expert_bytes(c) > min_bytes else 2
    num_slots = max(args.tokens)
    lora = make_lora(c, num_slots, device)
    layers = [make_layer(c, lora, device) for _ in range(num_copies)]
    rows = []
    with torch.inference_mode():
        for tokens in args.tokens:
            for row in measure(c, tokens, layers, num_slots, min_bytes, bandwidth, device):
                rows.append(row)
                timed = (f": {row['time_us']:.1f} us, floor {row['floor_us']:.1f} us, {row['ratio']:.2f}x"
                         if cuda else "")
                print(f"{row['variant']} tokens {tokens}{timed}, {row['active_experts']:.1f} active experts, "
                      f"rel error {row['rel_error']:.1e}", flush=True)
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "preset": args.preset, "dtype": str(DTYPE),
            "num_experts": c.num_experts, "top_k": c.num_experts_per_tok, "hidden_size": c.hidden_size,
            "moe_intermediate_size": c.moe_intermediate_size, "lora_rank": LORA_RANK, "seed": SEED,
            "copy_bandwidth_Bps": bandwidth, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "seconds": time.time() - started}
    path = write_results(args.out, "moe_gemm", rows, meta)
    if cuda:
        plot(rows, path.with_suffix(".png"), f"{args.preset} MoE experts at decode, {meta['device']}")
    print(meta)
    columns = ["variant", "tokens", "active_experts", "rel_error"]
    if cuda:
        columns[3:3] = ["floor_us", "time_us", "ratio"]
    table = [{**r, "rel_error": f"{r['rel_error']:.1e}", **({"ratio": f"{r['ratio']:.2f}"} if cuda else {})}
             for r in rows]
    print(format_table(table, columns))
    failed = [f"{r['variant']} tokens {r['tokens']}: {r['rel_error']:.1e}" for r in rows
              if not r["rel_error"] <= MAX_REL_ERROR]
    if failed:
        sys.exit(f"relative errors over {MAX_REL_ERROR}: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
