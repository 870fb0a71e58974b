"""Tenants at the server's edge (punica serve --tenants FILE): each key is a tenant or the admin; a
tenant uses, loads and unloads only its own adapters and sees nothing of the others' (not even that
they exist); /metrics and /v1/adapters are the admin's; the tenant travels with each request, to
the engine and to the request metrics. Without a tenants file, --admin-api-key guards the same
endpoints. cache_salt reaches the engine."""

import contextlib
import dataclasses
import threading
import time

import httpx
import openai
import pytest
import xgrammar as xgr
from prometheus_client.parser import text_string_to_metric_families

from punica.config import EngineArgs
from punica.engine.tenancy import TenantShare
from punica.server.args import ServerArgs
from punica.server.openai_api import OpenAIHandlers
from punica.server.serve import build_state
from punica.server.tenants import hash_key

KEYS = {"admin": "admin-key", "acme": "acme-key", "globex": "globex-key", "initech": "initech-key"}
SERVED = ("tenant-0", "tenant-1", "tenant-2")


def tenants_file(path, keys: dict[str, str]) -> str:
    """acme: tenant-0 and the extra-* adapters; globex: the tenant-1* adapters; tenant-2 is no one's;
    initech: the base model only, one request at a time."""
    path.write_text(f"""
[admin]
api_keys = ["{hash_key(keys["admin"])}"]

[tenants.acme]
api_keys = ["{hash_key(keys["acme"])}"]
adapters = ["tenant-0", "extra-*"]
weight = 2.0
max_concurrent_requests = 8

[tenants.globex]
api_keys = ["{hash_key(keys["globex"])}"]
adapters = ["tenant-1*"]

[tenants.initech]
api_keys = ["{hash_key(keys["initech"])}"]
max_concurrent_requests = 1
""")
    return str(path)


@pytest.fixture(scope="module")
def tenanted(adapter_dirs, start_server, tmp_path_factory):
    served, loadable = adapter_dirs
    path = tenants_file(tmp_path_factory.mktemp("tenants") / "tenants.toml", KEYS)
    state = build_state(EngineArgs(max_batch_size=8, max_loras=2), adapters=served, server=ServerArgs(tenants=path))
    state.adapter_dirs = [loadable]
    running = start_server(state)
    yield running
    running.stop()


def as_(who: str | None, server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[who]}"} if who is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def complete(client: httpx.Client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2, **extra})


