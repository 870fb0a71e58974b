"""A client that goes away aborts its request at once, whether it streams or not, and whether
its request runs or still waits in the queue: the engine is left with no request and no page."""

import json
import socket
import time

import pytest

from punica.config import EngineArgs
from punica.server.serve import build_state

LONG = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def small(start_server):
    """Room for two running requests; a third waits in the queue."""
    running = start_server(build_state(EngineArgs(max_batch_size=2, kv_cache_tokens=4096)))
    yield running
    running.stop()


def send(server, stream: bool) -> socket.socket:
    """POST a long completion and return the connection, its answer unread."""
    body = json.dumps({"model": server.state.base_model_name, "stream": stream, **LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def read_until(sock: socket.socket, marker: bytes) -> None:
    seen = b""
    while marker not in seen:
        data = sock.recv(65536)
        assert data, f"the connection closed before {marker!r}"
        seen += data


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def assert_idle(server) -> None:
    engine = server.engine
    wait_for(lambda: not engine.has_unfinished() and engine.allocator.num_used == 0, "an idle engine")
    assert not engine.requests


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued_aborts_at_once(small, stream):
    engine = small.engine
    running = [send(small, stream=True) for _ in range(2)]
    try:
        for sock in running:
            read_until(sock, b"data: ")
        queued = send(small, stream)
        wait_for(lambda: len(engine.scheduler.waiting) == 1, "the third request to queue")
        ids = set(engine.requests)
        queued.close()
        # it leaves the queue while both running requests still run: nothing had to make room for it
        wait_for(lambda: not engine.scheduler.waiting, "the queued request to be aborted")
        assert len(engine.scheduler.running) == 2 and set(engine.requests) < ids
    finally:
        for sock in running:
            sock.close()
    assert_idle(small)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_running_aborts_and_frees_pages(small, stream):
    engine = small.engine
    sock = send(small, stream)
    wait_for(lambda: engine.scheduler.running and engine.allocator.num_used > 0, "the request to run")
    if stream:
        read_until(sock, b"data: ")
    sock.close()
    assert_idle(small)
