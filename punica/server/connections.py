"""Connections no client can hoard: caps on open connections (in all, and per client address), a
deadline for each request's head and one for its body, and accept errors logged once per interval.

uvicorn's HTTP protocols bound neither how long a request's head may take (a client that sends a
header byte every few seconds holds its connection for ever) nor how many connections are open:
idle ones pile up until the process runs out of file descriptors, new connections (/health too)
then wait in the listen queue, and asyncio logs a traceback for every accept that fails.
GuardedServer serves with GuardedH11Protocol, uvicorn's h11 protocol with these rules:

- header timeout: a request's head must arrive in full within `header_timeout_s` of the
  connection's start, or of the end of the response before it; else the connection is closed;
- body timeout: a request's body must arrive in full within `body_timeout_s` of its head; else it
  is answered 408 and the connection closed (its handler sees the client go away);
- caps: a new connection past `max_connections` open ones, or past `max_connections_per_client`
  from its address, closes the connection (of that address, for the latter) idle the longest, one
  with no request in progress and nothing left to send, idle for MIN_IDLE_S at least: a response
  in progress, a stream say, is never cut. Where there is none, the new connection is answered
  503 and closed;
- file descriptors: the process's limit is raised to fit the cap (`fit_fd_limit`), and the
  accept errors that running out of them would still cause are logged once per interval.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from itertools import takewhile

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from punica.server.args import CONNECTION_DEFAULTS, NUM_RESERVED_FDS, ConnectionLimits

log = logging.getLogger("punica.server")

LOG_INTERVAL_S = 10.0  # failed accepts, refusals, closings for a cap: a line of each per this many seconds at most
# a connection idle for less is never closed for a cap: a new one may not have been read from yet
# (under a flood, asyncio admits thousands of connections between a connection's start and its
# first bytes), and a client that just got an answer may be sending its next request
MIN_IDLE_S = 1.0
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message for EMFILE, ENFILE, ENOBUFS, ENOMEM


class EveryInterval:
    """Whether an event that recurs should be logged now: the first one, then the first one at
    least `interval_s` after the last one logged. Calling it counts an event; it returns how many
    there were since the last one logged (this one included) when this one is to be logged, else None."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.last_logged: float | None = None
        self.num_unlogged = 0

    def __call__(self) -> int | None:
        self.num_unlogged += 1
        now = self.clock()
        if self.last_logged is not None and now - self.last_logged < self.interval_s:
            return None
        self.last_logged, count, self.num_unlogged = now, self.num_unlogged, 0
        return count