@contextlib.contextmanager
def initech_at_its_cap(server):
    """initech's one allowed request streaming (its first chunk read: in the engine, far from its end)
    for the body of the with; yields a second initech client."""
    base = server.state.base_model_name
    with as_("initech", server) as streaming, as_("initech", server) as initech:
        body = {"model": base, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with streaming.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # held: a dropped iterator closes the stream
            next(lines)
            yield initech


def openai_client(who: str, server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[who], max_retries=0)


def test_the_tenants_shares_reach_the_engine_at_start(tenanted):
    assert tenanted.engine.scheduler.waiting.shares == {"acme": TenantShare(2.0, 8, None), "globex": TenantShare(),
                                                         "initech": TenantShare(max_concurrent_requests=1)}


def test_a_tenant_cannot_use_another_tenants_adapter_nor_tell_it_exists(tenanted):
    base = tenanted.state.base_model_name
    with as_("acme", tenanted) as acme, as_("globex", tenanted) as globex:
        assert complete(acme, "tenant-0").status_code == 200
        assert complete(acme, base).status_code == 200
        assert complete(globex, "tenant-1").status_code == 200
        for foreign in ("tenant-1", "tenant-2"):  # globex's, and no tenant's
            theirs, missing = complete(acme, foreign), complete(acme, "no-such-adapter")
            assert theirs.status_code == missing.status_code == 404
            assert theirs.content.replace(foreign.encode(), b"no-such-adapter") == missing.content
            assert theirs.headers["content-type"] == missing.headers["content-type"]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client("globex", tenanted).chat.completions.create(
            model="tenant-0", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.code == "model_not_found"


def test_a_missing_or_unknown_key_is_401(tenanted):
    with as_(None, tenanted) as anonymous, httpx.Client(base_url=tenanted.url, timeout=120,
                                                        headers={"Authorization": "Bearer guess"}) as guessing:
        for client, code in ((anonymous, None), (guessing, "invalid_api_key")):
            for r in (complete(client, "tenant-0"), client.get("/v1/models"), client.get("/v1/adapters"),
                      client.get("/metrics"), client.post("/v1/unload_lora_adapter", json={"lora_name": "tenant-0"})):
                assert r.status_code == 401 and r.json()["error"]["code"] == code, (r.request.url, r.text)
        assert anonymous.get("/health").status_code == 200


def test_a_tenant_loads_and_unloads_only_its_own_adapters(tenanted, adapter_dirs):
    extra_0 = str(adapter_dirs[1] / "extra-0")
    with as_("acme", tenanted) as acme, as_("globex", tenanted) as globex:
        for name in ("tenant-1", "tenant-2", "tenant-1-copy"):
            r = acme.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert r.status_code == 403 and r.json()["error"]["param"] == "lora_name", r.text
            r = acme.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": extra_0})
            assert r.status_code == 403 and "may not load or unload" in r.json()["error"]["message"], r.text
        assert complete(globex, "tenant-1").status_code == 200  # still there, still globex's
        # a name of its own over another's folder would serve their weights
        r = globex.post("/v1/load_lora_adapter", json={"lora_name": "tenant-1-b", "lora_path": extra_0})
        assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path", r.text
        r = acme.post("/v1/load_lora_adapter", json={"lora_name": "extra-a", "lora_path": extra_0})
        assert r.status_code == 200, r.text
        assert complete(acme, "extra-a").status_code == 200
        assert complete(globex, "extra-a").status_code == 404
        assert acme.post("/v1/unload_lora_adapter", json={"lora_name": "extra-a"}).status_code == 200
        assert complete(acme, "extra-a").status_code == 404


def test_the_admin_may_use_load_and_unload_any_adapter(tenanted, adapter_dirs):
    extra_1 = str(adapter_dirs[1] / "extra-1")
    with as_("admin", tenanted) as admin, as_("globex", tenanted) as globex:
        for name in SERVED:
            assert complete(admin, name).status_code == 200
        r = admin.post("/v1/load_lora_adapter", json={"lora_name": "tenant-1-x", "lora_path": extra_1})
        assert r.status_code == 200, r.text
        assert complete(globex, "tenant-1-x").status_code == 200  # a name of globex's: globex may use it
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "tenant-1-x"}).status_code == 200


def test_metrics_and_adapters_are_the_admins(tenanted):
    with as_("admin", tenanted) as admin, as_("acme", tenanted) as acme, as_(None, tenanted) as anonymous:
        for path in ("/metrics", "/v1/adapters"):
            assert admin.get(path).status_code == 200
            r = acme.get(path)
            assert r.status_code == 403 and "admin API key" in r.json()["error"]["message"], r.text
        tenanted.state.metrics_public = True  # --metrics-public
        try:
            assert anonymous.get("/metrics").status_code == acme.get("/metrics").status_code == 200
            assert anonymous.get("/v1/adapters").status_code == 401 and acme.get("/v1/adapters").status_code == 403
        finally:
            tenanted.state.metrics_public = False
        assert anonymous.get("/metrics").status_code == 401


def test_models_lists_the_callers_adapters_without_paths(tenanted, adapter_dirs):
    served, _ = adapter_dirs
    base = tenanted.state.base_model_name
    for who, mine in (("acme", {"tenant-0"}), ("globex", {"tenant-1"})):
        with as_(who, tenanted) as client:
            r = client.get("/v1/models")
        ids = [m["id"] for m in r.json()["data"]]
        assert ids[0] == base and set(ids[1:]) == mine, ids
        assert all("root" not in m for m in r.json()["data"][1:])
        assert all(p not in r.text for p in served.values())
    with as_("admin", tenanted) as client:
        admin = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert set(admin) == {base, *SERVED} and admin["tenant-1"]["root"] == served["tenant-1"]


