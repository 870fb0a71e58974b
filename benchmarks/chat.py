"""Multi-tenant chat, prefix caching on against off.

    python -m benchmarks.chat [--preset llama-2-7b] [--adapters 32] [--system-tokens 1024]
        [--conversations 96] [--turns 3] [--user-tokens 64] [--reply-tokens 64] [--rate 32] [--out results/chat]

Each of --adapters adapters (random, rank 16 on all 7 projections) has its own system prompt of
--system-tokens random tokens. Conversation i runs on adapter i mod --adapters; conversations
arrive as a Poisson process of --rate per second (fixed seed); each has --turns turns, a turn's
prompt being the whole history (system prompt, then each earlier user message and reply) plus a
new user message of 1 to 2x --user-tokens tokens, its reply --reply-tokens tokens (greedy,
ignore_eos); a conversation's next turn is sent when its reply is complete. The same arrivals
and messages run on one engine with the prefix cache and on one without (one model, CUDA graphs,
overlapped steps, the default chunked prefill), every adapter resident before the clock starts.

Reported per mode: throughput (prompt + generated tokens over the time from the first arrival to
the last reply), time to first token and time per output token (mean and p99), and the share of
prompt tokens the cache held. Writes chat.json and chat.png under --out.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import format_table, percentile, save_figure, warm_up, write_results
from punica.config import EngineConfig, preset_config
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.dummy import save_random_adapter
from punica.models.loader import dummy_model


def conversations(args, vocab: int) -> tuple[list[float], list[list[list[int]]], list[list[int]]]:
    """(arrival times, each conversation's user messages, the system prompt of each adapter)."""
    rng = random.Random(0)
    systems = [[rng.randrange(3, vocab) for _ in range(args.system_tokens)] for _ in range(args.adapters)]
    arrivals, t = [], 0.0
    for _ in range(args.conversations):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    messages = [[[rng.randrange(3, vocab) for _ in range(rng.randint(args.user_tokens, 2 * args.user_tokens))]
                 for _ in range(args.turns)] for _ in range(args.conversations)]
    return arrivals, messages, systems


def serve(engine, args, arrivals, messages, systems) -> dict:
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    history = [list(systems[i % args.adapters]) for i in range(args.conversations)]
    turn = [0] * args.conversations
    due = sorted((t, i) for i, t in enumerate(arrivals))  # (send time, conversation), earliest first
    owner, outs = {}, []
    start = time.perf_counter()
    while due or engine.has_unfinished():
        now = time.perf_counter() - start
        while due and due[0][0] <= now:
            _, i = due.pop(0)
            history[i] += messages[i][turn[i]]
            owner[engine.add_request(list(history[i]), params, f"lora{i % args.adapters}")] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[0][0] - now))
            continue
        for out in engine.step():
            if not out.finished:
                continue
            assert out.finish_reason == "length", out.error
            outs.append(out)
            i = owner.pop(out.request_id)
            history[i] += out.token_ids
            turn[i] += 1
            if turn[i] < args.turns:
                due.append((time.perf_counter() - start, i))
    seconds = time.perf_counter() - start - arrivals[0]
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    tokens = prompt + sum(len(o.token_ids) for o in outs)
    ttft = [1e3 * o.time_to_first_token for o in outs]
    tpot = [1e3 * o.time_per_output_token for o in outs]
    return {"requests": len(outs), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttft_mean_ms": statistics.mean(ttft), "ttft_p99_ms": percentile(ttft, 0.99),
            "tpot_mean_ms": statistics.mean(tpot), "tpot_p99_ms": percentile(tpot, 0.99),
            "cached_share": sum(o.num_cached_tokens for o in outs) / prompt}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(9, 3))
    for ax, key, label in zip(axes, ("tokens_per_s", "ttft_mean_ms", "tpot_mean_ms"),
                              ("tokens/s", "TTFT mean (ms)", "TPOT mean (ms)")):
        ax.bar([r["mode"] for r in rows], [r[key] for r in rows])
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
    save_figure(fig, path, title)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-2-7b")
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--user-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--rate", type=float, default=32.0)
    parser.add_argument("--out", type=Path, default=Path("results/chat"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = preset_config(args.preset)
    longest = args.system_tokens + args.turns * (2 * args.user_tokens + args.reply_tokens) + 16
    model = dummy_model(config, dtype, device)
    arrivals, messages, systems = conversations(args, config.vocab_size)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = {f"lora{i}": str(save_random_adapter(Path(tmp) / f"a{i}", config, 16, seed=i))
                 for i in range(args.adapters)}
        for caching in (False, True):
            engine = engine_on_model(model, EngineConfig(max_loras=args.adapters, prefix_caching=caching,
                                                         kv_cache_tokens=32 * longest + args.adapters * longest),
                                     names)
            warm_up(engine, list(names))
            rows.append({"mode": "prefix cache" if caching else "no cache",
                         **serve(engine, args, arrivals, messages, systems)})
            print(f"{rows[-1]['mode']}: {rows[-1]['tokens_per_s']:.0f} tokens/s, TTFT mean "
                  f"{rows[-1]['ttft_mean_ms']:.0f} ms", flush=True)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    off, on = rows
    ratios = {"throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
              "ttft_mean_ratio": off["ttft_mean_ms"] / on["ttft_mean_ms"]}
    print(format_table(rows, ["mode", "requests", "tokens_per_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms",
                              "tpot_p99_ms", "cached_share"]))
    print(f"with the cache: {ratios['throughput_ratio']:.2f}x throughput, {ratios['ttft_mean_ratio']:.2f}x lower "
          f"mean TTFT", flush=True)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    meta = {"device": device_name, "preset": args.preset, **vars(args), "out": str(args.out), **ratios,
            "date": time.strftime("%Y-%m-%d")}
    path = write_results(args.out, "chat", rows, meta)
    plot(rows, path.with_suffix(".png"), f"{args.preset}, {args.adapters} tenants' chats, {device_name}")


if __name__ == "__main__":
    main()
