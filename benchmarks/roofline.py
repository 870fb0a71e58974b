"""Decode-step roofline: the engine's decode step time against the memory floor.

    python -m benchmarks.roofline [--preset llama-2-7b] [--batches 1 2 4 8 16 32] [--contexts 512 2048]
        [--quantizations none fp8 fp8+fp8kv]

The full model of --preset with dummy weights (bf16 on CUDA, fp32 on CPU) in an Engine with
max batch = the largest --batches, first without LoRA (every request slot -1), then with
"distinct" adapters (request i its own rank --rank adapter, all resident: one GPU slot each).
For each context c and batch b: b requests with c-token random prompts are prefilled; once
every request has its first token, --warmup steps run, then --steps steps are timed one by one
(wall clock around `engine.step()`, CUDA synchronized before and after: scheduling, the model
run (a CUDA graph replay where the engine captures decode graphs), sampling and bookkeeping);
each timed step must decode all b requests. step_ms is their median. Then --steps more steps run
back to back (no synchronization between them, as a server runs them: a step launches the next
before it reads the previous one's tokens, so its host work overlaps the device's), and
steady_ms is their mean wall time: the device's time per step where the host keeps up with it.

floor_ms = (weight bytes + KV bytes + LoRA bytes) / copy bandwidth: every weight except the
embedding table (b rows of it), the KV cache of the b requests at the timed steps' mean
context, and each distinct adapter's A and B for the 7 projections of every layer, read once
from memory at the device-to-device copy rate measured in the same run (CUDA:
benchmarks.common.copy_bandwidth; CPU: median wall time of a 256 MiB copy). Activations and
logits are left out. ratio = step_ms / floor_ms (issue target on an H200: <= 1.3 at batch 32);
steady_ratio = steady_ms over the floor at the back-to-back steps' mean context.
--quantizations: all of it once per format of the same dummy weights (none: the dtype's; fp8:
e4m3 projections with per-channel scales, whose floor counts their 1-byte weights and 4-byte
scales; "+fp8kv": an fp8 KV cache, whose floor counts 1-byte K and V and a 4-byte scale per
token, KV head and K|V); rows say which (`quantization`).
Writes roofline.json and roofline.png under --out and prints a table last.

--tensor-parallel-size N > 1: the tensor-parallel engine (punica.parallel.executor; rank r on
cuda:r, each generating only its shard of the dummy weights), one engine for both LoRA modes
(all adapter names registered). The floor is one GPU's: rank 0's shard of the weights, KV
cache (its kv heads) and adapters, at the copy bandwidth of cuda:0; the all-reduces are not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    FORMATS,
    copy_bandwidth,
    format_fields,
    format_label,
    format_table,
    save_figure,
    style_axes,
    warm_up,
    write_results,
)
from punica.config import EngineArgs, preset_config
from punica.engine.engine import Engine
from punica.engine.runner import kv_bytes_per_token
from punica.engine.sampling_params import SamplingParams
from punica.factory import build_engine, engine_on_model
from punica.flags import add_arguments, from_arguments
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model

PAGE_SIZE = 16
SLACK = 64  # output tokens beyond warmup + steps: requests prefilled in earlier steps must not finish
# the step budget is the whole KV cache, so prompts prefill without chunks: requests that start in
# earlier steps would otherwise decode through the prefill of the rest and finish (or outgrow the
# cache) before the timed steps


def cpu_copy_bandwidth() -> float:
    """Bytes read plus written per second copying 256 MiB on the CPU, median of 5."""
    src = torch.ones(1 << 28, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_step_seconds(engine: Engine, prompts: list[list[int]], adapters: list[str | None], warmup: int,
                        steps: int, device: torch.device) -> tuple[list[float], float, float, float]:
    """Seconds of each of `steps` decode-only steps of these requests (see the module docstring),
    the requests' mean context over those steps, then the mean seconds of `steps` more steps run
    back to back and the mean context over those."""
    params = SamplingParams(max_tokens=warmup + 2 * steps + SLACK, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params, a) for p, a in zip(prompts, adapters)]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill (fused with early decodes) until all have a first token
        started.update(o.request_id for o in engine.step())
    for _ in range(warmup):
        engine.step()
    times, contexts = [], []
    for _ in range(steps):
        contexts.extend(engine.requests[i].num_tokens for i in ids)
        sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
        assert len(outputs) == len(ids), f"a timed step decoded {len(outputs)} of {len(ids)} requests"
    steady_contexts = []
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        steady_contexts.extend(engine.requests[i].num_tokens for i in ids)
        outputs = engine.step()
        assert len(outputs) == len(ids), f"a timed step decoded {len(outputs)} of {len(ids)} requests"
    sync(device)
    steady = (time.perf_counter() - start) / steps
    for request_id in ids:
        engine.abort(request_id)
    return times, statistics.mean(contexts), steady, statistics.mean(steady_contexts)


def weight_bytes(model, batch: int) -> int:
    """Bytes of every parameter a decode step reads: all but the embedding table, of which `batch` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.weight
    if not model.config.tie_word_embeddings:  # tied: the table is read whole as lm_head
        total -= embed.numel() * embed.element_size()
    return total + batch * embed.shape[1] * embed.element_size()


def adapter_bytes(config, rank: int, element_size: int) -> int:
    return sum(config.num_layers * rank * (h_in + h_out) * element_size
               for h_in, h_out in config.projection_shapes().values())


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        curves = list(dict.fromkeys((r["lora"], r["quantization"]) for r in rows))
        for (lora, quantization), color in zip(curves, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
            sel = [r for r in rows
                   if r["context"] == context and (r["lora"], r["quantization"]) == (lora, quantization)]
            batches = [r["batch"] for r in sel]
            name = lora if quantization == "none" else f"{lora}, {quantization}"
            ax.plot(batches, [r["step_ms"] for r in sel], marker="o", ms=3, color=color, label=f"step, {name}")
            ax.plot(batches, [r["floor_ms"] for r in sel], linestyle="--", color=color, label=f"floor, {name}")
        style_axes(ax, f"context {context}", "batch size", "ms per decode step")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, title)


