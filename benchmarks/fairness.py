"""Fair share under a flood: does one tenant sending 10x the others' rate hold back their first tokens?

python -m benchmarks.fairness [--preset NAME] [--duration 20] [--load 1.7] [--steady-tenants 7]
    [--flood-factor 10] [--keys tenant|adapter] [--max-batch-size 32] [--prompt-len MIN MAX]
    [--output-len MIN MAX] [--out results/fairness]

Tenants: --steady-tenants steady ones and one flood sending --flood-factor times a steady tenant's
rate, each on its own rank-8 adapter (all 7 projections), with Poisson arrivals for --duration
seconds; prompts of --prompt-len tokens, outputs of --output-len (uniform; default 8-32 and 4-24 on
CPU, 32-512 and 16-256 on CUDA; greedy, ignore_eos; fixed seeds, so every run gets the same
requests). The offered load is --load times the engine's capacity, measured first (requests/s of a
full queue of the same requests): by default the flood alone is 1.0x the capacity (the 7 steady
tenants add 0.7x: 1.7x in all), and each steady tenant asks 0.1x, under its fair share of 1/8.
--keys tenant: requests carry their tenant's name, as from a server with a tenants file; adapter: no
tenant (the engine's fair share then goes by adapter).

Runs, each a fresh engine over one model (the embedded SmolLM2-135M on CPU in fp32; on CUDA a
--preset of random weights in bf16): the steady tenants alone (fair), then steady + flood under
--scheduling fair and fcfs. The engine runs on a virtual clock: it advances by each step's time and
jumps over idle time to the next arrival (a step's time: its wall time on CUDA; on CPU, where other
processes may share the cores, the CPU time of this process's threads during the step); a request
is added at the first step boundary after its arrival, and its time to first token (TTFT) runs from
its arrival to the end of the step that returned its first token. Throughput = (prompt + generated
tokens) / the steps' total time (busy time), with every request run to its end.

Reported: each run's TTFT p50/p99 of the steady tenants and of the flood, throughput, the mean
step time (a steady request's TTFT is a step or two once admitted), preemptions;
then the steady TTFT p99 with the flood over without it (the goal: at most 1.5x under fair) and
fair's throughput over fcfs's (the goal: at least 0.97). Writes fairness.json and fairness.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import format_table, percentile, save_figure, warm_up, write_results
from punica.config import EngineArgs, EngineConfig, preset_config
from punica.engine.engine import Engine
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model, model_source
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model, load_weights

FLOOD = "flood"
RANK = 8


@dataclass(frozen=True)
class Arrival:
    time: float
    tenant: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Lengths:
    vocab_size: int
    prompt: tuple[int, int]   # min, max tokens
    output: tuple[int, int]

    def draw(self, rng: random.Random) -> tuple[list[int], int]:
        """One request's prompt and max_tokens."""
        return [rng.randrange(3, self.vocab_size) for _ in range(rng.randint(*self.prompt))], rng.randint(*self.output)


def arrivals(rates: dict[str, float], duration: float, lengths: Lengths, seed: int) -> list[Arrival]:
    """Poisson arrivals of each tenant at its rate (requests/s) over `duration` seconds."""
    out = []
    for i, (tenant, rate) in enumerate(rates.items()):
        rng = random.Random(seed * 1000 + i)
        t = rng.expovariate(rate)
        while t < duration:
            out.append(Arrival(t, tenant, *lengths.draw(rng)))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda a: a.time)


@dataclass(frozen=True)
class Traffic:
    """The benchmark's tenants and what they send: each steady tenant `steady_rate` requests/s, the
    flood `flood_factor` times that, for `duration` seconds."""
    steady_tenants: int
    flood_factor: float
    duration: float
    lengths: Lengths
    steady_rate: float = 0.0

    @property
    def tenants(self) -> list[str]:
        return [FLOOD] + [f"steady-{i}" for i in range(self.steady_tenants)]

    def full_queue(self, max_batch_size: int) -> list[Arrival]:
        """The capacity run's requests: three batches' worth at time 0, the tenants in turn."""
        rng = random.Random(99)
        return [Arrival(0.0, self.tenants[i % len(self.tenants)], *self.lengths.draw(rng))
                for i in range(3 * max_batch_size)]

    def at_load(self, load: float, requests_per_s: float) -> Traffic:
        """This traffic sending `load` times a capacity of `requests_per_s` in all."""
        return dataclasses.replace(self, steady_rate=load * requests_per_s / (self.steady_tenants + self.flood_factor))

    def schedule(self, flood: bool, seed: int) -> list[Arrival]:
        """One run's arrivals: the steady tenants', and the flood's if `flood`."""
        rates = {t: self.steady_rate for t in self.tenants[1:]}
        return arrivals(({FLOOD: self.flood_factor * self.steady_rate} if flood else {}) | rates, self.duration,
                        self.lengths, seed)


