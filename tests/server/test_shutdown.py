"""Graceful shutdown: SIGTERM stops new connections, lets requests in flight finish for
--shutdown-timeout seconds, ends the rest with finish_reason "abort" (every stream with a final
chunk and [DONE]), and exits; a hung engine does not keep the server alive."""

import asyncio
import gc
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from punica.config import EngineArgs
from punica.server.app import ServerState
from punica.server.async_engine import AsyncEngine
from punica.server.serve import build_state
from punica.server.shutdown import ABORT_GRACE_S, GracefulServer

REPO = Path(__file__).resolve().parents[2]
MARGIN_S = 30  # for a slow machine: exiting is bounded by the timeout, not by this


class Serving:
    """`punica serve` (the embedded model) in a subprocess on `port`."""

    def __init__(self, log_path: Path, shutdown_timeout: float, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.shutdown_timeout = shutdown_timeout
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "punica.cli", "serve", "--port", str(self.port), "--max-batch-size", "4",
             "--kv-cache-tokens", "8192", "--shutdown-timeout", str(shutdown_timeout)],
            cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, f"punica serve exited: {self.output()}"
            assert time.monotonic() < deadline, f"punica serve did not start: {self.output()}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-5000:]

    def in_engine(self) -> int:
        """Requests running or waiting, from /metrics."""
        families = text_string_to_metric_families(httpx.get(self.url + "/metrics").text)
        gauges = ("punica_batch_size", "punica_queue_length")
        return int(sum(f.samples[0].value for f in families if f.name in gauges))

    def wait_exit(self) -> int:
        try:
            return self.proc.wait(timeout=self.shutdown_timeout + ABORT_GRACE_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"punica serve still runs after SIGTERM: {self.output()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture()
def serving(tmp_path, free_port):
    started = []

    def start(shutdown_timeout: float) -> Serving:
        started.append(Serving(tmp_path / "serve.log", shutdown_timeout, free_port()))
        return started[-1]

    yield start
    for s in started:
        s.stop()


async def stream(client: httpx.AsyncClient, path: str, body: dict, first_chunk: asyncio.Event | None = None) -> dict:
    """One streamed request: its finish reasons (one per choice), and whether it ended with [DONE]."""
    reasons, done = [], False
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if first_chunk is not None:
                first_chunk.set()
            assert not done, "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"] is not None]
    return {"reasons": reasons, "done": done}


def requests_of(model: str, count: int, max_tokens: int) -> list[tuple[str, dict]]:
    """Half chat, half completions, all generating exactly `max_tokens` unless stopped."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Count to a million."}]}
    completion = {"model": model, "prompt": "1, 2, 3,"}
    return [("/v1/chat/completions", {**chat, "max_tokens": max_tokens, "ignore_eos": True}) if i % 2 else
            ("/v1/completions", {**completion, "max_tokens": max_tokens, "ignore_eos": True}) for i in range(count)]


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True


@pytest.mark.slow
def test_sigterm_aborts_what_does_not_finish_in_time(serving):
    server = serving(shutdown_timeout=2)
    jobs = requests_of(server.model, 32, max_tokens=1500)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            tasks = [asyncio.ensure_future(stream(c, path, body)) for path, body in jobs]
            while server.in_engine() < len(jobs):
                await asyncio.sleep(0.1)
            server.proc.send_signal(signal.SIGTERM)
            while not refuses_connections(server.port):
                await asyncio.sleep(0.05)
            # refused while still draining: the 32 requests hold it open for 2 s
            assert server.proc.poll() is None
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert server.wait_exit() == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
    assert all(r["done"] and r["reasons"] == ["abort"] for r in results), results


@pytest.mark.slow
def test_sigterm_lets_requests_in_flight_finish(serving):
    server = serving(shutdown_timeout=600)
    jobs = requests_of(server.model, 4, max_tokens=12)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            started = [asyncio.Event() for _ in jobs]
            tasks = [asyncio.ensure_future(stream(c, path, body, e)) for (path, body), e in zip(jobs, started)]
            for e in started:
                await e.wait()
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert all(r["done"] and r["reasons"] == ["length"] for r in results), results
    # it exits once they are done, long before the 600 s timeout
    server.shutdown_timeout = 0
    assert server.wait_exit() == -signal.SIGTERM


class HungEngine:
    """An engine whose first step never returns (until `release`): what a stuck GPU looks like.
    It has what AsyncEngine uses of an Engine."""

    max_model_len, vocab_size = 2048, 49152
    tokenizer = None  # no structured outputs: AsyncEngine makes no grammar compiler

    def __init__(self):
        self.requests: dict[str, object] = {}
        self.stepping, self.release = threading.Event(), threading.Event()

    def add_request(self, prompt, params, adapter, request_id, *, tenant=None, cache_salt=None, grammar=None):
        self.requests[request_id] = prompt

    def abort(self, request_id):
        self.requests.pop(request_id, None)

    def has_adapter(self, name) -> bool:
        return False

    def stats(self):
        return SimpleNamespace(num_waiting=0)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.stepping.set()
        self.release.wait()
        return []

    def close(self):
        pass


@pytest.mark.slow
def test_shutdown_with_a_hung_engine_ends_every_request_and_stops(tokenizer, start_server):
    engine = HungEngine()
    backend = AsyncEngine(lambda: engine)
    backend.STOP_TIMEOUT_S = 1
    state = ServerState(backend, tokenizer, "base")
    timeout_s = 1
    server = start_server(state, server_class=GracefulServer, in_flight=state.in_flight, timeout_s=timeout_s)
    try:
        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
                streams = [asyncio.ensure_future(stream(c, path, body)) for path, body in requests_of("base", 4, 100)]
                plain = asyncio.ensure_future(c.post("/v1/completions", json={"model": "base", "prompt": "Hi"}))
                deadline = time.monotonic() + 60
                while not engine.stepping.is_set() or len(state.in_flight) < 5:
                    assert time.monotonic() < deadline, "the requests never reached the engine"
                    await asyncio.sleep(0.05)
                server.server.should_exit = True  # what uvicorn's SIGTERM handler does
                return await asyncio.gather(*streams), await plain

        results, plain = asyncio.run(run())
        assert all(r["done"] and r["reasons"] == ["abort"] for r in results), results
        assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "abort"
        server.thread.join(timeout=timeout_s + ABORT_GRACE_S + backend.STOP_TIMEOUT_S + MARGIN_S)
        assert not server.thread.is_alive()
    finally:
        engine.release.set()
        server.stop()


def test_a_stopped_server_lets_its_engine_go(start_server):
    """Once its server has stopped and the backend is let go, nothing keeps the engine (model, KV
    cache): no module-level cache or registry of punica's or its libraries' holds it."""
    state = build_state(EngineArgs(max_batch_size=2, kv_cache_tokens=1024))
    running = start_server(state)
    r = httpx.post(running.url + "/v1/completions", json={"model": state.base_model_name, "prompt": "Hi",
                                                          "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    engine = weakref.ref(running.engine)
    running.stop()
    del state
    gc.collect()
    assert engine() is None
