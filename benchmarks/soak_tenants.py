"""The tenants mode of benchmarks.soak (`--tenants-file`): the tenants file the server starts with,
and a hostile tenant that tries everything the tenants feature must stop.

Every client is a tenant with a key of its own: the good tenants `good-0`, `good-1`, ... each with an
adapter (`good-N-lora`; `good-0` also with a max_concurrent_requests its client never goes over),
and `hostile`, with a folder of adapters of its own (`evil-*`, some broken). Halfway through, the
file is rewritten (the tenant `late` added, `good-1`'s weight changed) and the server is sent SIGHUP;
`late` then sends normal traffic too.

The hostile tenant sends, besides the open soak's hostile traffic (with its own key and models),
probes that each have an expected answer (EXPECTED; any other is a failure, counted by kind):
another tenant's adapter, loads and unloads of its names and from its folders, the admin's
endpoints, no key and wrong keys, JSON schemas and `choice` lists past the grammar limits (and a
costly one within them), bad `cache_salt`s, its /v1/models listing, and the exact prompts the good
tenants sent on the base model (their `cached_tokens` must be 0: the prefix cache is private). It
floods past its max_concurrent_requests in the second half of every FLOOD_PERIOD_S, and, from an
address of its own, holds connections the ways a slowloris does (benchmarks.soak_connections): idle
ones past its per-client cap, a head that never ends, a body shorter than its Content-Length.
"""

from __future__ import annotations

import asyncio
import secrets
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from punica.server.tenants import hash_key

BASE = "base"  # --served-model-name
HOSTILE_ADDRESS = "127.0.0.2"  # the hostile tenant's HTTP requests (the good tenants' come from 127.0.0.1)
MAX_CONNECTIONS_PER_CLIENT = 64
HEADER_TIMEOUT_S = 6.0  # over httpx's keep-alive expiry (5 s): a client never sends on a connection the server closes
BODY_TIMEOUT_S = 3.0
MAX_GRAMMAR_CHARS = 1 << 16
MAX_GRAMMAR_DEPTH = 64
CAPPED_CONCURRENCY = 2  # good-0's max_concurrent_requests, and the requests its client keeps in flight
HOSTILE_MAX_CONCURRENT = 4
HOSTILE_MAX_KV_TOKENS = 2048
FLOOD_CONCURRENCY = 16  # 4x the hostile tenant's max_concurrent_requests; half of them send costly schemas
FLOOD_PERIOD_S = 20.0   # the flood runs in the second half of every period
SECRET_SHARE = 0.15     # of a good tenant's requests: a long prompt on the base model, for the prefix-cache probe
GRAMMAR_SHARE = 0.1     # of a good tenant's other requests: a small JSON schema never sent before (compiled)
SERVE_ARGS = ["--max-connections-per-client", str(MAX_CONNECTIONS_PER_CLIENT), "--header-timeout",
              str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--max-grammar-chars",
              str(MAX_GRAMMAR_CHARS), "--max-grammar-depth", str(MAX_GRAMMAR_DEPTH)]
# the hostile tenant's adapters: what each changes in a random adapter (applied by benchmarks.soak)
HOSTILE_ADAPTERS = {"evil-huge": dict(weights=1e30), "evil-nan-weights": dict(weights=float("nan")),
                    "evil-nan-alpha": dict(lora_alpha=float("nan")), "evil-big-alpha": dict(lora_alpha=1e300),
                    "evil-rank-512": dict(r=512), "evil-dora": dict(use_dora=True), "evil-fine": {}}

