"""Adapter residency for routers: GET /v1/adapters, the fields /v1/models adds, the punica_adapter_*
series, on a server with more adapters than GPU slots and than its host tier holds."""

import asyncio

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from punica.config import EngineArgs, ModelConfig
from punica.lora.pool import LoraPool
from punica.models.sources import resolve_model_dir
from punica.server import app
from punica.server.serve import build_state

# requests one after the other; 2 GPU slots and 3 host rows, both LRU (see the comments of the test)
ORDER = ["tenant-0", "tenant-1", "tenant-0", "tenant-2", "extra-0", "tenant-1", "tenant-0"]
EXPECTED = {  # name: (tier, slot, loads, evictions, hits, misses)
    "tenant-0": ("gpu", 0, {"host": 2, "gpu": 2}, {"host": 1, "gpu": 1}, 1, 2),
    "tenant-1": ("gpu", 1, {"host": 1, "gpu": 2}, {"host": 0, "gpu": 1}, 0, 2),
    "tenant-2": ("disk", None, {"host": 1, "gpu": 1}, {"host": 1, "gpu": 1}, 0, 1),
    "extra-0": ("host", None, {"host": 1, "gpu": 1}, {"host": 0, "gpu": 1}, 0, 1),
    "extra-1": ("disk", None, {"host": 0, "gpu": 0}, {"host": 0, "gpu": 0}, 0, 0),  # registered, never asked for
}


@pytest.fixture(scope="module")
def residency_server(adapter_dirs, start_server):
    served, loadable = adapter_dirs
    row_bytes = LoraPool(ModelConfig.from_dir(resolve_model_dir(None)), 1, 8, torch.float32, "cpu").slot_numel * 4
    adapters = served | {name: str(loadable / name) for name in ("extra-0", "extra-1")}
    state = build_state(EngineArgs(max_batch_size=4, max_loras=2, max_lora_rank=8, lora_host_bytes=3 * row_bytes),
                        adapters=adapters)
    running = start_server(state)
    yield running, row_bytes
    running.stop()


@pytest.mark.slow
def test_tiers_and_counters_are_what_happened(residency_server):
    server, row_bytes = residency_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    # slots: t0, t1 | t0 hit | t2 evicts t1 from its slot | e0 takes t0's host row, then its slot (t0: disk)
    # | t1 from the host tier evicts t2's slot | t0 read again into t2's host row (t2: disk), e0's slot
    for name in ORDER:
        client.completions.create(model=name, prompt="Hi", max_tokens=1)
    listing = httpx.get(server.url + "/v1/adapters").json()
    assert listing["gpu_slots"] == {"total": 2, "used": 2, "held": 0}
    assert listing["host_tier"] == {"adapters": 3, "bytes_used": 3 * row_bytes, "bytes_limit": 3 * row_bytes}
    entries = {a["id"]: a for a in listing["data"]}
    got = {name: (a["tier"], a["slot"], a["loads"], a["evictions"], a["hits"], a["misses"])
           for name, a in entries.items()}
    assert got == EXPECTED
    assert all(a["loading"] is None and a["error"] is None and not a["pinned"] for a in entries.values())
    t0 = entries["tenant-0"]
    assert t0["load_seconds"]["host"] > t0["last_load_seconds"]["host"] > 0

    models = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert set(models) == {server.state.base_model_name, *EXPECTED}
    for name, entry in entries.items():  # the OpenAI fields, and the listing's besides its id, object and path
        assert models[name] == {"id": name, "object": "model", "created": models[name]["created"],
                                "owned_by": "punica", "root": entry["path"], "parent": server.state.base_model_name,
                                **{k: v for k, v in entry.items() if k not in ("id", "object", "path")}}
    assert [m.id for m in client.models.list().data] == list(models)  # the official client reads them

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}

    def value(family, **labels):
        [sample] = [s for s in families[family].samples if s.labels == labels and not s.name.endswith("_created")]
        return sample.value

    assert not [s for f in families.values() for s in f.samples if s.labels.get("adapter") == "extra-1"], \
        "an adapter never read has no series"
    for name, (tier, _, loads, evictions, hits, misses) in EXPECTED.items():
        if name == "extra-1":
            continue
        assert [value("punica_adapter_tier", adapter=name, tier=t) for t in ("gpu", "host", "disk")] == [
            float(tier == t) for t in ("gpu", "host", "disk")]
        for t in ("host", "gpu"):
            assert value("punica_adapter_loads", adapter=name, tier=t) == loads[t]
            assert value("punica_adapter_evictions", adapter=name, tier=t) == evictions[t]
            assert value("punica_adapter_load_seconds", adapter=name, tier=t) == pytest.approx(
                entries[name]["load_seconds"][t])
        assert (value("punica_adapter_hits", adapter=name), value("punica_adapter_misses", adapter=name)) == (
            hits, misses)
    assert value("punica_lora_host_tier_bytes_limit") == value("punica_lora_host_tier_bytes_used") == 3 * row_bytes


def test_metrics_answer_when_the_engine_does_not_report(stub_state, tokenizer, start_server, monkeypatch):
    monkeypatch.setattr(app, "RESIDENCY_WAIT_S", 0.05)
    state = stub_state(tokenizer, adapters={"a": "/adapters/a"})
    never = asyncio.Event()

    async def hung() -> dict:  # a step that does not end
        await never.wait()

    state.backend.adapter_residency, state.backend.update_gauges = hung, lambda metrics: None
    server = start_server(state)
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and "punica_requests_total" in r.text and 'punica_adapter_tier{' not in r.text
    server.stop()