RUNS = (("no flood", "fair", False), ("flood", "fair", True), ("flood", "fcfs", True))  # run, scheduling, flood


def step_clock() -> float:
    """The clock a step's time is read from (seconds)."""
    return time.perf_counter() if torch.cuda.is_available() else time.process_time()


def run(engine: Engine, schedule: list[Arrival], keys: str) -> dict:
    """Serve `schedule` on the virtual clock: per tenant the TTFTs (s), and the totals."""
    clock = busy = 0.0
    pending, first, arrival_of, tenant_of, tokens, num_steps = 0, {}, {}, {}, 0, 0
    while pending < len(schedule) or engine.has_unfinished():
        if not engine.has_unfinished():
            clock = max(clock, schedule[pending].time)
        while pending < len(schedule) and schedule[pending].time <= clock:
            a = schedule[pending]
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
            request_id = engine.add_request(a.prompt, params, a.tenant, tenant=a.tenant if keys == "tenant" else None)
            arrival_of[request_id], tenant_of[request_id] = a.time, a.tenant
            pending += 1
        start = step_clock()
        outputs = engine.step()
        seconds = step_clock() - start
        clock, busy, num_steps = clock + seconds, busy + seconds, num_steps + 1
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = clock
            if out.finished:
                tokens += len(out.prompt_token_ids) + len(out.token_ids)
    ttft: dict[str, list[float]] = {}
    for request_id, at in first.items():
        ttft.setdefault(tenant_of[request_id], []).append(at - arrival_of[request_id])
    return {"ttft": ttft, "tokens": tokens, "busy_s": busy, "makespan_s": clock, "num_steps": num_steps,
            "num_preemptions": engine.stats().num_preemptions}


def row(name: str, scheduling: str, result: dict) -> dict:
    steady = [t for tenant, values in result["ttft"].items() if tenant != FLOOD for t in values]
    flood = result["ttft"].get(FLOOD, [])
    return {"run": name, "scheduling": scheduling, "requests": len(steady) + len(flood),
            "steady_ttft_p50_ms": 1e3 * percentile(steady, 0.5), "steady_ttft_p99_ms": 1e3 * percentile(steady, 0.99),
            "flood_ttft_p50_ms": 1e3 * percentile(flood, 0.5) if flood else None,
            "flood_ttft_p99_ms": 1e3 * percentile(flood, 0.99) if flood else None,
            "tokens_per_s": result["tokens"] / result["busy_s"], "busy_s": result["busy_s"],
            "step_ms": 1e3 * result["busy_s"] / result["num_steps"],
            "makespan_s": result["makespan_s"], "preemptions": result["num_preemptions"],
            "steady_ttft_s": sorted(steady)}


def capacity(make_engine, traffic: Traffic, max_batch_size: int) -> float:
    """Requests/s the engine serves from a full queue of this benchmark's requests."""
    schedule = traffic.full_queue(max_batch_size)
    return len(schedule) / run_on(make_engine("fcfs"), schedule, "adapter")["busy_s"]


