"""Hostile traffic (hypothesis) at a server beside other tenants' steady requests.

Random mixes of extreme and malformed requests, hostile adapters (huge and NaN weights, extreme
alpha and rank, bad names and paths), oversized and malformed bodies and disconnects run at
once with a fixed set of normal requests: every normal request must finish with exactly the
output it gets on the clean server, every bad one must get a 4xx or its own error (never a
5xx), and /health must answer within a second throughout. Afterwards nothing is left behind:
no request, no KV page, no adapter slot held.
"""

import asyncio
import json
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from punica.config import EngineArgs
from punica.lora.dummy import save_random_adapter
from punica.server.serve import build_state

pytestmark = pytest.mark.slow

MAX_BODY = 64 << 10
# /health must keep answering through the hostile traffic; the bound is loose because a shared CI
# machine's scheduling is no part of what is tested (benchmarks.soak and benchmarks.connections time it).
HEALTH_S = 30.0
MODELS = ["tenant-0", "tenant-1", "tenant-2", "nope"]
NORMAL = [("/v1/completions", {"model": m, "prompt": p, "max_tokens": 6, "temperature": 0})
          for m in ("tenant-0", "tenant-1") for p in ("The weather today is", "My favourite food is")]
NORMAL += [("/v1/chat/completions", {"model": "tenant-2", "max_tokens": 6, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Name a colour."}]})]


def hostile_adapters(root, config) -> dict[str, str]:
    """Adapter directories one tenant could hand the server, each broken in its own way."""
    paths = {}

    def variant(name, weights=None, **cfg):
        path = save_random_adapter(root / name, config, rank=4, seed=len(paths), projections=("q", "v"))
        if weights is not None:
            tensors = load_file(path / "adapter_model.safetensors")
            save_file({k: torch.full_like(v, weights) for k, v in tensors.items()}, path / "adapter_model.safetensors")
        if cfg:
            (path / "adapter_config.json").write_text(json.dumps(
                {**json.loads((path / "adapter_config.json").read_text()), **cfg}))
        paths[name] = str(path)

    variant("fine")
    variant("huge", weights=1e30)
    variant("nan-weights", weights=float("nan"))
    variant("nan-alpha", lora_alpha=float("nan"))
    variant("big-alpha", lora_alpha=1e300)
    variant("rank-512", r=512)
    variant("dora", use_dora=True)
    return paths


@pytest.fixture(scope="module")
def hostile(adapter_dirs, tmp_path_factory):
    from punica.config import ModelConfig
    from punica.models.sources import resolve_model_dir

    root = tmp_path_factory.mktemp("hostile")
    return root, hostile_adapters(root, ModelConfig.from_dir(resolve_model_dir(None)))


@pytest.fixture(scope="module")
def fuzz_server(adapter_dirs, hostile, start_server):
    served, _ = adapter_dirs
    # a context of 512 tokens bounds what a drawn request that happens to be valid costs (a chat with
    # max_completion_tokens 3,736 would take minutes on a CPU); over it, a request is a 400
    state = build_state(EngineArgs(max_batch_size=16, max_loras=3, max_model_len=512), adapters=served)
    state.adapter_dirs = [hostile[0]]
    running = start_server(state, max_request_bytes=MAX_BODY)
    yield running
    running.stop()


def normal_outputs(results) -> list:
    return [r["choices"][0].get("text", r["choices"][0].get("message", {}).get("content")) for r in results]


@pytest.fixture(scope="module")
def clean(fuzz_server):
    """What the normal requests get on the server before any hostile traffic."""
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as client:
        results = [client.post(path, json=body).json() for path, body in NORMAL]
    outputs = normal_outputs(results)
    assert all(outputs), results
    return outputs


def encoded(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as Python writes them


odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([1e-300, 1e-38, 1e-5, 1e300, -1e300, 0.0, -0.0, 2.0, 100.0]))
odd_ints = st.one_of(st.integers(min_value=-(1 << 70), max_value=1 << 70),
                     st.sampled_from([1 << 63, -(1 << 63), 1 << 64, (1 << 64) - 1, 1 << 45, -1, 0, 10 ** 9]))
odd_strings = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "\x00", "x" * 5000]))
json_values = st.recursive(st.none() | st.booleans() | odd_floats | odd_ints | odd_strings,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_strings, inner, max_size=3),
                           max_leaves=6)
SAMPLING_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "max_tokens", "n", "logprobs", "stop", "stop_token_ids", "ignore_eos",
                   "best_of", "echo", "logit_bias", "stream", "tools", "tool_choice", "response_format", "foo"]


@st.composite
def bad_sampling(draw):
    body = {"model": draw(st.sampled_from(MODELS)), "prompt": draw(odd_strings) or "x", "max_tokens": 4}
    for field in draw(st.lists(st.sampled_from(SAMPLING_FIELDS), min_size=1, max_size=4, unique=True)):
        body[field] = draw(st.one_of(odd_floats, odd_ints, json_values))
    return "request", "/v1/completions", encoded(body)


