"""The hostile tenant's raw connections in the soak's tenants mode (benchmarks.soak --tenants-file),
from an address of its own: idle connections past its per-client cap, a head that never ends
(slowloris), a body shorter than its Content-Length. Each outcome is the server's answer to the
connection: a status, or "closed" without one."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from benchmarks.soak_tenants import BASE, BODY_TIMEOUT_S, HEADER_TIMEOUT_S, MAX_CONNECTIONS_PER_CLIENT

RAW_ADDRESS = "127.0.0.3"  # counted against their own per-client cap, apart from the tenant's HTTP requests
CLOSE_SLACK_S = 10.0       # a connection the server must close may take this much longer on a busy machine


class RawConnections:
    """Connections to the server at `port`, with the hostile tenant's `key` where a request needs one;
    `record(kind, outcome)` counts each (HostileTenant.record: a failure unless EXPECTED)."""

    def __init__(self, port: int, key: str, record: Callable[[str, object], None]):
        self.port, self.key, self.record = port, key, record

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port, local_addr=(RAW_ADDRESS, 0))

    @staticmethod
    async def _answer(reader: asyncio.StreamReader, deadline: float, writer: asyncio.StreamWriter | None = None,
                      drip: bytes = b"") -> str | int:
        """What the server does with a connection by `deadline`: the status of its answer, "closed"
        (closed without one) or "open after N s". With `drip`, those bytes are sent every second meanwhile."""
        data = b""
        while (left := deadline - time.monotonic()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=min(left, 1.0) if drip else left)
            except TimeoutError:
                if drip:
                    try:
                        writer.write(drip)
                        await writer.drain()
                    except ConnectionError:
                        return "closed"
                continue
            except ConnectionError:
                chunk = b""
            if not chunk:
                return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else "closed"
            data += chunk
        return f"open after {CLOSE_SLACK_S:g} s past the timeout"

    async def connections(self, until: float) -> None:
        while time.monotonic() < until:
            await self.idle_connections()
            await self.slowloris()
            await self.short_body()

    async def idle_connections(self) -> None:
        """Idle connections (nothing sent) past its per-client cap: each closed, at the header timeout or
        for a newer connection, or refused with 503 while every other one is newer than a second."""
        opened = [await self._open() for _ in range(MAX_CONNECTIONS_PER_CLIENT + 8)]
        deadline = time.monotonic() + HEADER_TIMEOUT_S + CLOSE_SLACK_S
        outcomes = await asyncio.gather(*(self._answer(reader, deadline) for reader, _ in opened))
        for (_, writer), outcome in zip(opened, outcomes):
            writer.close()
            self.record("idle_connections", outcome)

    async def slowloris(self) -> None:
        reader, writer = await self._open()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\n")
        deadline = time.monotonic() + HEADER_TIMEOUT_S + CLOSE_SLACK_S
        self.record("slowloris", await self._answer(reader, deadline, writer, drip=b"X-Slow: 1\r\n"))
        writer.close()

    async def short_body(self) -> None:
        reader, writer = await self._open()
        body = json.dumps({"model": BASE, "prompt": "Hi"}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {self.key}\r\n".encode()
                     + f"Content-Length: {len(body) + 1000}\r\n\r\n".encode() + body)
        self.record("short_body", await self._answer(reader, time.monotonic() + BODY_TIMEOUT_S + CLOSE_SLACK_S))
        writer.close()