def run_on(engine: Engine, schedule: list[Arrival], keys: str) -> dict:
    """`run`, then the engine's memory (its KV cache) is let go before the next engine is made."""
    try:
        return run(engine, schedule, keys)
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(10, 4))
    for r in rows:
        values = r["steady_ttft_s"]
        cdf.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{r['run']} ({r['scheduling']})")
    cdf.set_xscale("log")
    cdf.set_xlabel("steady tenants' TTFT (s)", fontsize=8)
    cdf.set_ylabel("fraction of requests", fontsize=8)
    cdf.legend(fontsize=7)
    cdf.grid(True, which="both", alpha=0.3)
    labels = [f"{r['run']}\n{r['scheduling']}" for r in rows]
    bars.bar(labels, [r["tokens_per_s"] for r in rows])
    bars.set_ylabel("tokens/s (prompt + generated) per busy second", fontsize=8)
    bars.tick_params(labelsize=7)
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b", help="the random-weight model on CUDA (CPU: SmolLM2-135M)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    parser.add_argument("--load", type=float, default=1.7, help="offered load over the engine's capacity")
    parser.add_argument("--steady-tenants", type=int, default=7)
    parser.add_argument("--flood-factor", type=float, default=10.0)
    parser.add_argument("--keys", choices=("tenant", "adapter"), default="tenant",
                        help="tenant: requests carry their tenant's name; adapter: none (fair share by adapter)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    parser.add_argument("--out", type=Path, default=Path("results/fairness"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        model, model_name = dummy_model(preset_config(args.preset), torch.bfloat16, device), args.preset
    else:
        model, model_name = load_weights(model_source(EngineArgs())[0], torch.float32), "SmolLM2-135M-Instruct fp32"
    config = model.config
    cpu = device == "cpu"
    lengths = Lengths(config.vocab_size, tuple(args.prompt_len or ((8, 32) if cpu else (32, 512))),
                      tuple(args.output_len or ((4, 24) if cpu else (16, 256))))
    traffic = Traffic(args.steady_tenants, args.flood_factor, args.duration, lengths)
    tenants = traffic.tenants
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {t: str(save_random_adapter(Path(tmp) / t, config, RANK, seed=i)) for i, t in enumerate(tenants)}
        engine_config = EngineConfig(max_batch_size=args.max_batch_size, max_loras=len(tenants), max_lora_rank=RANK)

        def make_engine(scheduling: str) -> Engine:
            engine = engine_on_model(model, dataclasses.replace(engine_config, scheduling=scheduling), adapters)
            warm_up(engine, tenants)
            return engine

        requests_per_s = capacity(make_engine, traffic, args.max_batch_size)
        traffic = traffic.at_load(args.load, requests_per_s)
        print(f"capacity {requests_per_s:.2f} requests/s: steady tenants {traffic.steady_rate:.3f} requests/s "
              f"each, the flood {args.flood_factor * traffic.steady_rate:.3f}", flush=True)
        rows = []
        for name, scheduling, flood in RUNS:
            schedule = traffic.schedule(flood, seed=1)
            rows.append(row(name, scheduling, run_on(make_engine(scheduling), schedule, args.keys)))
            print(f"{name} ({scheduling}): steady TTFT p99 {rows[-1]['steady_ttft_p99_ms']:.0f} ms, "
                  f"{rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": device_name, "model": model_name, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "duration_s": args.duration, "load": args.load, "capacity_requests_per_s": requests_per_s,
            "steady_tenants": args.steady_tenants, "flood_factor": args.flood_factor, "keys": args.keys,
            "prompt_len": lengths.prompt, "output_len": lengths.output,
            "max_batch_size": args.max_batch_size, "rank": RANK, "date": time.strftime("%Y-%m-%d")}
    write_results(args.out, "fairness", rows, meta)
    plot(rows, args.out / "fairness.png", f"{model_name}, {device_name}: 1 flood ({args.flood_factor:g}x) + "
                                          f"{args.steady_tenants} steady tenants, load {args.load:g}, keys {args.keys}")
    print(meta)
    baseline, fair, fcfs = (r["steady_ttft_p99_ms"] for r in rows)
    print(format_table(rows, ["run", "scheduling", "requests", "steady_ttft_p50_ms", "steady_ttft_p99_ms",
                              "flood_ttft_p50_ms", "flood_ttft_p99_ms", "tokens_per_s", "busy_s", "step_ms",
                              "preemptions"]))
    print(f"steady TTFT p99 with the flood / without: fair {fair / baseline:.2f}x, fcfs {fcfs / baseline:.2f}x "
          f"(goal: fair <= 1.5x)")
    print(f"throughput fair / fcfs: {rows[1]['tokens_per_s'] / rows[2]['tokens_per_s']:.3f} (goal: >= 0.97)")


if __name__ == "__main__":
    main()