class ConnectionTable:
    """The open connections, per client address, and which of them are idle (no request in
    progress), longest idle first, with the `clock` time each became idle."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self.open: set[GuardedH11Protocol] = set()
        self.idle: OrderedDict[GuardedH11Protocol, float] = OrderedDict()
        self.num_per_client: Counter[str] = Counter()
        self.idle_per_client: dict[str, OrderedDict[GuardedH11Protocol, float]] = {}
        self.closings, self.refusals = EveryInterval(), EveryInterval()

    def admit(self, connection: GuardedH11Protocol) -> bool:
        """Make room for a new connection and add it, idle; False (nothing changed) when there is no room."""
        client, limits = connection.address, self.limits
        if self.num_per_client[client] >= limits.max_connections_per_client:
            if not self._close_longest_idle(self.idle_per_client.get(client, {}), client):
                return self._refuse(f"its address {client} has {limits.max_connections_per_client} "
                                    f"(--max-connections-per-client), none idle for {MIN_IDLE_S:g} s")
        if len(self.open) >= limits.max_connections:
            if not self._close_longest_idle(self.idle, None):
                return self._refuse(f"{limits.max_connections} are open (--max-connections), none idle for "
                                    f"{MIN_IDLE_S:g} s")
        self.open.add(connection)
        self.num_per_client[client] += 1
        self.mark_idle(connection)
        return True

    def mark_busy(self, connection: GuardedH11Protocol) -> None:
        self.idle.pop(connection, None)
        self.idle_per_client.get(connection.address, {}).pop(connection, None)

    def mark_idle(self, connection: GuardedH11Protocol) -> None:
        if connection not in self.open:
            return
        self.mark_busy(connection)  # to the end of both orders
        since = self.clock()
        self.idle[connection] = since
        self.idle_per_client.setdefault(connection.address, OrderedDict())[connection] = since

    def remove(self, connection: GuardedH11Protocol) -> None:
        if connection not in self.open:
            return
        self.mark_busy(connection)
        self.open.discard(connection)
        client = connection.address
        self.num_per_client[client] -= 1
        if not self.num_per_client[client]:
            del self.num_per_client[client]
            self.idle_per_client.pop(client, None)

    def _close_longest_idle(self, idle: OrderedDict[GuardedH11Protocol, float], client: str | None) -> bool:
        """Close the connection of `idle` idle the longest, if for MIN_IDLE_S at least, with nothing left to send."""
        now = self.clock()
        victim = next((c for c in takewhile(lambda c: now - idle[c] >= MIN_IDLE_S, idle)
                       if c.transport.get_write_buffer_size() == 0), None)
        if victim is None:
            return False
        self.remove(victim)
        victim.transport.close()
        count = self.closings()
        if count is not None:
            cap = (f"{self.limits.max_connections_per_client} from {client} (--max-connections-per-client)"
                   if client is not None else f"{self.limits.max_connections} (--max-connections)")
            log.warning("closed %d idle connections since the last line like this, to admit new ones: the cap "
                        "of %s is reached", count, cap)
        return True

    def _refuse(self, why: str) -> bool:
        count = self.refusals()
        if count is not None:
            log.warning("refused %d new connections with 503 since the last line like this: %s", count, why)
        return False


def _error(status: int, reason: str, message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The JSON body of an OpenAI-style error, and the headers of a response that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"connection", b"close")]


def _refusal(max_connections: int) -> bytes:
    """A whole 503 response, sent before any request (so written raw: h11 answers only requests)."""
    body, headers = _error(503, "Service Unavailable", "the server has no room for another connection now "
                                                       f"(its cap is {max_connections}); retry later")
    head = b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
    return head + b"\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionTable's caps, with the header and body timeouts."""

    def __init__(self, *args, table: ConnectionTable, **kwargs):
        super().__init__(*args, **kwargs)
        self.table, self.address = table, ""
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        if not self.table.admit(self):
            transport.write(_refusal(self.table.limits.max_connections))
            transport.close()
            return
        self._set_deadline(self.table.limits.header_timeout_s, self._header_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        self.table.remove(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a request's head arrived
            self.table.mark_busy(self)
            if self.cycle.more_body:
                self._set_deadline(self.table.limits.body_timeout_s, self._body_late)
            else:
                self._set_deadline(None)
        elif self.deadline is not None and self.cycle is not None and not self.cycle.more_body \
                and not self.cycle.response_complete:  # the body arrived in full
            self._set_deadline(None)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self.table.mark_idle(self)
            self._set_deadline(self.table.limits.header_timeout_s, self._header_late)
        super().on_response_complete()  # a request pipelined behind this one starts here

    def _set_deadline(self, delay_s: float | None, callback: Callable[[], None] | None = None) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = None if delay_s is None else self.loop.call_later(delay_s, callback)

    def _header_late(self) -> None:  # no request in progress: its head would have replaced the deadline
        self.deadline = None
        self.table.remove(self)
        self.transport.close()

    def _body_late(self) -> None:
        self.deadline = None
        cycle = self.cycle  # its body did not arrive in full: that would have cancelled the deadline
        if cycle.response_started:
            return  # a response on its way is not cut; when it ends, the header timeout applies
        body, headers = _error(408, "Request Timeout", f"the request body did not arrive in full within "
                                                       f"{self.table.limits.body_timeout_s:g} s (--body-timeout)")
        for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.table.remove(self)
        self.transport.close()
        cycle.disconnected = True  # the handler, waiting for the body, sees the client go away
        cycle.message_event.set()


def fit_fd_limit(limits: ConnectionLimits) -> ConnectionLimits:
    """Raise the process's soft limit on open files to hold `max_connections` and NUM_RESERVED_FDS
    more; where the hard limit is lower, the limits with as many connections as it allows."""
    needed = limits.max_connections + NUM_RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return limits
    new_soft = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if new_soft > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        log.info("raised the limit on open files (ulimit -n) from %d to %d", soft, new_soft)
    max_connections = min(limits.max_connections, max(new_soft - NUM_RESERVED_FDS, new_soft // 2))
    if max_connections == limits.max_connections:
        return limits
    log.warning("the hard limit on open files (ulimit -Hn) is %d: serving at most %d connections, not %d "
                "(--max-connections needs a limit of %d)", hard, max_connections, limits.max_connections, needed)
    return dataclasses.replace(limits, max_connections=max_connections,
                               max_connections_per_client=min(limits.max_connections_per_client, max_connections))


class GuardedServer(uvicorn.Server):
    """uvicorn's server over GuardedH11Protocol (no WebSocket upgrades: the API has none), with the
    file-descriptor limit fitted to the caps and failed accepts logged once per interval."""

    def __init__(self, config: uvicorn.Config, limits: ConnectionLimits = CONNECTION_DEFAULTS,
                 clock: Callable[[], float] = time.monotonic):
        self.limits = fit_fd_limit(limits)
        self.table = ConnectionTable(self.limits, clock)
        config.http = functools.partial(GuardedH11Protocol, table=self.table)
        config.ws = "none"
        super().__init__(config)
        self.accept_errors = EveryInterval()

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._loop_exception)
        await super().startup(sockets)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        count = self.accept_errors()
        if count is not None:
            log.error("accept() failed (%s), %d times since the last line like this; %d connections are open "
                      "(--max-connections %d)", context.get("exception"), count, len(self.table.open),
                      self.limits.max_connections)
