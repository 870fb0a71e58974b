"""Why a request stops before it finishes: its client went away, or the server is shutting down.

Uvicorn answers a pending ASGI `receive()` with `http.disconnect` as soon as the connection
is lost, whether the response has started or not, so one task awaiting it sees a disconnect
at once; nothing polls. (Starlette's StreamingResponse listens the same way only while it
streams, and not at all under ASGI spec 2.4, so a request still waiting for its first token
would go unnoticed.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import Receive

DISCONNECT = "disconnect"  # the client closed its connection
SHUTDOWN = "shutdown"      # the server's --shutdown-timeout passed while the request ran


class Interrupt:
    """One request's watch, from when its body has been read to when its response ends (`close`)."""

    def __init__(self, receive: Receive, in_flight: InFlight):
        self.reason: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._in_flight = in_flight
        self._client = asyncio.ensure_future(self._watch_client(receive))
        in_flight.add(self)

    @property
    def fired(self) -> bool:
        return self.reason.done()

    @property
    def client_gone(self) -> bool:
        return self.reason.done() and self.reason.result() == DISCONNECT

    def on_fire(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` when the request is interrupted (soon, if it already was)."""
        self.reason.add_done_callback(lambda future: callback(future.result()))

    def fire(self, reason: str) -> None:
        if not self.reason.done():
            self.reason.set_result(reason)

    def close(self) -> None:
        self._client.cancel()
        self._in_flight.discard(self)

    async def _watch_client(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.fire(DISCONNECT)


class InFlight:
    """The interrupts of the requests being served, so that a shutdown can end them all."""

    def __init__(self):
        self.aborting = False
        self._interrupts: set[Interrupt] = set()

    def __len__(self) -> int:
        return len(self._interrupts)

    def add(self, interrupt: Interrupt) -> None:
        self._interrupts.add(interrupt)
        if self.aborting:
            interrupt.fire(SHUTDOWN)

    def discard(self, interrupt: Interrupt) -> None:
        self._interrupts.discard(interrupt)

    def abort_all(self) -> None:
        """End every request being served, and every one that starts from now on."""
        self.aborting = True
        for interrupt in list(self._interrupts):
            interrupt.fire(SHUTDOWN)
