"""Connections no client can hoard (punica.server.connections): a head that never ends is closed at
the header timeout, a body that never ends is a 408 at the body timeout, the caps on connections
(in all and per client address) close the connection idle the longest and never one with a request
in progress, and failed accepts are logged once per interval."""

import argparse
import json
import logging
import resource
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from punica.config import EngineArgs
from punica.flags import add_arguments, from_arguments
from punica.server.args import NUM_RESERVED_FDS, ConnectionLimits, ServerArgs
from punica.server.connections import ACCEPT_FAILED, MIN_IDLE_S, EveryInterval, GuardedServer
from punica.server.serve import build_state

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30  # bound on a wait for something due within a 1 s timeout
PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends it never comes


class Clock:
    """The connection table's clock, which the test moves: connections idle for long without waiting."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def guarded(tokenizer, start_server, stub_state):
    """The function `guarded(**limits) -> RunningServer`: a server (no model behind it) under
    ConnectionLimits(**limits), its connection table on a Clock (`.clock`)."""
    started = []

    def start(**limits):
        clock = Clock()
        started.append(start_server(stub_state(tokenizer), server_class=GuardedServer,
                                    limits=ConnectionLimits(**limits), clock=clock))
        started[-1].clock = clock
        return started[-1]

    yield start
    for running in started:
        running.stop()


def connect(port: int, address: str = "127.0.0.1", head: bytes = b"") -> socket.socket:
    """A connection from `address` (any 127.x.y.z reaches the server on Linux) that has sent `head`."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(address, 0))
    sock.sendall(head)
    return sock


