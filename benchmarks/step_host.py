"""The host's share of a decode step: how long `engine.step()` works on the host before the step's
device work is launched, phase by phase.

    python -m benchmarks.step_host [--preset llama-2-7b] [--batches 1 32] [--context 512] [--steps 100]
        [--out results/step_host]

The decode roofline (benchmarks.roofline) times each step with the device synchronized before and
after it, so a step's time there is the host's work up to its launch plus the device's work (the
host's work after the launch, sampling's and reading the step before, runs while the device
computes). Here one engine (random weights, CUDA graphs, overlapped steps, the base model) decodes
--batches requests from --context-token prompts (prefilled without chunks); once every request has
its first token and 30 more steps ran, --steps steps are run with the device synchronized before
each, as the roofline's, and each phase of `engine.step()` is timed by a wrapper around the method
that does it:

    poll            the adapter manager's loads (EngineCore._poll_adapters)
    may_run_ahead   whether the next step may be planned before the last one's tokens are read
    schedule        the scheduler's plan (Scheduler.schedule)
    step_input      the plan's host arrays (StepInput.from_requests)
    fill            a CUDA-graph bucket's host buffers filled and copied (StaticBatch.fill)
    replay          the graph's launch (torch.cuda.CUDAGraph.replay), or None without graphs
    sample, update  sampling launched, and the step before read (after the launch)

`launch_us` is the median time from the start of `step()` to the return of the graph's launch:
what the host adds to a synchronized step. Medians over the steps, us. Writes step_host.json
under --out and prints a table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import format_table, write_results
from punica.config import EngineArgs, preset_config
from punica.engine import cuda_graphs
from punica.engine.core import EngineCore
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler
from punica.engine.step_input import StepInput
from punica.factory import engine_on_model
from punica.models.loader import dummy_model

PHASES = (  # name -> (owner, method)
    ("poll", EngineCore, "_poll_adapters"),
    ("may_run_ahead", Scheduler, "may_run_ahead"),
    ("schedule", Scheduler, "schedule"),
    ("step_input", StepInput, "from_requests"),
    ("fill", cuda_graphs.StaticBatch, "fill"),
    ("replay", torch.cuda.CUDAGraph, "replay"),
    ("sample", EngineCore, "_sample"),
    ("update", EngineCore, "_update"),
)
WARMUP = 30


@contextmanager
def timed_phases(seconds: dict[str, list[float]], ends: dict[str, list[float]]):
    """Wrap each phase's method to append its duration to seconds[name] and its end time to
    ends[name]; the methods are restored on exit."""
    saved = []
    for name, owner, attr in PHASES:
        raw = owner.__dict__[attr]
        fn = raw.__func__ if isinstance(raw, classmethod) else raw

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            result = _fn(*args, **kwargs)
            end = time.perf_counter()
            seconds[_name].append(end - start)
            ends[_name].append(end)
            return result
        saved.append((owner, attr, raw))
        setattr(owner, attr, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)
    try:
        yield
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)


def measure(engine, batch: int, context: int, steps: int, vocab: int, rng: random.Random) -> dict:
    """One row: the phases' medians over `steps` synchronized decode steps of `batch` requests."""
    device = engine.executor.device
    params = SamplingParams(max_tokens=2 * WARMUP + steps + 16, temperature=0, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(3, vocab) for _ in range(context)], params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill until every request has its first token
        started.update(output.request_id for output in engine.step())
    for _ in range(WARMUP):
        engine.step()
    seconds: dict[str, list[float]] = defaultdict(list)
    ends: dict[str, list[float]] = defaultdict(list)
    launch, total = [], []
    with timed_phases(seconds, ends):
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ends["replay"].clear()
            start = time.perf_counter()
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total.append(time.perf_counter() - start)
            if ends["replay"]:
                launch.append(ends["replay"][-1] - start)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    row = {"batch": batch, "context": context, "steps": steps,
           "step_us": 1e6 * statistics.median(total),
           "launch_us": 1e6 * statistics.median(launch) if launch else None}
    row.update({f"{name}_us": 1e6 * statistics.median(seconds[name]) if seconds[name] else None
                for name, _, _ in PHASES})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-2-7b", help="a model shape of punica.config.PRESETS")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("results/step_host"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = preset_config(args.preset)
    started = time.time()
    model = dummy_model(config, device=device)  # the device's default dtype: bf16 on a GPU, fp32 on a CPU
    kv_tokens = max(args.batches) * (args.context + 2 * WARMUP + args.steps + 64)
    # a step budget of the whole cache: the prompts prefill without chunks, as the roofline's do
    engine_args = EngineArgs(model=args.preset, max_batch_size=max(args.batches), kv_cache_tokens=kv_tokens,
                             max_num_batched_tokens=kv_tokens)
    engine = engine_on_model(model, engine_args.engine_config())
    rng = random.Random(0)
    rows = [measure(engine, batch, args.context, args.steps, config.vocab_size, rng) for batch in args.batches]
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "preset": args.preset,
            "cuda_graphs": engine.executor.worker.uses_cuda_graphs, "seconds": time.time() - started,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    write_results(args.out, "step_host", rows, meta)
    print(meta)
    shown = [{k: (f"{v:.1f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    print(format_table(shown, ["batch", "step_us", "launch_us"] + [f"{name}_us" for name, _, _ in PHASES]))


if __name__ == "__main__":
    main()
