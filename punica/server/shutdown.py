"""Graceful shutdown: on SIGTERM or SIGINT, stop accepting, give the requests in flight
`--shutdown-timeout` seconds to finish, end the rest with finish_reason "abort", and exit.

Uvicorn's own shutdown (Server.shutdown, after its signal handler set `should_exit`) closes
the listening sockets, closes idle connections, marks busy ones to close after their
response, and then waits for them up to `timeout_graceful_shutdown` before cancelling the
tasks that still run, which would cut streams off mid-way. This server keeps that sequence
and adds one step: at the shutdown timeout it interrupts every request still in flight (see
interrupts.py), whose handler then ends it cleanly (a stream with a final chunk and `[DONE]`,
a non-streaming request with its text so far). Only a response that still has not ended
ABORT_GRACE_S later, say to a client that stopped reading, is cancelled by uvicorn. The app's
lifespan then stops the engine (bounded, see AsyncEngine.shutdown).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from punica.server.args import CONNECTION_DEFAULTS, DEFAULT_SHUTDOWN_TIMEOUT_S, ConnectionLimits
from punica.server.connections import GuardedServer
from punica.server.interrupts import InFlight

log = logging.getLogger("punica.server")
ABORT_GRACE_S = 5.0


class GracefulServer(GuardedServer):
    """The server `punica serve` runs: connections guarded (punica.server.connections), shut down gracefully."""

    def __init__(self, config: uvicorn.Config, in_flight: InFlight, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 limits: ConnectionLimits = CONNECTION_DEFAULTS):
        config.timeout_graceful_shutdown = timeout_s + ABORT_GRACE_S
        super().__init__(config, limits)
        self.in_flight, self.timeout_s = in_flight, timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.in_flight:
            log.info("shutting down: %d requests in flight have %g s to finish", len(self.in_flight), self.timeout_s)
        deadline = asyncio.get_running_loop().call_later(self.timeout_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def _abort_in_flight(self) -> None:
        if self.in_flight:
            log.warning("shutdown timeout: aborting %d requests in flight", len(self.in_flight))
        self.in_flight.abort_all()
