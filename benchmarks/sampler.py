"""A step's sampling: the host's and the device's time of punica.engine.sampler.sample by batch and
sampling settings.

    python -m benchmarks.sampler [--batches 1 8 32] [--vocab 32000] [--repeat 20] [--out results/sampler]

For each batch size and setting, random logits [batch, vocab] float32 on the device (CUDA where
there is one, else the CPU), N(0, 1) x LOGIT_SCALE, peaked as a language model's are (at
temperature 0.7 over 49,152 tokens: the largest probability about 0.25, the 0.9 nucleus about 170
tokens, up to 400), and `batch` requests of that setting; `sample` runs 3 times, then
--repeat times timed: host_ms is the median wall time of the call alone (on CUDA: its launches, the
host's part of a step, which the engine overlaps with the device only while it stays shorter than
the step), step_ms the median with the device synchronized after it. Settings:

    greedy       temperature 0
    temperature  temperature 0.7
    top_p        temperature 0.7, top_p 0.9
    top_k_top_p  temperature 0.7, top_k 50, top_p 0.9
    seeded       temperature 0.7, a seed per request

Writes sampler.json under --out and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, write_results
from punica.engine.request import Request
from punica.engine.sampler import sample
from punica.engine.sampling_params import SamplingParams

LOGIT_SCALE = 3.0
SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.7),
    "top_p": dict(temperature=0.7, top_p=0.9),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9),
    "seeded": dict(temperature=0.7),
}


def measure(batch: int, vocab: int, setting: str, repeat: int, device: torch.device) -> dict:
    seeded = setting == "seeded"
    requests = [Request(str(i), [1], SamplingParams(max_tokens=1, seed=i if seeded else None, **SETTINGS[setting]))
                for i in range(batch)]
    logits = torch.randn(batch, vocab, device=device) * LOGIT_SCALE

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    host, step = [], []
    for i in range(3 + repeat):
        synchronize()
        start = time.perf_counter()
        sample(logits, requests)
        launched = time.perf_counter()
        synchronize()
        if i >= 3:
            host.append(launched - start)
            step.append(time.perf_counter() - start)
    return {"batch": batch, "vocab": vocab, "setting": setting, "host_ms": 1e3 * statistics.median(host),
            "step_ms": 1e3 * statistics.median(step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results/sampler"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    rows = [measure(batch, args.vocab, setting, args.repeat, device) for batch in args.batches for setting in SETTINGS]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "sampler", rows, meta)
    print(meta)
    print(format_table(rows, ["batch", "vocab", "setting", "host_ms", "step_ms"]))


if __name__ == "__main__":
    main()