@st.composite
def bad_chat(draw):
    messages = draw(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]), "content": json_values}),
        max_size=3))
    body = {"model": draw(st.sampled_from(MODELS)), "messages": messages,
            draw(st.sampled_from(["max_tokens", "max_completion_tokens"])): draw(st.one_of(odd_ints, json_values))}
    return "request", "/v1/chat/completions", encoded(body)


@st.composite
def malformed(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter"]))
    depth = draw(st.integers(1, 20_000))
    body = draw(st.one_of(st.binary(max_size=300), st.just(b"[" * depth + b"]" * depth),
                          st.just(b'{"model": "tenant-0", "prompt": ' + b"[" * depth + b"]" * depth + b"}"),
                          st.sampled_from([b"", b"null", b"[]", b'"x"', b"1e400", b'{"model": 1}'])))
    return "request", path, body


@st.composite
def oversized(draw):
    size = MAX_BODY + draw(st.integers(1, 4 * MAX_BODY))
    prompt = "word " * (size // 5)
    return "request", "/v1/completions", encoded({"model": "tenant-0", "prompt": prompt, "max_tokens": 2})


@st.composite
def adapter_load(draw, hostile_names):
    name = draw(st.one_of(st.sampled_from(["../x", "a" * 300, "", ".hidden", "a b", "tenant-0", "ok"]), odd_strings))
    path = draw(st.one_of(st.sampled_from(hostile_names), st.sampled_from(["/etc", "/nonexistent", "a\x00b"]),
                          odd_strings))
    return "load", name, path


@st.composite
def disconnect(draw):
    body = {"model": draw(st.sampled_from(MODELS[:3])), "prompt": "Count to a hundred:", "max_tokens": 400,
            "ignore_eos": True, "stream": draw(st.booleans())}
    return "disconnect", "/v1/completions", encoded(body)


def actions(hostile_names):
    return st.lists(st.one_of(bad_sampling(), bad_chat(), malformed(), oversized(), adapter_load(hostile_names),
                              disconnect()), min_size=1, max_size=5)


async def run_action(client: httpx.AsyncClient, hostile_dir, action) -> tuple[str, int, bytes]:
    kind, target, payload = action
    if kind == "load":
        path = payload if payload.startswith("/") or "\x00" in payload else str(hostile_dir / payload)
        headers = {"content-type": "application/json"}
        r = await client.post("/v1/load_lora_adapter", headers=headers,
                              content=encoded({"lora_name": target, "lora_path": path}))
        if r.status_code == 200:  # served now: a request on it gets its own output or error
            r2 = await client.post("/v1/completions", json={"model": target, "prompt": "Hi", "max_tokens": 3})
            await client.post("/v1/unload_lora_adapter", json={"lora_name": target})
            return kind, r2.status_code, r2.content
        return kind, r.status_code, r.content
    headers = {"content-type": "application/json"}
    if kind == "disconnect":
        try:
            async with client.stream("POST", target, content=payload, headers=headers, timeout=0.3) as r:
                async for _ in r.aiter_bytes():
                    break
        except httpx.TimeoutException:
            pass
        return kind, 0, b""
    r = await client.post(target, content=payload, headers=headers)
    return kind, r.status_code, r.content


def check_bad(kind: str, status: int, content: bytes) -> None:
    if kind == "disconnect":
        return
    assert status < 500, (kind, status, content[:300])
    if status == 200:
        for line in content.decode().splitlines() or [""]:
            if line.startswith("data: {") or content.startswith(b"{"):
                body = json.loads(line[6:] if line.startswith("data: ") else content)
                assert "error" not in body or body["error"]["type"] != "server_error", body
                for choice in body.get("choices", []):
                    assert choice.get("finish_reason") in (None, "stop", "length", "error"), choice
                if content.startswith(b"{"):
                    break
    else:
        assert json.loads(content)["error"]["message"], content[:300]


async def health_pings(client: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        r = await client.get("/health", timeout=HEALTH_S)
        assert r.status_code == 200
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_hostile_traffic_changes_nothing_for_other_tenants(fuzz_server, clean, hostile, data):
    hostile_dir, paths = hostile
    mix = data.draw(actions(sorted(paths)))

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=fuzz_server.url, timeout=120, limits=limits) as client:
            stop, latencies = asyncio.Event(), []
            pinger = asyncio.ensure_future(health_pings(client, stop, latencies))
            normal = [asyncio.ensure_future(client.post(path, json=body)) for path, body in NORMAL]
            bad = await asyncio.gather(*(run_action(client, hostile_dir, a) for a in mix))
            normal = await asyncio.gather(*normal)
            stop.set()
            await pinger
            return normal, bad, latencies

    normal, bad, latencies = asyncio.run(run())
    assert [r.status_code for r in normal] == [200] * len(NORMAL), [r.text for r in normal]
    assert normal_outputs([r.json() for r in normal]) == clean
    for kind, status, content in bad:
        check_bad(kind, status, content)
    assert latencies, "/health was never answered"
    fuzz_server.wait_idle()  # the disconnected requests' aborts reach the engine
    stats, engine = fuzz_server.engine.stats(), fuzz_server.engine
    assert not engine.has_unfinished() and stats.num_kv_pages_used == 0, stats
    assert not engine.adapters.refs, "an adapter slot is still held"
