"""`punica serve` in a subprocess for the benchmarks that measure it as its clients see it."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

START_TIMEOUT_S = 300.0  # a server whose /health has not answered by then did not start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """`punica serve` in a subprocess, once /health answers: the process and its URL."""
    port = int(command[command.index("--port") + 1])
    with open(log_path, "w") as log:  # the child writes through its own copy of the descriptor
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.terminate()
            server.wait(60)
            raise RuntimeError(f"the server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


@contextlib.contextmanager
def serving(flags: list[str], log_dir: Path) -> Iterator[str]:
    """`punica serve` with these flags (its port chosen here) for the block: its URL; its log under
    `log_dir`. The server is stopped after the block."""
    port = free_port()
    command = [sys.executable, "-m", "punica.cli", "serve", "--port", str(port), *flags]
    server, url = start_server(command, log_dir / f"server_{port}.log")
    try:
        yield url
    finally:
        server.terminate()
        server.wait(60)
