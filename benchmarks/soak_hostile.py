"""The soak's hostile client (benchmarks.soak): extreme and malformed sampling values, unknown fields,
lone surrogates, malformed and oversized bodies, loads of broken adapters, bad names and paths, dropped
streams; and the hostile adapters of the open soak (no tenants file)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MAX_REQUEST_BYTES = 256 << 10
HOSTILE_BODIES = [
    {"temperature": 1e-300}, {"temperature": float("nan")}, {"seed": 1 << 70}, {"seed": -(1 << 64)},
    {"repetition_penalty": 1e-300, "temperature": 1.0}, {"top_p": 0}, {"top_k": -7}, {"max_tokens": 0},
    {"max_tokens": -1}, {"n": 10 ** 6}, {"logprobs": 99}, {"stop": ["x"] * 1000}, {"foo": "bar"},
    {"tool_choice": "required"}, {"logit_bias": {"5": 100}}, {"prompt": "\ud800"}, {"prompt": [10 ** 9]},
    {"model": "../etc/passwd"}, {"stream": "yes"}, {"frequency_penalty": float("inf")},
]
# the open soak's hostile adapters: what each changes in a random adapter
OPEN_HOSTILE_ADAPTERS = {"huge": dict(weights=1e30), "nan-weights": dict(weights=float("nan")),
                         "nan-alpha": dict(lora_alpha=float("nan")), "big-alpha": dict(lora_alpha=1e300),
                         "rank-512": dict(r=512), "dora": dict(use_dora=True), "fine": {}}

# records a hostile request: its kind, its outcome (a status) and, when it was wrong, the problem
Probe = Callable[[str, object, str | None], None]


@dataclass(frozen=True)
class HostileTarget:
    """What the hostile client's traffic names: its models, the names it loads adapters under, the
    folder of adapters it loads from and their names, and its key's header."""
    models: tuple[str, ...]
    load_names: tuple[str, ...]
    adapter_dir: Path
    adapters: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)


async def hostile(client: httpx.AsyncClient, rng: random.Random, probe: Probe, until: float,
                  target: HostileTarget) -> None:
    """Malformed, extreme and oversized requests, broken adapters, dropped streams: none answered 5xx.
    Each request's kind and status go to `probe`, with the problem when it was answered 5xx."""
    headers = {"content-type": "application/json"} | target.headers
    while time.monotonic() < until:
        choice = rng.randrange(6)
        if choice == 0:
            body = {"model": rng.choice(target.models), "prompt": "Hi", "max_tokens": 4} | rng.choice(HOSTILE_BODIES)
            kind, path, content = "sampling_values", "/v1/completions", json.dumps(body).encode()
        elif choice == 1:
            kind, path, content = "chat_messages", "/v1/chat/completions", json.dumps({
                "model": target.models[0], "messages": [{"role": rng.choice(["user", "wizard"]),
                                                         "content": rng.choice(["\ud800", [{"type": "image"}], 5])}],
                "max_completion_tokens": rng.choice([0, -3, 4])}).encode()
        elif choice == 2:
            kind, path = "malformed_body", "/v1/completions"
            content = rng.choice([b"{not json", b"[" * 50_000 + b"]" * 50_000, b"", b"null",
                                  bytes(rng.randrange(256) for _ in range(200))])
        elif choice == 3:
            prompt = "word " * (MAX_REQUEST_BYTES // 5 + rng.randrange(1000))
            kind, path = "oversized_body", "/v1/completions"
            content = json.dumps({"model": target.models[1], "prompt": prompt}).encode()
        elif choice == 4:
            name = rng.choice(target.load_names)
            folder = rng.choice([str(target.adapter_dir / rng.choice(target.adapters)), "/etc", "a\x00b"])
            kind, path = "adapter_load", "/v1/load_lora_adapter"
            content = json.dumps({"lora_name": name, "lora_path": folder}).encode()
        else:
            body = {"model": rng.choice(target.models), "prompt": "Count:", "max_tokens": 300, "stream": True}
            try:
                async with client.stream("POST", "/v1/completions", json=body, headers=target.headers,
                                         timeout=0.5) as r:
                    async for _ in r.aiter_bytes():
                        break
            except httpx.TimeoutException:
                pass
            continue
        r = await client.post(path, content=content, headers=headers)
        probe(kind, r.status_code, f"answered {r.status_code}: {r.text[:200]}" if r.status_code >= 500 else None)
        if path == "/v1/load_lora_adapter" and r.status_code == 200:  # "fine": it really was fine
            await client.post("/v1/unload_lora_adapter", json={"lora_name": json.loads(content)["lora_name"]},
                              headers=target.headers)
