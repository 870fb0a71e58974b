"""Soak: does a server stay whole under hours of mixed good and hostile traffic?

    python -m benchmarks.soak [--duration 1800] [--tenants 6] [--long-share 0] [--out results/soak]

Starts `punica serve` (the embedded SmolLM2 model on CPU, or whatever --serve-args say) with four
random tenant adapters and a folder of hostile ones, then for --duration seconds runs --tenants
clients sending normal requests (completions and chat, streamed or not, some cancelled midway)
beside one hostile client (extreme and malformed sampling values, unknown fields, lone
surrogates, malformed and oversized bodies, loads of broken adapters, bad names and paths,
disconnects). With --long-share, that share of the normal requests carries one long system prompt
(prefix-cache hits) and asks for 24-96 tokens (a tiny KV cache must preempt for them). It samples
the server's resident memory and /health's latency as it goes.

Checks, each a failure (exit code 1) when broken: no normal request lost (every one not cancelled
answers 200 with finish_reason stop or length and no more tokens than asked), no hostile request
answered 5xx, /health always answering within a second, and, once traffic stops and the server is
idle, no running or queued request, KV page or adapter slot held (from /metrics). Reported, not
judged: memory (the resident set over time, and its growth after the first fifth of the run) and
what the KV cache went through (preemptions, chunked steps, prefix-cache hits and pages).
Writes soak.json and soak.png under --out and prints a summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import save_figure, write_results
from punica.config import ModelConfig
from punica.lora.dummy import save_random_adapter
from punica.models.loader import resolve_model_dir

HEALTH_S = 1.0
MAX_REQUEST_BYTES = 256 << 10
TENANTS = ("tenant-0", "tenant-1", "tenant-2", "tenant-3")
PROMPTS = ("The weather today is", "Tell me a story about", "def fibonacci(n):", "My favourite food is")
# the system prompt of --long-share's requests: every tenant's long requests share it, so their
# prompts hit the prefix cache, and their long outputs outgrow a tiny KV cache (preemption)
SYSTEM_PROMPT = ("You are the support assistant of a company that rents bicycles in three cities. Answer in "
                 "plain words, at most two short paragraphs. Never promise refunds; say that a person will "
                 "look at the case within two working days. If the question is not about bicycles, rentals, "
                 "opening hours or prices, say politely that you can only help with those.")
HOSTILE_BODIES = [
    {"temperature": 1e-300}, {"temperature": float("nan")}, {"seed": 1 << 70}, {"seed": -(1 << 64)},
    {"repetition_penalty": 1e-300, "temperature": 1.0}, {"top_p": 0}, {"top_k": -7}, {"max_tokens": 0},
    {"max_tokens": -1}, {"n": 10 ** 6}, {"logprobs": 99}, {"stop": ["x"] * 1000}, {"foo": "bar"},
    {"tool_choice": "required"}, {"logit_bias": {"5": 100}}, {"prompt": "\ud800"}, {"prompt": [10 ** 9]},
    {"model": "../etc/passwd"}, {"stream": "yes"}, {"frequency_penalty": float("inf")},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_adapters(root: Path, config: ModelConfig) -> list[str]:
    """Tenant adapters under root/served (what the server serves) and hostile ones under
    root/hostile (what the hostile client tries to load): their names."""
    for i, name in enumerate(TENANTS):
        save_random_adapter(root / "served" / name, config, rank=8, seed=i, alpha=16)
    hostile = {"huge": dict(weights=1e30), "nan-weights": dict(weights=float("nan")),
               "nan-alpha": dict(lora_alpha=float("nan")), "big-alpha": dict(lora_alpha=1e300),
               "rank-512": dict(r=512), "dora": dict(use_dora=True), "fine": {}}
    for i, (name, change) in enumerate(hostile.items()):
        path = save_random_adapter(root / "hostile" / name, config, rank=4, seed=100 + i, projections=("q", "v"))
        if "weights" in change:
            value, tensors = change.pop("weights"), load_file(path / "adapter_model.safetensors")
            save_file({k: torch.full_like(v, value) for k, v in tensors.items()}, path / "adapter_model.safetensors")
        if change:
            cfg = json.loads((path / "adapter_config.json").read_text()) | change
            (path / "adapter_config.json").write_text(json.dumps(cfg))
    return list(hostile)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Tally:
    def __init__(self):
        self.normal = self.cancelled = self.hostile = 0
        self.failures: list[str] = []

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)


async def tenant(client: httpx.AsyncClient, rng: random.Random, tally: Tally, until: float,
                 long_share: float) -> None:
    while time.monotonic() < until:
        long = long_share > 0 and rng.random() < long_share  # 0 draws nothing: the default traffic is the same
        model, max_tokens = rng.choice(TENANTS + ("base",)), rng.randint(24, 96) if long else rng.randint(1, 12)
        chat, stream, cancel = rng.random() < 0.3, rng.random() < 0.5, rng.random() < 0.15
        body = {"model": model, "max_tokens": 400 if cancel else max_tokens, "temperature": rng.choice([0, 0.8]),
                "stream": stream}
        if chat:
            system = [{"role": "system", "content": SYSTEM_PROMPT}] if long else []
            path, body["messages"] = "/v1/chat/completions", system + [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            path, body["prompt"] = "/v1/completions", (SYSTEM_PROMPT + "\n\n" if long else "") + rng.choice(PROMPTS)
        try:
            if cancel:
                tally.cancelled += 1
                await asyncio.wait_for(client.post(path, json=body), timeout=rng.uniform(0.05, 1.0))
                continue
            reasons, tokens = [], 0
            if stream:
                body["stream_options"] = {"include_usage": True}
                async with client.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        tally.fail(f"{path} {r.status_code}")
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            reasons += [c["finish_reason"] for c in chunk.get("choices", []) if c["finish_reason"]]
                            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            else:
                r = await client.post(path, json=body)
                if r.status_code != 200:
                    tally.fail(f"{path} {r.status_code} {r.text[:200]}")
                    continue
                reasons = [c["finish_reason"] for c in r.json()["choices"]]
                tokens = r.json()["usage"]["completion_tokens"]
            if reasons not in (["stop"], ["length"]) or not 1 <= tokens <= max_tokens:
                tally.fail(f"{path} {model}: finish {reasons}, {tokens} of {max_tokens} tokens")
            tally.normal += 1
        except asyncio.TimeoutError:
            if not cancel:
                tally.fail(f"{path} timed out")
        except httpx.HTTPError as e:
            tally.fail(f"{path} {type(e).__name__}: {e}")


async def hostile(client: httpx.AsyncClient, rng: random.Random, tally: Tally, until: float, adapters: list[str],
                  hostile_dir: Path) -> None:
    headers = {"content-type": "application/json"}
    while time.monotonic() < until:
        choice = rng.randrange(6)
        if choice == 0:
            body = {"model": rng.choice(TENANTS), "prompt": "Hi", "max_tokens": 4} | rng.choice(HOSTILE_BODIES)
            request = ("/v1/completions", json.dumps(body).encode())
        elif choice == 1:
            request = ("/v1/chat/completions", json.dumps({"model": "tenant-0", "messages": [
                {"role": rng.choice(["user", "wizard"]), "content": rng.choice(["\ud800", [{"type": "image"}], 5])}],
                "max_completion_tokens": rng.choice([0, -3, 4])}).encode())
        elif choice == 2:
            request = ("/v1/completions", rng.choice([b"{not json", b"[" * 50_000 + b"]" * 50_000, b"", b"null",
                                                      bytes(rng.randrange(256) for _ in range(200))]))
        elif choice == 3:
            prompt = "word " * (MAX_REQUEST_BYTES // 5 + rng.randrange(1000))
            request = ("/v1/completions", json.dumps({"model": "tenant-1", "prompt": prompt}).encode())
        elif choice == 4:
            name = rng.choice(["../x", "a" * 300, "", "a b", "ok-name", "tenant-0", "\ud800"])
            path = rng.choice([str(hostile_dir / rng.choice(adapters)), "/etc", "a\x00b"])
            request = ("/v1/load_lora_adapter", json.dumps({"lora_name": name, "lora_path": path}).encode())
        else:
            body = {"model": rng.choice(TENANTS), "prompt": "Count:", "max_tokens": 300, "stream": True}
            try:
                async with client.stream("POST", "/v1/completions", json=body, timeout=0.5) as r:
                    async for _ in r.aiter_bytes():
                        break
            except httpx.TimeoutException:
                pass
            continue
        tally.hostile += 1
        r = await client.post(request[0], content=request[1], headers=headers)
        if r.status_code >= 500:
            tally.fail(f"hostile {request[0]} answered {r.status_code}: {r.text[:200]}")
        if request[0] == "/v1/load_lora_adapter" and r.status_code == 200:  # "fine": it really was fine
            await client.post("/v1/unload_lora_adapter", json={"lora_name": json.loads(request[1])["lora_name"]})


async def watch(client: httpx.AsyncClient, pid: int, tally: Tally, until: float, sample_s: float,
                series: list[dict], start: float) -> None:
    next_sample = time.monotonic()
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            r = await client.get("/health", timeout=HEALTH_S)
            if r.status_code != 200:
                tally.fail(f"/health {r.status_code}")
        except httpx.TimeoutException:
            tally.fail(f"/health did not answer within {HEALTH_S} s")
        latency = time.monotonic() - t
        if t >= next_sample:
            series.append({"t_s": t - start, "rss_mb": rss_mb(pid), "health_ms": 1e3 * latency,
                           "normal": tally.normal, "hostile": tally.hostile})
            next_sample += sample_s
        await asyncio.sleep(0.2)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def soak(url: str, pid: int, duration: float, tenants: int, sample_s: float, seed: int,
               adapters: list[str], hostile_dir: Path, long_share: float) -> tuple[Tally, list[dict], dict, dict]:
    tally, series = Tally(), []
    start = time.monotonic()
    until = start + duration
    limits = httpx.Limits(max_connections=tenants * 4 + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        await asyncio.gather(watch(client, pid, tally, until, sample_s, series, start),
                             hostile(client, random.Random(seed), tally, until, adapters, hostile_dir),
                             *(tenant(client, random.Random(seed + 1 + i), tally, until, long_share)
                               for i in range(tenants)))
        deadline = time.monotonic() + 120  # idle: cancelled requests' aborts and the last steps land
        while True:
            text = (await client.get("/metrics")).text
            gauges = {name: metric(text, f"punica_{name}") for name in
                      ("batch_size", "queue_length", "kv_cache_usage", "lora_slots_held")}
            if not any(gauges.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    for name, value in gauges.items():
        if value:
            tally.fail(f"idle server still has {name} {value}")
    # what the KV cache went through: reported, not judged
    kv_cache = {name: metric(text, f"punica_{name}") for name in
                ("preemptions_total", "chunked_prefill_steps_total", "prefix_cache_pages")}
    kv_cache["prefix_cache_hit_tokens_total"] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                                    if line.startswith("punica_prefix_cache_hit_tokens_total{"))
    return tally, series, gauges, kv_cache


def plot(series: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([s["t_s"] / 60 for s in series], [s["rss_mb"] for s in series], marker=".", ms=3)
    ax.set_xlabel("minutes", fontsize=8)
    ax.set_ylabel("server RSS (MB)", fontsize=8)
    ax.grid(True, alpha=0.3)
    save_figure(fig, path, title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--tenants", type=int, default=6, help="clients sending normal requests")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long-share", type=float, default=0.0,
                        help="share of normal requests that carry a shared system prompt and ask for 24-96 tokens")
    parser.add_argument("--serve-args", default="--max-batch-size 16 --max-loras 4 --kv-cache-tokens 16384",
                        help="extra flags of `punica serve`")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hostile_names = make_adapters(root, ModelConfig.from_dir(resolve_model_dir(None)))
        port = free_port()
        command = [sys.executable, "-m", "punica.cli", "serve", "--port", str(port), "--served-model-name", "base",
                   "--adapter-dir",
                   str(root / "served"), "--adapter-dir", str(root / "hostile"), "--max-request-bytes",
                   str(MAX_REQUEST_BYTES), *args.serve_args.split()]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"))
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
            tally, series, gauges, kv_cache = asyncio.run(soak(url, server.pid, args.duration, args.tenants,
                                                               args.sample_s, args.seed, hostile_names,
                                                               root / "hostile", args.long_share))
        finally:
            server.terminate()
            server.wait(60)
    warm = [s for s in series if s["t_s"] >= args.duration / 5]
    growth = warm[-1]["rss_mb"] - warm[0]["rss_mb"] if len(warm) > 1 else 0.0
    summary = {"normal": tally.normal, "cancelled": tally.cancelled, "hostile": tally.hostile,
               "failures": tally.failures, "idle_gauges": gauges, "kv_cache": kv_cache,
               "rss_mb_first": series[0]["rss_mb"] if series else None,
               "rss_mb_after_warm_up": warm[0]["rss_mb"] if warm else None,
               "rss_mb_last": series[-1]["rss_mb"] if series else None, "rss_growth_after_warm_up_mb": growth,
               "health_ms_max": max((s["health_ms"] for s in series), default=None)}
    meta = {"date": time.strftime("%Y-%m-%d"), "duration_s": args.duration, "tenants": args.tenants,
            "long_share": args.long_share,
            "serve_args": args.serve_args, "device": "cpu", "torch": torch.__version__, "summary": summary}
    write_results(args.out, "soak", series, meta)
    if series:
        plot(series, args.out / "soak.png", f"server RSS over a {args.duration / 60:.0f}-minute soak")
    print(json.dumps(summary, indent=2))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
