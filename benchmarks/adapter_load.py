"""On-demand adapter loading: copy latency against the transfer floor, and decode throughput
over a Zipf-popular stream of many adapters through a few GPU slots against all-resident.

python -m benchmarks.adapter_load [--preset llama-2-7b] [--rank 16] [--adapters 1000] [--slots 64]

1. Load latency: one rank-r all-projection adapter, packed in pinned host memory, into a pool
   slot (LoraPool.write_packed: one copy, as the AdapterManager does), CUDA events, median;
   floor = adapter bytes / pinned host-to-device bandwidth measured in the same run.
   disk_to_host_ms: the read before it, as the manager's reader thread does it (read_adapter,
   then pack into a row of the host tier's page-locked arena), wall clock, median of 3;
   two_reads_ms: two such reads of two files at once on the manager's reader threads (IO_THREADS),
   wall clock of both, median of 3 (against 2 x disk_to_host_ms: whether reading ahead on two
   threads gains on this host). --latency-only stops after this part.
2. Throughput: `--requests` requests (prompt 64, output 64 tokens, greedy) whose adapters are
   Zipf(1.5) over `--adapters` registered adapters, served with `--slots` GPU slots (loads on
   demand: disk -> host tier -> slot), against the same stream with every adapter it uses
   already resident. The registered names share `--files` adapter files on disk (only the
   bytes copied differ per name, not the values), so 1,000 adapters need not fill the disk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, warm_up, write_results
from punica.config import EngineConfig, ModelConfig, preset_config
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.adapter import read_adapter
from punica.lora.dummy import save_random_adapter
from punica.lora.host_arena import HostArena
from punica.lora.manager import reader_threads
from punica.lora.pool import LoraPool
from punica.models.loader import dummy_model


def timed(fn, device: torch.device, repeat: int) -> list[float]:
    """Seconds per call of fn() (CUDA events on GPU, wall clock on CPU), after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def load_latency(config: ModelConfig, rank: int, paths: list[Path], device: torch.device) -> dict:
    """Part 1 of the module docstring, reading paths[0]; two_reads_ms only where two paths are given."""
    pool = LoraPool(config, 2, rank, torch.bfloat16, device)
    pinned = device.type == "cuda"
    arena = HostArena(len(paths), pool.packed_shape, torch.bfloat16, pin=pinned)

    def read(i: int = 0) -> tuple[torch.Tensor, float]:  # the manager's: checked tensors straight into an arena row
        adapter = read_adapter(paths[i], config, dtype=torch.bfloat16)
        return pool.pack(adapter, out=arena.rows[i]), adapter.scale

    packed, scale = read()
    nbytes = packed.nbytes
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = statistics.median(timed(lambda: dev.copy_(host, non_blocking=True), device, 20))
    write = statistics.median(timed(lambda: pool.write_packed(1, packed, scale, non_blocking=True), device, 20))
    read_s = statistics.median(timed(read, torch.device("cpu"), 3))
    latency = {"adapter_mb": nbytes / 1e6, "h2d_gb_s": nbytes / h2d / 1e9, "floor_ms": h2d * 1e3,
               "load_ms": write * 1e3, "load_over_floor": write / h2d, "disk_to_host_ms": read_s * 1e3}
    if len(paths) > 1:  # as the manager's reader threads run two reads ahead of the slots
        with reader_threads(device) as readers:
            two = timed(lambda: list(readers.map(read, [0, 1])), torch.device("cpu"), 3)
        latency["two_reads_ms"] = 1e3 * statistics.median(two)
    return latency


def throughput(model, config: ModelConfig, names: dict[str, str], stream: list[str], slots: int, preload: bool,
               device: torch.device) -> dict:
    warm_name = "warm-up"  # not in the stream: compiles the kernels without loading stream adapters
    engine = engine_on_model(model, EngineConfig(max_loras=slots + 1, max_lora_rank=16,
                                                 kv_cache_tokens=32 * 160, lora_host_bytes=16 << 30),
                             {**names, warm_name: next(iter(names.values()))})
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    # resident run: every adapter of the stream on the GPU before the clock starts
    warm_up(engine, [None] + [warm_name] * 32 + (list(dict.fromkeys(stream)) if preload else []))
    loads_before = engine.adapters.num_loads
    for name in stream:
        engine.add_request([rng.randrange(3, config.vocab_size) for _ in range(64)], params, name)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    step_seconds, batch_sizes = [], []
    while engine.has_unfinished():
        t = time.perf_counter()
        outputs = engine.step()
        step_seconds.append(time.perf_counter() - t)
        batch_sizes.append(len(outputs))
        tokens += sum(len(o.new_token_ids) for o in outputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    step_seconds.sort()
    return {"slots": slots, "resident": preload, "requests": len(stream), "distinct": len(set(stream)),
            "loads": engine.adapters.num_loads - loads_before, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "steps": len(step_seconds),
            "mean_batch": statistics.mean(batch_sizes),
            "step_ms_p50": 1e3 * step_seconds[len(step_seconds) // 2],
            "step_ms_p99": 1e3 * step_seconds[int(0.99 * (len(step_seconds) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("results/adapter_load"))
    parser.add_argument("--latency-only", action="store_true", help="part 1 alone (module docstring)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset_config(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        files = [save_random_adapter(Path(tmp) / f"file{i}", config, args.rank, seed=i)
                 for i in range(max(2, args.files))]
        latency = load_latency(config, args.rank, files[:2], device)
        print(format_table([latency], list(latency)))
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": args.preset,
                "rank": args.rank, "adapters": args.adapters, "date": time.strftime("%Y-%m-%d"), "latency": latency}
        if args.latency_only:
            write_results(args.out, "adapter_load", [], meta)
            return
        names = {f"tenant{i}": str(files[i % len(files)]) for i in range(args.adapters)}
        rng = random.Random(1)
        weights = [1 / (i + 1) ** 1.5 for i in range(args.adapters)]
        stream = [f"tenant{i}" for i in rng.choices(range(args.adapters), weights=weights, k=args.requests)]
        model = dummy_model(config, torch.bfloat16 if device.type == "cuda" else torch.float32, device)
        rows = [throughput(model, config, names, stream, args.slots, False, device),
                throughput(model, config, names, stream, len(set(stream)), True, device)]
    rows[0]["vs_resident"] = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    rows[1]["vs_resident"] = 1.0
    write_results(args.out, "adapter_load", rows, meta)
    print(format_table([latency], list(latency)))
    print(format_table(rows, ["slots", "resident", "requests", "distinct", "loads", "tokens", "seconds",
                              "tokens_per_s", "vs_resident", "steps", "mean_batch", "step_ms_p50", "step_ms_p99"]))


if __name__ == "__main__":
    main()