def until_closed(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection (within WAIT_S, or the test fails)."""
    received = b""
    deadline = time.monotonic() + WAIT_S
    with sock:
        while data := sock.recv(65536):
            received += data
            assert time.monotonic() < deadline, "the server did not close the connection"
    return received


def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def answer(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def health(server) -> int:
    return httpx.get(server.url + "/health", timeout=WAIT_S).status_code


@pytest.mark.parametrize("head", [b"", PARTIAL_HEAD], ids=["nothing", "partial-head"])
def test_a_head_that_never_ends_is_closed_at_the_header_timeout(guarded, head):
    server = guarded(header_timeout_s=1)
    assert until_closed(connect(server.port, head=head)) == b""
    assert health(server) == 200


def test_the_next_head_on_a_kept_alive_connection_has_the_header_timeout_too(guarded, read_answer):
    server = guarded(header_timeout_s=1)
    sock = connect(server.port, head=PARTIAL_HEAD + b"\r\n")
    assert read_answer(sock) == (200, {"status": "ok"})
    sock.sendall(PARTIAL_HEAD)  # half of the next request
    assert until_closed(sock) == b""


def test_a_body_shorter_than_its_content_length_is_408_at_the_body_timeout(guarded):
    server = guarded(body_timeout_s=1)
    sock = connect(server.port, head=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                     b'Content-Length: 100\r\n\r\n{"model": "base",')
    status, body = answer(until_closed(sock))
    assert status == 408 and body["error"]["code"] == 408
    assert "did not arrive in full within 1 s (--body-timeout)" in body["error"]["message"]
    assert health(server) == 200


def test_at_the_cap_a_new_connection_closes_the_connection_idle_longest(guarded):
    server = guarded(max_connections=8, max_connections_per_client=6)
    oldest = connect(server.port, "127.0.0.2", PARTIAL_HEAD)
    wait_for(lambda: len(server.server.table.open) == 1, "the first connection")
    idle = [connect(server.port, "127.0.0.2") for _ in range(5)] + [connect(server.port, "127.0.0.3")
                                                                    for _ in range(2)]
    wait_for(lambda: len(server.server.table.open) == 8, "8 connections")
    server.clock.now += MIN_IDLE_S
    assert health(server) == 200  # from 127.0.0.1: the ninth connection
    assert until_closed(oldest) == b""
    wait_for(lambda: len(server.server.table.open) == 7, "the others still open, the /health one closed")
    for sock in idle:
        sock.close()


def test_a_connection_idle_for_less_than_a_second_is_not_closed_for_the_cap(guarded):
    """It may not have been read from yet: the new connection gets 503 instead, until one has been idle long enough."""
    server = guarded(max_connections=2, max_connections_per_client=2)
    first, second = connect(server.port), connect(server.port)
    wait_for(lambda: len(server.server.table.open) == 2, "two connections")
    server.clock.now += 0.9 * MIN_IDLE_S
    status, refusal = answer(until_closed(connect(server.port)))
    assert status == 503 and "no room for another connection" in refusal["error"]["message"]
    server.clock.now += 0.1 * MIN_IDLE_S
    assert health(server) == 200
    assert until_closed(first) == b""
    second.close()


def test_past_its_cap_a_client_address_closes_its_own_connection_idle_longest(guarded):
    server = guarded(max_connections=64, max_connections_per_client=4)
    table = server.server.table
    others = [connect(server.port, "127.0.0.3") for _ in range(2)]  # idle longer than any of 127.0.0.2's
    wait_for(lambda: table.num_per_client["127.0.0.3"] == 2, "127.0.0.3's connections")
    oldest = connect(server.port, "127.0.0.2")
    wait_for(lambda: table.num_per_client["127.0.0.2"] == 1, "127.0.0.2's first connection")
    server.clock.now += MIN_IDLE_S
    mine = [connect(server.port, "127.0.0.2") for _ in range(4)]
    assert until_closed(oldest) == b""
    wait_for(lambda: table.num_per_client["127.0.0.2"] == 4, "127.0.0.2 at its cap")
    assert table.num_per_client["127.0.0.3"] == 2
    for sock in others + mine:
        sock.close()


def test_at_the_cap_requests_in_progress_are_kept_and_a_new_connection_gets_503(guarded, read_answer):
    server = guarded(max_connections=2, max_connections_per_client=2, body_timeout_s=WAIT_S)
    table = server.server.table
    body = b'{"model": "base", "prompt": 7}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    in_progress = [connect(server.port, head=head + body[:10]) for _ in range(2)]
    wait_for(lambda: len(table.open) == 2 and not table.idle, "two requests in progress")
    status, refusal = answer(until_closed(connect(server.port)))
    assert status == 503 and "no room for another connection" in refusal["error"]["message"]
    for sock in in_progress:  # their requests go on: the rest of the body gets their answer
        sock.sendall(body[10:])
        status, error = read_answer(sock)
        assert status == 400 and error["error"]["param"] == "prompt"
        sock.close()


@pytest.mark.slow
def test_a_stream_in_progress_is_never_cut_by_the_cap(start_server):
    state = build_state(EngineArgs(max_batch_size=2, kv_cache_tokens=4096))
    clock = Clock()
    server = start_server(state, server_class=GuardedServer, clock=clock,
                          limits=ConnectionLimits(max_connections=4, max_connections_per_client=4))
    body = {"model": state.base_model_name, "prompt": "Count:", "max_tokens": 96, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        chunks = [next(lines)]  # the stream has started
        idle = [connect(server.port) for _ in range(3)]
        wait_for(lambda: len(server.server.table.open) == 4, "the stream's connection and three idle ones")
        for _ in range(6):  # at the cap each new connection closes the one idle the longest, never the stream's
            clock.now += MIN_IDLE_S
            idle.append(connect(server.port))
            assert until_closed(idle.pop(0)) == b""
        clock.now += MIN_IDLE_S
        assert health(server) == 200
        assert server.engine.has_unfinished()  # the stream was in progress all along
        chunks += list(lines)
    assert chunks[-1] == "data: [DONE]"
    reasons = [c["finish_reason"] for chunk in chunks[:-1] for c in json.loads(chunk[6:])["choices"]]
    assert [r for r in reasons if r is not None] == ["length"]
    for sock in idle:
        sock.close()
    server.stop()


def test_punica_serve_flags_make_the_limits_and_bad_values_are_refused():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServerArgs)
    flags = ["--max-connections", "100", "--max-connections-per-client", "10", "--header-timeout", "2.5",
             "--body-timeout", "7"]
    assert from_arguments(ServerArgs, parser.parse_args(flags)).connection_limits() == ConnectionLimits(100, 10, 2.5, 7)
    for bad in ({"max_connections_per_client": 5000}, {"max_connections": 0}, {"max_connections_per_client": 0},
                {"header_timeout": 0}, {"body_timeout": float("nan")}, {"body_timeout": float("inf")}):
        with pytest.raises(ValueError, match="max_connections_per_client|header_timeout and body_timeout"):
            ServerArgs(**bad)


def test_every_interval_logs_the_first_event_then_one_per_interval_with_the_count_since():
    now = [100.0]
    limiter = EveryInterval(10.0, clock=lambda: now[0])
    logged = []
    for step in range(300):  # an event every 0.1 s for 30 s
        now[0] = 100.0 + step * 0.1
        count = limiter()
        if count is not None:
            logged.append((round(now[0] - 100.0, 1), count))
    assert logged == [(0.0, 1), (10.0, 100), (20.0, 100)]


def test_failed_accepts_are_logged_once_per_interval_and_other_loop_errors_as_before(caplog):
    server = GuardedServer(uvicorn.Config(app=None), ConnectionLimits())
    server.accept_errors = EveryInterval(10.0, clock=lambda: 0.0)  # every call within one interval

    class Loop:
        errors = []

        def default_exception_handler(self, context):
            self.errors.append(context["message"])

    loop = Loop()
    with caplog.at_level(logging.ERROR, logger="punica.server"):
        for _ in range(5000):
            server._loop_exception(loop, {"message": ACCEPT_FAILED, "exception": OSError(24, "Too many open files")})
        server._loop_exception(loop, {"message": "something else"})
    lines = [r.getMessage() for r in caplog.records if r.name == "punica.server"]
    assert len(lines) == 1 and lines[0].startswith("accept() failed ([Errno 24] Too many open files)")
    assert loop.errors == ["something else"]


def test_the_open_files_limit_is_raised_to_fit_the_cap_or_the_cap_lowered_to_fit_the_hard_limit():
    """In a child process: the limits it sets are its own."""
    script = textwrap.dedent("""
        import resource
        from punica.server.args import ConnectionLimits
        from punica.server.connections import fit_fd_limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 8192))
        for max_connections, per_client in ((1000, 100), (8000, 7000), (600, 600)):
            fitted = fit_fd_limit(ConnectionLimits(max_connections, per_client))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            print(soft, fitted.max_connections, fitted.max_connections_per_client)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        for max_connections in (4096, 300):
            print(fit_fd_limit(ConnectionLimits(max_connections, 100)).max_connections)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    fits = str(max(8192 - NUM_RESERVED_FDS, 8192 // 2))  # what is left besides the reserve, or half the limit
    assert out.stdout.split() == [str(1000 + NUM_RESERVED_FDS), "1000", "100",  # raised to fit
                                  "8192", fits, fits,  # up to the hard limit, the caps lowered to fit
                                  "8192", "600", "600",  # never raised
                                  "512", "300"]


@pytest.mark.slow
def test_punica_serve_out_of_open_files_still_answers_health_and_logs_little(tmp_path, free_port):
    """`punica serve` whose hard limit on open files is 512 (so it serves at most 256 connections)
    under 800 idle connections: a new connection's /health answers, and the log stays short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # this side's 800 sockets
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "punica.cli", "serve", "--port", str(port), "--max-batch-size", "2",
             "--kv-cache-tokens", "2048", "--header-timeout", "300"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512)))
    idle = []
    try:
        url = f"http://127.0.0.1:{port}/health"
        wait_for(lambda: proc.poll() is None and health_of(url) == 200, "punica serve to start", timeout=300)
        started = log_path.stat().st_size
        idle = [connect(port) for _ in range(800)]
        # 503 while every connection it holds has been idle for less than a second; then it closes one
        wait_for(lambda: health_of(url) == 200, "/health to answer")
        assert proc.poll() is None
        text = log_path.read_text()
        assert len(text) - started < 4096 and "Traceback" not in text, text[-4000:]
        assert "serving at most 256 connections" in text
    finally:
        for sock in idle:
            sock.close()
        proc.kill()
        proc.wait()


def health_of(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None