def requests_by_tenant(text: str, adapter: str, tenant: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "punica_requests_total" and s.labels == {"adapter": adapter, "finish_reason": "length",
                                                                  "tenant": tenant}:
                return s.value
    return 0.0


def test_request_metrics_carry_the_tenant(tenanted):
    with as_("admin", tenanted) as admin:
        before = admin.get("/metrics").text
        for who, model in (("acme", "tenant-0"), ("globex", "tenant-1"), ("admin", "tenant-1")):
            with as_(who, tenanted) as client:
                assert complete(client, model).status_code == 200
        after = admin.get("/metrics").text
    for adapter, tenant in (("tenant-0", "acme"), ("tenant-1", "globex"), ("tenant-1", "admin")):
        assert requests_by_tenant(after, adapter, tenant) == requests_by_tenant(before, adapter, tenant) + 1
    families = {f.name: f for f in text_string_to_metric_families(after)}
    assert {s.labels["tenant"] for s in families["punica_prompt_tokens"].samples} >= {"acme", "globex", "admin"}


def test_a_tenant_at_its_max_concurrent_requests_gets_429_and_then_is_served(tenanted):
    base = tenanted.state.base_model_name
    with initech_at_its_cap(tenanted) as initech:
        refused = complete(initech, base)
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"]
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "max_concurrent_requests" in error["message"]
        with as_("acme", tenanted) as acme:  # another tenant is not held back
            assert complete(acme, base).status_code == 200
    with as_("initech", tenanted) as initech:
        # the stream left: its request is aborted, and initech has room again once the server has
        # seen it go (a disconnect is noticed asynchronously; until then the answer is a 429)
        deadline = time.monotonic() + 30
        while (served := complete(initech, base)).status_code == 429 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.status_code == 200, served.text


def test_a_request_waiting_for_its_grammar_counts_toward_its_tenants_max_concurrent_requests(tenanted, held,
                                                                                           monkeypatch):
    pool = tenanted.engine.grammars.pool  # a held compile stays within its time limit however slow the machine
    monkeypatch.setattr(pool, "limits", dataclasses.replace(pool.limits, max_compile_seconds=600))
    base = tenanted.state.base_model_name
    answer = {}

    def constrained():
        with as_("initech", tenanted) as initech:
            answer["response"] = complete(initech, base, guided_regex="HOLD[0-9]{3}c")

    thread = threading.Thread(target=constrained)
    thread.start()
    try:
        assert held.started.wait(60)  # its grammar compiles (held): it is initech's one request
        with as_("initech", tenanted) as initech:
            refused = complete(initech, base)
            assert refused.status_code == 429 and "max_concurrent_requests" in refused.text, refused.text
    finally:
        held.go.set()
        thread.join(60)
    assert answer["response"].status_code == 200, answer["response"].text
    with as_("initech", tenanted) as initech:
        assert complete(initech, base).status_code == 200


def test_a_tenant_at_its_max_concurrent_requests_gets_429_before_its_grammar_compiles(tenanted, monkeypatch):
    compiled = []
    compile_json_schema = xgr.GrammarCompiler.compile_json_schema

    def counting(compiler, schema, **kwargs):
        compiled.append(schema)
        return compile_json_schema(compiler, schema, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_json_schema", counting)
    base = tenanted.state.base_model_name
    schema = {"type": "object", "properties": {"never_compiled_at_the_cap": {"type": "string"}}}
    with initech_at_its_cap(tenanted) as initech:
        refused = complete(initech, base, guided_json=schema)
        assert refused.status_code == 429, refused.text
    assert not [s for s in compiled if "never_compiled_at_the_cap" in s]


def test_a_tenant_at_its_max_concurrent_requests_gets_429_before_its_prompt_is_tokenized(tenanted, monkeypatch):
    """The cheap refusal comes first: a tenant flooding past its cap costs the server little."""
    tokenized = []

    def recording(name):
        original = getattr(OpenAIHandlers, name)

        def record(self, *args):
            tokenized.append(name)
            return original(self, *args)
        return record

    for name in ("_tokenize", "_chat_prompt_ids"):
        monkeypatch.setattr(OpenAIHandlers, name, recording(name))
    base = tenanted.state.base_model_name
    with initech_at_its_cap(tenanted) as initech:
        tokenized.clear()
        chat = {"model": base, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        for refused in (complete(initech, base), initech.post("/v1/chat/completions", json=chat)):
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["Retry-After"]
        assert tokenized == []


@pytest.fixture()
def recorded(monkeypatch):
    """start(server) -> the keyword arguments of every backend.generate call from then on."""
    def start(server) -> list[dict]:
        calls, generate = [], server.state.backend.generate

        def recording(*args, **kwargs):
            calls.append(kwargs)
            return generate(*args, **kwargs)

        monkeypatch.setattr(server.state.backend, "generate", recording)
        return calls
    return start


def test_cache_salt_and_the_tenant_go_with_the_request(tenanted, recorded):
    calls = recorded(tenanted)
    acme = openai_client("acme", tenanted)
    acme.completions.create(model="tenant-0", prompt="Hi", max_tokens=2, extra_body={"cache_salt": "salt-1"})
    acme.chat.completions.create(model="tenant-0", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                 extra_body={"cache_salt": "salt-2"})
    acme.completions.create(model="tenant-0", prompt="Hi", max_tokens=2)
    assert calls == [{"tenant": "acme", "cache_salt": "salt-1"}, {"tenant": "acme", "cache_salt": "salt-2"},
                     {"tenant": "acme", "cache_salt": None}]


@pytest.mark.parametrize("salt", ["", "s" * 257, 5, ["a"]])
def test_an_invalid_cache_salt_is_a_400_naming_it(tenanted, recorded, salt):
    calls = recorded(tenanted)
    with as_("acme", tenanted) as acme:
        for r in (complete(acme, "tenant-0", cache_salt=salt),
                  acme.post("/v1/chat/completions", json={"model": "tenant-0", "cache_salt": salt, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]})):
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
            assert "cache_salt" in r.json()["error"]["message"]
    assert calls == []


@pytest.fixture(scope="module")
def admin_keyed(adapter_dirs, start_server):
    """No tenants file: --api-key for everyone, --admin-api-key for the admin."""
    served, loadable = adapter_dirs
    state = build_state(EngineArgs(max_batch_size=4, max_loras=2), adapters={"tenant-0": served["tenant-0"]},
                        server=ServerArgs(api_key=KEYS["acme"], admin_api_key=KEYS["admin"]))
    state.adapter_dirs = [loadable]
    running = start_server(state)
    yield running
    running.stop()


def test_without_tenants_the_admin_api_key_guards_the_admin_endpoints(admin_keyed, adapter_dirs, recorded):
    served, loadable = adapter_dirs
    load = {"lora_name": "extra", "lora_path": str(loadable / "extra-0")}
    with as_("acme", admin_keyed) as user, as_("admin", admin_keyed) as admin, as_(None, admin_keyed) as anonymous:
        for path, body in (("/v1/load_lora_adapter", load), ("/v1/unload_lora_adapter", {"lora_name": "tenant-0"})):
            r = user.post(path, json=body)
            assert r.status_code == 403 and "admin API key" in r.json()["error"]["message"], r.text
            assert anonymous.post(path, json=body).status_code == 401
        for path in ("/metrics", "/v1/adapters"):
            assert user.get(path).status_code == 403 and anonymous.get(path).status_code == 401
            assert admin.get(path).status_code == 200
        calls = recorded(admin_keyed)
        assert complete(user, "tenant-0", cache_salt="s").status_code == 200
        assert calls == [{"tenant": None, "cache_salt": "s"}]
        assert [m.get("root") for m in user.get("/v1/models").json()["data"][1:]] == [None]
        assert admin.get("/v1/models").json()["data"][1]["root"] == served["tenant-0"]
        assert admin.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert complete(user, "extra").status_code == 200
        assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