def measure(engine_args: EngineArgs, config, dtype: torch.dtype, device: torch.device, all_names: dict[str, str],
            args: argparse.Namespace, bandwidth: float) -> tuple[list[dict], bool]:
    """Rows of both LoRA modes at every context and batch on one model (engine_args' quantization),
    and whether its engine replays CUDA graphs."""
    tp, max_batch = engine_args.tensor_parallel_size, engine_args.max_batch_size
    quantization = format_label(engine_args.quantization, engine_args.kv_cache_dtype)
    model = dummy_model(config, dtype, device, quantization=engine_args.quantization) if tp == 1 else None
    rng = random.Random(0)
    rows = []
    if tp > 1:
        parallel_engine = build_engine(engine_args, all_names)
    try:
        for lora in ("none", "distinct"):
            names = all_names if lora == "distinct" else {}
            engine = engine_on_model(model, engine_args.engine_config(), names) if tp == 1 else parallel_engine
            shard = engine.executor.worker.model  # rank 0's shard under tensor parallelism: one GPU's bytes
            per_token_kv = kv_bytes_per_token(shard, engine_args.kv_cache_dtype)
            per_adapter = adapter_bytes(shard.config, args.rank, shard.embed.weight.element_size())
            warm_up(engine, list(names) or [None] * max_batch)  # compiled kernels, resident adapters
            for context in args.contexts:
                for batch in args.batches:
                    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(context)] for _ in range(batch)]
                    adapters = list(names)[:batch] if names else [None] * batch
                    times, mean_context, steady, steady_context = decode_step_seconds(
                        engine, prompts, adapters, args.warmup, args.steps, device)
                    step = statistics.median(times)
                    nbytes = {"weight": weight_bytes(shard, batch),
                              "kv": int(batch * mean_context * per_token_kv),
                              "lora": per_adapter * len(set(adapters) - {None})}
                    floor = sum(nbytes.values()) / bandwidth
                    steady_floor = floor + batch * (steady_context - mean_context) * per_token_kv / bandwidth
                    rows.append({"quantization": quantization, "lora": lora, "context": context, "batch": batch,
                                 "step_ms": 1e3 * step, "floor_ms": 1e3 * floor, "ratio": step / floor,
                                 "steady_ms": 1e3 * steady, "steady_floor_ms": 1e3 * steady_floor,
                                 "steady_ratio": steady / steady_floor,
                                 **{f"{k}_gb": v / 1e9 for k, v in nbytes.items()}})
                    print(f"{quantization} {lora} context {context} batch {batch}: step {1e3 * step:.2f} ms, "
                          f"floor {1e3 * floor:.2f} ms, back to back {1e3 * steady:.2f} ms", flush=True)
            cuda_graphs = engine.executor.worker.uses_cuda_graphs
            del engine, shard
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if tp > 1:
            parallel_engine.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, cuda_graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--files", type=int, default=4, help="adapter files behind the distinct names")
    parser.add_argument("--quantizations", nargs="+", choices=FORMATS, default=["none"],
                        help="measure once per format: base weights none|fp8, +fp8kv: an fp8 KV cache")
    add_arguments(parser, EngineArgs, only=("enforce_eager", "tensor_parallel_size"))
    parser.add_argument("--out", type=Path, default=Path("results/roofline"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = preset_config(args.preset)
    started = time.time()
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else cpu_copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + written)", flush=True)
    tp = args.tensor_parallel_size
    max_batch = max(args.batches)
    kv_tokens = max_batch * (max(args.contexts) + args.warmup + 2 * args.steps + SLACK + 2 * PAGE_SIZE)
    engine_args = from_arguments(EngineArgs, args, model=args.preset, load_format="dummy", max_batch_size=max_batch,
                                 max_loras=max_batch, max_lora_rank=args.rank, page_size=PAGE_SIZE,
                                 kv_cache_tokens=kv_tokens, max_num_batched_tokens=kv_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [save_random_adapter(Path(tmp) / f"f{i}", config, args.rank, seed=i) for i in range(args.files)]
        all_names = {f"lora{i}": str(files[i % len(files)]) for i in range(max_batch)}
        for label in args.quantizations:
            q_rows, cuda_graphs = measure(dataclasses.replace(engine_args, **format_fields(label)), config, dtype,
                                          device, all_names, args, bandwidth)
            rows += q_rows
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    meta = {"device": device_name if tp == 1 else f"{tp}x {device_name}", "preset": args.preset,
            "tensor_parallel_size": tp,
            "rank": args.rank, "dtype": str(dtype), "quantizations": args.quantizations,
            "copy_bandwidth_Bps": bandwidth, "cuda_graphs": cuda_graphs,
            "warmup": args.warmup, "steps": args.steps, "seconds": time.time() - started,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    write_results(args.out, "roofline", rows, meta)
    plot(rows, args.out / "roofline.png", f"{args.preset} decode step vs memory floor, {meta['device']}")
    print(meta)
    table = [{**r, "ratio": f"{r['ratio']:.2f}x", "steady_ratio": f"{r['steady_ratio']:.2f}x"} for r in rows]
    print(format_table(table, ["quantization", "lora", "context", "batch", "step_ms", "floor_ms", "ratio", "steady_ms",
                               "steady_ratio", "weight_gb", "kv_gb", "lora_gb"]))


if __name__ == "__main__":
    main()
