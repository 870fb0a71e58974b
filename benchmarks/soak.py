"""Soak: does a server stay whole under hours of mixed good and hostile traffic?

    python -m benchmarks.soak [--duration 1800] [--tenants 6] [--long-share 0] [--tenants-file] [--out results/soak]

Starts `punica serve` (the embedded SmolLM2 model on CPU, or whatever --serve-args say) with four
random tenant adapters and a folder of hostile ones, then for --duration seconds runs --tenants
clients sending normal requests (completions and chat, streamed or not, some cancelled midway)
beside one hostile client (extreme and malformed sampling values, unknown fields, lone
surrogates, malformed and oversized bodies, loads of broken adapters, bad names and paths,
disconnects). With --long-share, that share of the normal requests carries one long system prompt
(prefix-cache hits) and asks for 24-96 tokens (a tiny KV cache must preempt for them). It samples
the server's resident memory and /health's latency as it goes.

With --tenants-file, the server serves a tenants file this script writes (benchmarks.soak_tenants):
each client is a tenant with its own key and adapter, one of them under a max_concurrent_requests
it keeps to; their requests also carry, some of them, a small JSON schema never sent before, or a
long prompt of their own on the base model. The hostile client is a tenant too, which, besides
the traffic above, probes everything tenants must stop (other tenants' adapters, loads and
unloads, folders and cached prompts, the admin's endpoints, missing and wrong keys, grammars past
the limits and costly ones within them, bad cache salts), floods past its own
max_concurrent_requests half of the time (half of the flood with costly schemas), and holds idle,
slowloris and short-body connections. Each probe has an expected status. Halfway through, the file
gains a tenant and changes a weight, and the server is sent SIGHUP; the new tenant then sends
normal traffic too. The normal clients' time to first token (streamed requests; those with a
schema apart) is reported with and without the flood.

Checks, each a failure (exit code 1) when broken: no normal request lost (every one not cancelled
answers 200 with finish_reason stop or length and no more tokens than asked), no hostile request
answered 5xx, /health always answering within --health-s (a second), and, once traffic stops and the server is
idle, no running or queued request, KV page or adapter slot held (from /metrics). With
--tenants-file also: every probe answered as expected, the flood met its cap (429s), the grammars
past the limits met them (400s; one sent while its tenant is at its cap gets the 429 first), and the
reload applied (the new key refused before it, accepted after). Reported, not judged: memory (the
resident set over time, and its growth after the first fifth of the run), what the KV cache went
through (preemptions, chunked steps, prefix-cache hits and pages) and, with --tenants-file, the
times to first token, each probe kind's answers, how often the good tenants' own repeated prompts
hit their cache (what gives the prefix-cache probe its power) and the grammars' compile time.
Writes soak.json and soak.png under --out and prints a summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from benchmarks.common import save_figure, write_results
from benchmarks.served import free_port, start_server
from benchmarks.soak_clients import SYSTEM_PROMPT, Tally, Traffic, tenant
from benchmarks.soak_connections import RawConnections
from benchmarks.soak_hostile import MAX_REQUEST_BYTES, OPEN_HOSTILE_ADAPTERS, HostileTarget, hostile
from benchmarks.soak_tenants import (
    BASE,
    CAPPED_CONCURRENCY,
    GRAMMAR_SHARE,
    HOSTILE_ADAPTERS,
    HOSTILE_ADDRESS,
    SERVE_ARGS,
    HostileTenant,
    Secrets,
    TenantsSetup,
    auth,
)
from punica.config import ModelConfig
from punica.lora.dummy import save_random_adapter
from punica.models.sources import resolve_model_dir

KEEPALIVE_S = 2.0  # well under the server's header timeout, so a client never sends on a connection it closes
RELOAD_WAIT_S = 60.0
TENANTS = ("tenant-0", "tenant-1", "tenant-2", "tenant-3")


def make_adapters(root: Path, config: ModelConfig, served: list[str], hostile: dict[str, dict]) -> None:
    """Random adapters named `served` under root/served (what the good clients use) and `hostile`
    (name -> what it changes) under root/hostile (what the hostile client loads)."""
    for i, name in enumerate(served):
        save_random_adapter(root / "served" / name, config, rank=8, seed=i, alpha=16)
    for i, (name, change) in enumerate(hostile.items()):
        path = save_random_adapter(root / "hostile" / name, config, rank=4, seed=100 + i, projections=("q", "v"))
        change = dict(change)
        if "weights" in change:
            value, tensors = change.pop("weights"), load_file(path / "adapter_model.safetensors")
            save_file({k: torch.full_like(v, value) for k, v in tensors.items()}, path / "adapter_model.safetensors")
        if change:
            cfg = json.loads((path / "adapter_config.json").read_text()) | change
            (path / "adapter_config.json").write_text(json.dumps(cfg))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def watch(client: httpx.AsyncClient, pid: int, tally: Tally, until: float, sample_s: float,
                series: list[dict], start: float, health_s: float) -> None:
    next_sample = time.monotonic()
    while time.monotonic() < until:
        t = time.monotonic()
        try:
            r = await client.get("/health", timeout=health_s)
            if r.status_code != 200:
                tally.fail(f"/health {r.status_code}")
        except httpx.TimeoutException:
            tally.fail(f"/health did not answer within {health_s} s")
        latency = time.monotonic() - t
        if t >= next_sample:
            series.append({"t_s": t - start, "rss_mb": rss_mb(pid), "health_ms": 1e3 * latency,
                           "normal": tally.normal, "hostile": tally.hostile})
            next_sample += sample_s
        await asyncio.sleep(0.2)


async def reload_midway(client: httpx.AsyncClient, pid: int, setup: TenantsSetup, tally: Tally, reload_at: float,
                        until: float, rng: random.Random, secrets: Secrets) -> dict:
    """At `reload_at`, rewrite the tenants file (a tenant added, a weight changed) and send the server
    SIGHUP; the new tenant's key must be refused before and work after. Then the new tenant sends
    normal traffic until `until`. Returns when the reload applied."""
    await asyncio.sleep(max(0.0, reload_at - time.monotonic()))  # the time of the reload, not synchronization
    headers = auth(setup.late.key)
    before = (await client.get("/v1/models", headers=headers)).status_code
    if before != 401:
        tally.fail(f"reload: the new tenant's key answered {before} before the reload, not 401")
    setup.write_reloaded()
    os.kill(pid, signal.SIGHUP)
    sent_at = time.monotonic()
    while (status := (await client.get("/v1/models", headers=headers)).status_code) != 200:
        if time.monotonic() - sent_at > RELOAD_WAIT_S:
            tally.fail(f"reload: the new tenant's key still answered {status} {RELOAD_WAIT_S:g} s after SIGHUP")
            return {"applied": False}
        await asyncio.sleep(0.1)
    applied_after_s = time.monotonic() - sent_at
    traffic = Traffic(setup.late.adapters + (BASE,), headers, tenant=setup.late.name, secrets=secrets,
                      grammar_share=GRAMMAR_SHARE)
    await tenant(client, rng, tally, until, 0.0, traffic)
    return {"applied": True, "applied_after_s": round(applied_after_s, 3)}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def idle_state(client: httpx.AsyncClient, tally: Tally, headers: dict[str, str]) -> tuple[dict, dict]:
    """Once the last cancelled requests' aborts and steps land: the gauges of what is held (each a
    failure unless 0), and what the KV cache went through."""
    deadline = time.monotonic() + 120
    while True:
        text = (await client.get("/metrics", headers=headers)).text
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
    return gauges, kv_cache


async def soak(args: argparse.Namespace, url: str, port: int, pid: int, root: Path,
               setup: TenantsSetup | None) -> tuple[Tally, list[dict], dict, dict, dict]:
    start = time.monotonic()
    until = start + args.duration
    tally, series, extra = Tally(start if setup is not None else None), [], {}
    limits = httpx.Limits(max_connections=args.tenants * 4 + 8 + CAPPED_CONCURRENCY, keepalive_expiry=KEEPALIVE_S)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        jobs = [watch(client, pid, tally, until, args.sample_s, series, start, args.health_s)]
        if setup is None:
            target = HostileTarget(TENANTS, ("../x", "a" * 300, "", "a b", "ok-name", "tenant-0", "\ud800"),
                                   root / "hostile", tuple(OPEN_HOSTILE_ADAPTERS))
            jobs += [hostile(client, random.Random(args.seed), tally.probe, until, target)]
            jobs += [tenant(client, random.Random(args.seed + 1 + i), tally, until, args.long_share,
                            Traffic(TENANTS + (BASE,))) for i in range(args.tenants)]
            await asyncio.gather(*jobs)
            gauges, kv_cache = await idle_state(client, tally, {})
            return tally, series, gauges, kv_cache, extra
        secrets = Secrets(SYSTEM_PROMPT)
        transport = httpx.AsyncHTTPTransport(local_address=HOSTILE_ADDRESS, limits=httpx.Limits(
            max_connections=64, keepalive_expiry=KEEPALIVE_S))
        async with httpx.AsyncClient(base_url=url, timeout=300, transport=transport) as hostile_client:
            evil = HostileTenant(hostile_client, setup, root / "served", root / "hostile", secrets, tally.probe)
            target = HostileTarget((BASE, "evil-fine"), ("../x", "evil-" + "a" * 300, "", "evil-a b", "evil-ok",
                                                         "good-0-lora", "evil-\ud800"),
                                   root / "hostile", tuple(HOSTILE_ADAPTERS), evil.auth)
            jobs += [hostile(hostile_client, random.Random(args.seed), tally.probe, until, target),
                     evil.probes(random.Random(args.seed + 500), until),
                     evil.flood(random.Random(args.seed + 600), start, until),
                     RawConnections(port, setup.hostile.key, evil.record).connections(until)]
            for i, plan in enumerate(setup.good):
                capped = plan.max_concurrent_requests is not None
                for j in range(plan.max_concurrent_requests or 1):
                    traffic = Traffic(plan.adapters + (BASE,), auth(plan.key), may_cancel=not capped,
                                      tenant=plan.name, secrets=secrets, grammar_share=GRAMMAR_SHARE)
                    jobs.append(tenant(client, random.Random(args.seed + 1 + i + 1000 * j), tally, until,
                                       args.long_share, traffic))
            reload = reload_midway(client, pid, setup, tally, start + args.duration / 2, until,
                                   random.Random(args.seed + 999), secrets)
            results = await asyncio.gather(reload, *jobs)
        gauges, kv_cache = await idle_state(client, tally, auth(setup.admin_key))
        text = (await client.get("/metrics", headers=auth(setup.admin_key))).text
        grammars = {name: metric(text, f"punica_{name}") for name in
                    ("constrained_requests_total", "grammar_compile_seconds_total")}
    flood = tally.probes["flood"]
    if sum(flood.values()) and not flood["429"]:
        tally.fail(f"the flood of {sum(flood.values())} requests past max_concurrent_requests got no 429")
    past_limits = [tally.probes[kind] for kind in ("deep_schema", "huge_schema", "big_choice")]
    if sum(sum(p.values()) for p in past_limits) and not sum(p["400"] for p in past_limits):
        tally.fail("no grammar past the limits got a 400 (each found its tenant at its cap)")
    extra = {"probes": {kind: dict(outcomes) for kind, outcomes in sorted(tally.probes.items())},
             "unexpected_by_kind": dict(tally.unexpected), "ttft": tally.ttft_summary(),
             "prefix_cache_probe": secrets.summary(), "reload": {"at_s": args.duration / 2, **results[0]},
             "grammars": grammars}
    return tally, series, gauges, kv_cache, extra


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
    parser.add_argument("--health-s", type=float, default=1.0,
                        help="seconds /health may take to answer (longer is a failure)")
    parser.add_argument("--long-share", type=float, default=0.0,
                        help="share of normal requests that carry a shared system prompt and ask for 24-96 tokens")
    parser.add_argument("--tenants-file", action="store_true",
                        help="serve a tenants file written here: each client a tenant, the hostile one too, "
                             "probing what tenants must stop; SIGHUP with a changed file halfway")
    parser.add_argument("--serve-args", default="--max-batch-size 16 --max-loras 4 --kv-cache-tokens 16384",
                        help="extra flags of `punica serve`")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        setup = TenantsSetup(root / "tenants.toml", args.tenants) if args.tenants_file else None
        served, hostile_adapters = ((TENANTS, OPEN_HOSTILE_ADAPTERS) if setup is None
                                    else (setup.served_adapters, HOSTILE_ADAPTERS))
        make_adapters(root, ModelConfig.from_dir(resolve_model_dir(None)), list(served), hostile_adapters)
        port = free_port()
        command = [sys.executable, "-m", "punica.cli", "serve", "--port", str(port), "--served-model-name", BASE,
                   "--adapter-dir", str(root / "served"), "--adapter-dir", str(root / "hostile"),
                   "--max-request-bytes", str(MAX_REQUEST_BYTES), *args.serve_args.split()]
        if setup is not None:
            command += ["--tenants", str(setup.path), *SERVE_ARGS]
        server, url = start_server(command, root / "server.log")
        try:
            tally, series, gauges, kv_cache, extra = asyncio.run(soak(args, url, port, server.pid, root, setup))
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
               "health_ms_max": max((s["health_ms"] for s in series), default=None), **extra}
    meta = {"date": time.strftime("%Y-%m-%d"), "duration_s": args.duration, "tenants": args.tenants,
            "long_share": args.long_share, "tenants_file": args.tenants_file,
            "serve_args": args.serve_args, "device": "cpu", "torch": torch.__version__, "summary": summary}
    write_results(args.out, "soak", series, meta)
    if series:
        plot(series, args.out / "soak.png", f"server RSS over a {args.duration / 60:.0f}-minute soak")
    print(json.dumps(summary, indent=2))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
