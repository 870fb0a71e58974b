"""The soak's normal clients (benchmarks.soak): completions and chat, streamed or not, some cancelled
midway, some with a long shared system prompt, and with --tenants-file a tenant's own long prompts on
the base model and small JSON schemas; and the Tally of what the soak saw, which every client of it
records into."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

from benchmarks.common import percentile
from benchmarks.soak_tenants import BASE, SECRET_SHARE, Secrets, flood_on, small_schema

PROMPTS = ("The weather today is", "Tell me a story about", "def fibonacci(n):", "My favourite food is")
# the system prompt of --long-share's requests: every tenant's long requests share it, so their
# prompts hit the prefix cache, and their long outputs outgrow a tiny KV cache (preemption)
SYSTEM_PROMPT = ("You are the support assistant of a company that rents bicycles in three cities. Answer in "
                 "plain words, at most two short paragraphs. Never promise refunds; say that a person will "
                 "look at the case within two working days. If the question is not about bicycles, rentals, "
                 "opening hours or prices, say politely that you can only help with those.")


class Tally:
    """What the soak saw: normal requests, the hostile ones by kind and outcome, failures, the normal
    clients' times to first token (with the flood on or off, when the soak started at `flood_start`)."""

    def __init__(self, flood_start: float | None = None):
        self.normal = self.cancelled = self.hostile = 0
        self.failures: list[str] = []
        self.probes: defaultdict[str, Counter] = defaultdict(Counter)
        self.unexpected: Counter = Counter()
        self.flood_start = flood_start
        self.ttft_s: defaultdict[str, list[float]] = defaultdict(list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(what)

    def probe(self, kind: str, outcome, problem: str | None = None) -> None:
        """A hostile request of `kind` and its outcome (a status), a failure when `problem` is given."""
        self.hostile += 1
        self.probes[kind][str(outcome)] += 1
        if problem is not None:
            self.unexpected[kind] += 1
            self.fail(f"hostile {kind}: {problem}")

    def ttft(self, sent_at: float, seconds: float, constrained: bool) -> None:
        flooding = self.flood_start is not None and flood_on(self.flood_start, sent_at)
        name = ("constrained_" if constrained else "") + ("with_flood" if flooding else "without_flood")
        self.ttft_s[name].append(seconds)

    def ttft_summary(self) -> dict:
        return {name: {"requests": len(values), **{f"p{q}_s": round(percentile(values, q / 100), 3)
                                                   for q in (50, 90, 99)}}
                for name, values in sorted(self.ttft_s.items())}


@dataclass
class Traffic:
    """What one normal client sends: the models it names, its key's header, whether it cancels
    requests, and (with --tenants-file) its tenant and the Secrets its long base-model prompts go to."""
    models: tuple[str, ...]
    headers: dict[str, str] = field(default_factory=dict)
    may_cancel: bool = True
    tenant: str | None = None
    secrets: Secrets | None = None
    grammar_share: float = 0.0  # of its requests with a JSON schema never sent before


def check_finish(tally: Tally, what: str, reasons: list, tokens: int, max_tokens: int) -> None:
    if reasons not in (["stop"], ["length"]) or not 1 <= tokens <= max_tokens:
        tally.fail(f"{what}: finish {reasons}, {tokens} of {max_tokens} tokens")


async def secret_request(client: httpx.AsyncClient, traffic: Traffic, tally: Tally) -> None:
    """A long prompt of the tenant's own on the base model, which the hostile tenant probes the prefix cache with."""
    prompt, repeat = traffic.secrets.next_prompt(traffic.tenant)
    body = {"model": BASE, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    try:
        r = await client.post("/v1/completions", json=body, headers=traffic.headers)
    except httpx.HTTPError as e:
        tally.fail(f"/v1/completions {traffic.tenant} {type(e).__name__}: {e}")
        return
    if r.status_code != 200:
        tally.fail(f"/v1/completions {traffic.tenant} {r.status_code} {r.text[:200]}")
        return
    usage = r.json()["usage"]
    check_finish(tally, f"/v1/completions {traffic.tenant}", [c["finish_reason"] for c in r.json()["choices"]],
                 usage["completion_tokens"], 4)
    traffic.secrets.sent(traffic.tenant, prompt, repeat, usage["prompt_tokens_details"]["cached_tokens"])
    tally.normal += 1


async def tenant(client: httpx.AsyncClient, rng: random.Random, tally: Tally, until: float,
                 long_share: float, traffic: Traffic) -> None:
    while time.monotonic() < until:
        if traffic.secrets is not None and rng.random() < SECRET_SHARE:
            await secret_request(client, traffic, tally)
            continue
        long = long_share > 0 and rng.random() < long_share  # 0 draws nothing: the default traffic is the same
        model, max_tokens = rng.choice(traffic.models), rng.randint(24, 96) if long else rng.randint(1, 12)
        chat, stream, cancel = rng.random() < 0.3, rng.random() < 0.5, rng.random() < 0.15
        cancel = cancel and traffic.may_cancel
        body = {"model": model, "max_tokens": 400 if cancel else max_tokens, "temperature": rng.choice([0, 0.8]),
                "stream": stream}
        constrained = traffic.grammar_share > 0 and rng.random() < traffic.grammar_share
        if constrained:
            body["response_format"] = small_schema(rng)
        if chat:
            system = [{"role": "system", "content": SYSTEM_PROMPT}] if long else []
            path, body["messages"] = "/v1/chat/completions", system + [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            path, body["prompt"] = "/v1/completions", (SYSTEM_PROMPT + "\n\n" if long else "") + rng.choice(PROMPTS)
        try:
            if cancel:
                tally.cancelled += 1
                await asyncio.wait_for(client.post(path, json=body, headers=traffic.headers),
                                       timeout=rng.uniform(0.05, 1.0))
                continue
            reasons, tokens = [], 0
            if stream:
                body["stream_options"] = {"include_usage": True}
                sent_at = time.monotonic()
                async with client.stream("POST", path, json=body, headers=traffic.headers) as r:
                    if r.status_code != 200:
                        tally.fail(f"{path} {r.status_code}")
                        continue
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            if sent_at is not None:
                                tally.ttft(sent_at, time.monotonic() - sent_at, constrained)
                                sent_at = None
                            chunk = json.loads(line[6:])
                            reasons += [c["finish_reason"] for c in chunk.get("choices", []) if c["finish_reason"]]
                            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            else:
                r = await client.post(path, json=body, headers=traffic.headers)
                if r.status_code != 200:
                    tally.fail(f"{path} {r.status_code} {r.text[:200]}")
                    continue
                reasons = [c["finish_reason"] for c in r.json()["choices"]]
                tokens = r.json()["usage"]["completion_tokens"]
            check_finish(tally, f"{path} {model}", reasons, tokens, max_tokens)
            tally.normal += 1
        except asyncio.TimeoutError:
            if not cancel:
                tally.fail(f"{path} timed out")
        except httpx.HTTPError as e:
            tally.fail(f"{path} {type(e).__name__}: {e}")