# the statuses each probe kind of the hostile tenant must get ("closed": the server closed the
# connection without an answer); any other outcome is a failure
EXPECTED = {
    "other_adapter": {404},         # another tenant's adapter: as if it did not exist (model_not_found)
    "load_other_name": {403},       # loading under another tenant's name
    "unload_other_name": {403},
    "load_other_folder": {403},     # loading another tenant's folder under a name of its own
    "admin_endpoint": {403},        # /metrics, /v1/adapters
    "no_key": {401},
    "wrong_key": {401},
    "models_listing": {200},        # with only the base model and its own adapters in it
    # a completion finds the tenant at its max_concurrent_requests whenever the flood is on: a 429,
    # answered before the request's prompt or grammar is looked at
    "deep_schema": {400, 429},      # past --max-grammar-depth
    "huge_schema": {400, 429},      # past --max-grammar-chars
    "big_choice": {400, 429},       # past --max-grammar-chars
    "costly_schema": {200, 400, 429},  # within the limits: compiled, or a 400 at --max-grammar-compile-seconds
    "bad_cache_salt": {400},
    "prefix_probe": {200, 429},     # 200 with cached_tokens 0 for a good tenant's exact prompt
    "flood": {200, 429},            # past its max_concurrent_requests: 429
    "flood_grammar": {200, 400, 429},  # the same, each with a costly schema of its own
    "idle_connections": {"closed", 503},  # closed at the header timeout, or for a newer one past the cap
    "slowloris": {"closed"},        # a head that never ends: closed at the header timeout
    "short_body": {408},            # a body shorter than its Content-Length
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class TenantPlan:
    """One tenant of the generated file."""
    name: str
    glob: str                      # of the adapters it may use, load and unload
    adapters: tuple[str, ...]      # those served for it
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    max_kv_tokens: int | None = None

    def toml(self) -> str:
        lines = [f"[tenants.{self.name}]", f'api_keys = ["{hash_key(self.key)}"]', f'adapters = ["{self.glob}"]',
                 f"weight = {self.weight}"]
        lines += [f"{cap} = {value}" for cap, value in (("max_concurrent_requests", self.max_concurrent_requests),
                                                        ("max_kv_tokens", self.max_kv_tokens)) if value is not None]
        return "\n".join(lines) + "\n"


class TenantsSetup:
    """The tenants of a soak of `num_good` good clients, and its tenants file at `path`."""

    def __init__(self, path: Path, num_good: int):
        self.path = path
        self.admin_key = secrets.token_hex(16)
        self.good = [TenantPlan(f"good-{i}", f"good-{i}-*", (f"good-{i}-lora",), weight=2.0 if i == 1 else 1.0,
                                max_concurrent_requests=CAPPED_CONCURRENCY if i == 0 else None)
                     for i in range(num_good)]
        self.late = TenantPlan("late", "late-*", ("late-lora",))  # in the file from the reload on
        self.hostile = TenantPlan("hostile", "evil-*", tuple(HOSTILE_ADAPTERS),
                                  max_concurrent_requests=HOSTILE_MAX_CONCURRENT, max_kv_tokens=HOSTILE_MAX_KV_TOKENS)
        self.write(self.good)

    @property
    def served_adapters(self) -> list[str]:
        """The good tenants' adapters and `late`'s (served from the start, for the admin alone until the reload)."""
        return [a for plan in self.good + [self.late] for a in plan.adapters]

    def write(self, good: list[TenantPlan]) -> None:
        text = f'[admin]\napi_keys = ["{hash_key(self.admin_key)}"]\n\n'
        self.path.write_text(text + "\n".join(plan.toml() for plan in good + [self.hostile]))

    def write_reloaded(self) -> None:
        """The file of the reload: `late` added, good-1's weight changed."""
        good = [replace(plan, weight=3.0) if plan.name == "good-1" else plan for plan in self.good]
        self.write(good + [self.late])


class Secrets:
    """The good tenants' long prompts on the base model, which the hostile tenant sends again to probe
    the prefix cache: each good tenant sends each of its prompts twice (the second should hit its own
    cache: the probe's control), and the hostile tenant probes each once (a second probe would hit
    its own cache)."""

    def __init__(self, system_prompt: str):
        self.system_prompt = system_prompt
        self.unprobed: list[str] = []
        self.num_control_hits = self.num_control_misses = 0
        self._next: dict[str, int] = {}
        self._repeat: dict[str, str] = {}

    def next_prompt(self, tenant: str) -> tuple[str, bool]:
        """The tenant's next prompt, and whether it is the second time it sends it."""
        if tenant in self._repeat:
            return self._repeat.pop(tenant), True
        number = self._next[tenant] = self._next.get(tenant, 0) + 1
        return f"{tenant} ticket {number}: {self.system_prompt}", False

    def sent(self, tenant: str, prompt: str, repeat: bool, cached_tokens: int) -> None:
        if repeat:
            if cached_tokens:
                self.num_control_hits += 1
            else:
                self.num_control_misses += 1
        else:
            self._repeat[tenant] = prompt
            self.unprobed.append(prompt)

    def summary(self) -> dict:
        return {"good_prompts_not_probed": len(self.unprobed), "control_hits": self.num_control_hits,
                "control_misses": self.num_control_misses}


def flood_on(start: float, t: float) -> bool:
    """Whether the hostile tenant floods at time t of a soak that started at `start`."""
    return (t - start) % FLOOD_PERIOD_S >= FLOOD_PERIOD_S / 2


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _object_schema(num_properties: int, salt: str) -> dict:
    """An object of `num_properties` properties named after `salt`: each a new grammar to compile."""
    props = {f"{salt}_{i}": {"type": ("string", "integer", "boolean")[i % 3]} for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props)[::2]}


