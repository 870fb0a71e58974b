"""SIGHUP makes `punica serve --tenants FILE` read the file again: new keys work, removed ones stop
working, a bad file changes nothing, and requests already running keep going."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from punica.server.tenants import hash_key

REPO = Path(__file__).resolve().parents[2]
ADMIN, ACME, GLOBEX = "admin-key", "acme-key", "globex-key"
WAIT_S = 60  # for a slow machine: each wait ends as soon as its condition holds


def tenants(*tables: str) -> str:
    return f'[admin]\napi_keys = ["{hash_key(ADMIN)}"]\n' + "".join(tables)


def tenant(name: str, key: str) -> str:
    return f'[tenants.{name}]\napi_keys = ["{hash_key(key)}"]\n'


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S} s"
        time.sleep(0.1)


@pytest.fixture()
def serving(tmp_path, free_port):
    """`punica serve --tenants FILE` in a subprocess: (process, url, the file, its log)."""
    path, log_path = tmp_path / "tenants.toml", tmp_path / "serve.log"
    path.write_text(tenants(tenant("acme", ACME)))
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "punica.cli", "serve", "--tenants", str(path), "--port",
                                 str(port), "--max-batch-size", "4", "--kv-cache-tokens", "8192"],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"punica serve exited: {log_path.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"punica serve did not start: {log_path.read_text()[-5000:]}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, url, path, log_path
    finally:
        proc.kill()
        proc.wait()


def status(url: str, key: str) -> int:
    return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code


def running(url: str) -> int:
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
    batch = next(f for f in text_string_to_metric_families(metrics) if f.name == "punica_batch_size")
    return int(batch.samples[0].value)


@pytest.mark.slow
def test_sighup_reads_the_tenants_file_again_without_dropping_requests(serving):
    proc, url, path, log_path = serving
    assert status(url, ACME) == 200 and status(url, GLOBEX) == 401
    model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {ACME}"}).json()["data"][0]["id"]
    body = {"model": model, "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ACME}"}) as acme, \
            acme.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        chunks = (json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: "))
        next(chunks)

        path.write_text(tenants(tenant("globex", GLOBEX)))  # acme goes, globex comes
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: status(url, GLOBEX) == 200, "globex's key working")
        assert status(url, ACME) == 401

        path.write_text(tenants(tenant("globex", GLOBEX) + "weight = 0\n"))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "the tenants stay as they were" in log_path.read_text(), "the bad file's error logged")
        assert "[tenants.globex] weight must be a number > 0" in log_path.read_text()
        assert status(url, GLOBEX) == 200 and status(url, ACME) == 401

        # acme's stream, accepted before its key went, still runs and still streams
        assert running(url) == 1
        for _ in range(8):
            chunk = next(chunks)
            assert "error" not in chunk and chunk["choices"][0]["finish_reason"] is None, chunk
    assert proc.poll() is None
