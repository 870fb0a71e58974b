"""Tests that change server state (API key, queue limit, loaded adapters, a failing step), on a
server of their own: run-time adapters, OpenAI's 401 and 429, and /metrics, which counts every
finished request once however it ended (stop, length, abort, error), every error answer by
status, and failed adapter loads."""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from punica.config import EngineArgs
from punica.server.serve import build_state

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own(adapter_dirs, private_dir, start_server):
    served, loadable = adapter_dirs
    state = build_state(EngineArgs(max_batch_size=8, max_loras=2), adapters={"tenant-0": served["tenant-0"]})
    state.adapter_dirs = [loadable, private_dir]
    running = start_server(state)
    yield running
    running.stop()


@pytest.fixture()
def http(own):
    with httpx.Client(base_url=own.url, timeout=120) as client:
        yield client


def assert_error(r: httpx.Response, status: int, fragment: str, param: str | None = None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param, error


def still_serving(http: httpx.Client):
    r = http.post("/v1/completions", json={"model": "tenant-0", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def metric(http: httpx.Client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def requests_total(http, adapter, reason):
    return metric(http, "punica_requests_total", adapter=adapter, finish_reason=reason)


def rejected(http, status):
    return metric(http, "punica_rejected_requests_total", status=str(status))


def eventually(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_stop_and_length_are_counted_once_each(http):
    before = requests_total(http, "tenant-0", "length")
    body = {"model": "tenant-0", "prompt": "Hi", "max_tokens": 2}
    for _ in range(3):
        assert http.post("/v1/completions", json=body).status_code == 200
    assert requests_total(http, "tenant-0", "length") == before + 3


def test_client_disconnects_count_as_aborts(http, own):
    before = requests_total(http, "tenant-0", "abort")
    body = {"model": "tenant-0", "prompt": "Count:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    for _ in range(2):
        with httpx.Client(base_url=own.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))
    eventually(lambda: requests_total(http, "tenant-0", "abort") >= before + 2)
    own.wait_idle()
    assert requests_total(http, "tenant-0", "abort") == before + 2


def test_failed_step_counts_errors_and_is_a_500(http, own):
    engine = own.engine
    real_step = engine.step

    def failing_step():
        updates = real_step()
        if not engine.scheduler.running:  # the request still waits (for its adapter's first load)
            return updates
        engine.step = real_step  # it is in the batch when this step fails
        raise RuntimeError("injected step failure")

    errors, answered_500 = requests_total(http, "tenant-0", "error"), rejected(http, 500)
    engine.step = failing_step
    try:
        r = http.post("/v1/completions", json={"model": "tenant-0", "prompt": "Hi", "max_tokens": 4})
    finally:
        engine.step = real_step
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "injected step failure" in r.json()["error"]["message"]
    assert requests_total(http, "tenant-0", "error") == errors + 1 and rejected(http, 500) == answered_500 + 1
    assert http.post("/v1/completions", json={"model": "tenant-0", "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_error_answers_are_counted_by_status(http):
    before = {s: rejected(http, s) for s in (400, 404)}
    assert http.post("/v1/completions", json={"model": "tenant-0", "prompt": "x", "foo": 1}).status_code == 400
    assert http.post("/v1/completions", json={"model": "tenant-0", "prompt": "x", "top_p": 2}).status_code == 400
    assert http.post("/v1/completions", json={"model": "ghost", "prompt": "x"}).status_code == 404
    assert {s: rejected(http, s) for s in (400, 404)} == {400: before[400] + 2, 404: before[404] + 1}


def test_failed_adapter_loads_are_counted(http, adapter_dirs):
    served, loadable = adapter_dirs
    before = metric(http, "punica_adapter_load_failures_total")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "sneaky", "lora_path": served["tenant-1"]})
    assert r.status_code == 403 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": str(loadable / "missing")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(loadable / "extra-0")}
                     ).status_code == 200
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(loadable / "extra-1")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert metric(http, "punica_adapter_load_failures_total") == before + 3


def test_api_key_is_openais_401(http, own):
    before = rejected(http, 401)
    own.state.api_key = "sekret"
    try:
        missing = http.get("/v1/models")
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert http.get("/health").status_code == 200
    finally:
        own.state.api_key = None
    assert_error(missing, 401, "API key")
    assert_error(wrong, 401, "API key")
    assert (missing.json()["error"]["type"], missing.json()["error"]["code"]) == ("invalid_request_error", None)
    wrong_error = wrong.json()["error"]
    assert (wrong_error["type"], wrong_error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert rejected(http, 401) == before + 2
    still_serving(http)


def test_queue_limit_is_openais_429_with_retry_after(http, own):
    before = rejected(http, 429)
    own.state.max_queue = 0
    try:
        r = http.post("/v1/completions", json={"model": "tenant-0", "prompt": "x"})
    finally:
        own.state.max_queue = 1024
    assert_error(r, 429, "queue is full")
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("requests", "rate_limit_exceeded")
    assert r.headers["retry-after"] == "1" and rejected(http, 429) == before + 1
    still_serving(http)


def test_load_and_unload_adapters(http, adapter_dirs, private_dir):
    served, loadable = adapter_dirs
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(loadable / "extra-0")})
    assert r.status_code == 200, r.text
    assert "extra" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    r = http.post("/v1/completions", json={"model": "extra", "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    again = {"lora_name": "extra", "lora_path": str(loadable / "extra-1")}
    assert_error(http.post("/v1/load_lora_adapter", json=again), 400, "already loaded", "lora_name")
    for name, path in [("sneaky", served["tenant-1"]), ("dots", str(loadable / ".." / "served" / "tenant-1"))]:
        assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}), 403, "outside",
                     "lora_path")
    broken = private_dir / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)}), 400,
                 "unreadable", "lora_path")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert_error(http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}), 404, "not loaded", "lora_name")
    assert_error(http.post("/v1/completions", json={"model": "extra", "prompt": "x"}), 404, "does not exist", "model")
    still_serving(http)