def small_schema(rng) -> dict:
    """A good tenant's JSON schema, one never sent before (its compile is not in the cache)."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {f"answer_{rng.randrange(1 << 40)}": {"type": "string"}}}}}


class HostileTenant:
    """The hostile tenant's HTTP probes and flood (its raw connections: benchmarks.soak_connections).
    `record(kind, outcome, problem)` counts one probe and its outcome, a failure when `problem` is not None."""

    def __init__(self, client: httpx.AsyncClient, setup: TenantsSetup, served_dir: Path, hostile_dir: Path,
                 secret_prompts: Secrets, record: Callable[[str, object, str | None], None]):
        self.client, self.setup = client, setup
        self.served_dir, self.hostile_dir = served_dir, hostile_dir
        self.secrets, self._record = secret_prompts, record
        self.auth = auth(setup.hostile.key)

    def record(self, kind: str, outcome, problem: str | None = None) -> None:
        if problem is None and outcome not in EXPECTED[kind]:
            problem = f"expected {sorted(map(str, EXPECTED[kind]))}, got {outcome}"
        self._record(kind, outcome, problem)

    def check(self, kind: str, r: httpx.Response, problem: str | None = None) -> None:
        if r.status_code not in EXPECTED[kind]:
            problem = f"expected {sorted(EXPECTED[kind])}, got {r.status_code}: {r.text[:200]}"
        self.record(kind, r.status_code, problem)

    # HTTP probes ------------------------------------------------------------------------------
    async def probes(self, rng, until: float) -> None:
        kinds = [k for k in EXPECTED if hasattr(self, k) and k != "flood"]
        while time.monotonic() < until:
            kind = rng.choice(kinds)
            await getattr(self, kind)(rng)

    def _good_adapter(self, rng) -> str:
        return rng.choice(self.setup.served_adapters)

    async def _completion(self, body: dict, headers: dict | None = None) -> httpx.Response:
        body = {"model": BASE, "prompt": "Hi", "max_tokens": 4} | body
        return await self.client.post("/v1/completions", json=body, headers=self.auth if headers is None else headers)

    async def other_adapter(self, rng) -> None:
        r = await self._completion({"model": self._good_adapter(rng)})
        problem = None
        if r.status_code == 404 and r.json()["error"]["code"] != "model_not_found":
            problem = f"404 with code {r.json()['error']['code']!r}, not 'model_not_found'"
        self.check("other_adapter", r, problem)

    async def load_other_name(self, rng) -> None:
        name = rng.choice([self._good_adapter(rng), f"good-{rng.randrange(len(self.setup.good))}-new"])
        r = await self.client.post("/v1/load_lora_adapter", headers=self.auth,
                                   json={"lora_name": name, "lora_path": str(self.hostile_dir / "evil-fine")})
        self.check("load_other_name", r)

    async def unload_other_name(self, rng) -> None:
        r = await self.client.post("/v1/unload_lora_adapter", json={"lora_name": self._good_adapter(rng)},
                                   headers=self.auth)
        self.check("unload_other_name", r)

    async def load_other_folder(self, rng) -> None:
        path = self.served_dir / self._good_adapter(rng)
        r = await self.client.post("/v1/load_lora_adapter", headers=self.auth,
                                   json={"lora_name": f"evil-copy-{rng.randrange(1000)}", "lora_path": str(path)})
        self.check("load_other_folder", r)

    async def admin_endpoint(self, rng) -> None:
        self.check("admin_endpoint", await self.client.get(rng.choice(["/metrics", "/v1/adapters"]), headers=self.auth))

    async def _any_endpoint(self, rng, headers: dict) -> httpx.Response:
        which = rng.randrange(4)
        if which == 0:
            return await self.client.get("/v1/models", headers=headers)
        if which == 1:
            return await self._completion({}, headers)
        if which == 2:
            return await self.client.get("/metrics", headers=headers)
        return await self.client.post("/v1/unload_lora_adapter", json={"lora_name": self._good_adapter(rng)},
                                      headers=headers)

    async def no_key(self, rng) -> None:
        self.check("no_key", await self._any_endpoint(rng, {}))

    async def wrong_key(self, rng) -> None:
        good = rng.choice(self.setup.good)
        # a made-up key, a good key's stored hash presented as the key, a good key with a byte changed
        key = rng.choice([secrets.token_hex(16), hash_key(good.key), good.key[:-1] + chr(ord(good.key[-1]) ^ 1)])
        self.check("wrong_key", await self._any_endpoint(rng, auth(key)))

    async def models_listing(self, rng) -> None:
        r = await self.client.get("/v1/models", headers=self.auth)
        problem = None
        if r.status_code == 200:
            foreign = [m["id"] for m in r.json()["data"] if m["id"] != BASE and not m["id"].startswith("evil-")]
            paths = [m["id"] for m in r.json()["data"] if m["id"] != BASE and "root" in m]
            if foreign or paths:
                problem = f"/v1/models lists another tenant's adapters {foreign} or the paths of {paths}"
        self.check("models_listing", r, problem)

    async def _constrained(self, kind: str, constraint: dict) -> None:
        self.check(kind, await self._completion({"max_tokens": 8} | constraint))

    async def deep_schema(self, rng) -> None:
        schema = _nested_arrays(MAX_GRAMMAR_DEPTH + rng.randint(1, 200))
        await self._constrained("deep_schema", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": schema}}})

    async def huge_schema(self, rng) -> None:
        schema = _object_schema(MAX_GRAMMAR_CHARS // 20 + rng.randrange(2000), secrets.token_hex(4))
        await self._constrained("huge_schema", {"guided_json": schema})

    async def big_choice(self, rng) -> None:
        num = MAX_GRAMMAR_CHARS // 12 + rng.randrange(2000)
        choices = ["".join(rng.choices(string.ascii_letters, k=12)) for _ in range(num)]
        await self._constrained("big_choice", {"structured_outputs": {"choice": choices}})

    async def costly_schema(self, rng, kind: str = "costly_schema") -> None:
        # ~48 characters a property: up to ~1,300 properties, ~1 s to compile on a CPU core
        schema = _object_schema(rng.randint(200, MAX_GRAMMAR_CHARS // 50), secrets.token_hex(4))
        await self._constrained(kind, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "costly", "schema": schema}}})

    async def bad_cache_salt(self, rng) -> None:
        salt = rng.choice(["", "s" * 257, 5, ["salt"], {"salt": 1}])
        self.check("bad_cache_salt", await self._completion({"cache_salt": salt}))

    async def prefix_probe(self, rng) -> None:
        if not self.secrets.unprobed:
            return
        prompt = self.secrets.unprobed.pop(rng.randrange(len(self.secrets.unprobed)))
        r = await self._completion({"prompt": prompt, "max_tokens": 1, "temperature": 0})
        problem = None
        if r.status_code == 429:  # not looked up in the cache: probed again later
            self.secrets.unprobed.append(prompt)
        elif r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]:
            problem = (f"cached_tokens {r.json()['usage']['prompt_tokens_details']['cached_tokens']} for a good "
                       f"tenant's prompt {prompt[:30]!r}...: the prefix cache leaks across tenants")
        self.check("prefix_probe", r, problem)

    # the flood ----------------------------------------------------------------------------------
    async def flood(self, rng, start: float, until: float) -> None:
        await asyncio.gather(*(self._flood_worker(rng, start, until, grammar=i % 2 == 1)
                               for i in range(FLOOD_CONCURRENCY)))

    async def _flood_worker(self, rng, start: float, until: float, grammar: bool) -> None:
        while time.monotonic() < until:
            if not flood_on(start, time.monotonic()):
                await asyncio.sleep(0.2)  # pacing until the next flood window, not synchronization
            elif grammar:
                await self.costly_schema(rng, "flood_grammar")
            else:
                self.check("flood", await self._completion({"max_tokens": 24, "ignore_eos": True}))
