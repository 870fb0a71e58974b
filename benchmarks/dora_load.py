"""DoRA's load-time cost: a 7B adapter's copy into its GPU slot beside the weight norms computed
there (m / ||W + s B A|| per output feature of every projection of every layer, in float32 from
the resident base weights: punica.lora.pool.LoraPool.write_packed).

python -m benchmarks.dora_load [--preset llama-2-7b] [--rank 16] [--repeats 7]

A random DoRA adapter on all 7 projections (punica.lora.dummy) is packed once into page-locked
host memory. Each repeat, after one warm-up, times on the host (synchronized before and after):
the slot write of a plain adapter (the copy alone: A, B and the unused magnitude rows, one slot),
the DoRA write (the copy, then the norms), and the norms alone; medians. Bandwidth = copied bytes /
time.
Writes JSON and a PNG bar plot.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, save_figure, write_results
from punica.config import preset_config
from punica.lora.adapter import read_adapter
from punica.lora.dummy import save_random_adapter
from punica.lora.pool import LoraPool
from punica.models.loader import dummy_model


def timed(fn, repeats: int) -> float:
    """Median wall milliseconds of fn(), the device synchronized before and after each call."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/dora_load"))
    args = parser.parse_args()
    config, dtype = preset_config(args.preset), torch.bfloat16
    model = dummy_model(config, dtype, "cuda")
    pool = LoraPool(config, 1, args.rank, dtype, "cuda")
    pool.base_weight = model.group_weight
    with tempfile.TemporaryDirectory() as tmp:
        adapter = read_adapter(save_random_adapter(Path(tmp) / "dora", config, args.rank, seed=0, dora=True),
                               config, dtype=dtype)
    packed = pool.pack(adapter).pin_memory()
    item = packed.element_size()
    rows = [
        {"what": "copy, plain LoRA (the whole slot)", "bytes": pool.slot_numel * item,
         "ms": timed(lambda: pool.write_packed(0, packed, adapter.scale, non_blocking=True), args.repeats)},
        {"what": "copy + norms, DoRA", "bytes": pool.slot_numel * item,
         "ms": timed(lambda: pool.write_packed(0, packed, adapter.scale, non_blocking=True, dora=True),
                     args.repeats)},
        {"what": "norms alone", "bytes": 0,
         "ms": timed(lambda: pool._compute_out_scales(0, adapter.scale), args.repeats)},
    ]
    for row in rows:
        row["gb_per_s"] = row["bytes"] / row["ms"] / 1e6 if row["bytes"] else None
    meta = {"device": torch.cuda.get_device_name(), "preset": args.preset, "rank": args.rank,
            "num_layers": config.num_layers, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "dora_load", rows, meta)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh([r["what"] for r in rows], [r["ms"] for r in rows])
    ax.set_xlabel("ms (median)", fontsize=8)
    save_figure(fig, args.out / "dora_load.png", f"{args.preset} rank {args.rank} DoRA slot write, {meta['device']}")
    print(meta)
    print(format_table(rows, ["what", "bytes", "ms", "gb_per_s"]))


if __name__ == "__main__":
    main()
