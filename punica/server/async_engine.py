"""AsyncEngine: one background thread drives the synchronous Engine; each request has its own stream.

Every Engine call happens on that thread. The asyncio side sends commands (add, abort,
load/unload adapter) through a queue and awaits their result; outputs come back to each
request's asyncio.Queue. A request's grammar is compiled before its add is sent (by the engine's
GrammarPool, on threads of its own), so a request waiting for its grammar holds no place in the
engine, and one whose client goes away meanwhile never enters it. It counts toward its tenant's
max_concurrent_requests all the same: the cap is checked here, before any grammar compiles,
counting each tenant's requests from the start of their `generate` to their last output (the
engine checks it again when it adds one). A failure inside a step fails the requests of that step
(each gets a finished output with finish_reason "error"), and the loop keeps serving the others.
Every finished output, whether a step, an abort or a failure ended the request, goes to
`on_finished` exactly once.

The engine is built on that thread too, so that no other thread of the process keeps an OpenMP
team for torch's CPU ops (punica.ops.cpu_threads): built on the main thread (its weights packed,
its GEMM paths timed and its latency budget calibrated there), it left the main thread a team, and
a decode step of the embedded model on a 2-core CPU took 50 ms through the server against 33 ms on
the engine alone. On a CPU, an adapter read here to check it, beside the engine thread, runs its
torch ops serially for the same reason."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from punica.engine.engine import Engine, RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import DEFAULT_SHARE, TenantLimitError, TenantShare, checked_shares, tenant_key
from punica.lora.adapter import load_adapter
from punica.ops.cpu_threads import serial_torch
from punica.server.residency import engine_listing

log = logging.getLogger("punica.server")
IDLE_WAIT_S = 0.05


def _read_serially(*args, **kwargs) -> None:
    """load_adapter on a thread beside the engine's, its torch ops without an OpenMP team of that
    thread's (punica.ops.cpu_threads)."""
    serial_torch()
    load_adapter(*args, **kwargs)


class AsyncEngine:
    STOP_TIMEOUT_S = 10.0
    engine: Engine  # set by the engine thread, which builds it, before the constructor returns

    def __init__(self, build: Callable[[], Engine],
                 on_step: Callable[[Engine, list[RequestOutput], float], None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None):
        """`build` makes the engine, on the engine thread (module docstring); what it raises, this
        raises."""
        self.on_step = on_step          # after each step: (engine, the step's outputs, seconds)
        self.on_finished = on_finished  # each request's finished output, on the engine thread
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._shares: dict[str, TenantShare] = {}
        self._num_in_flight: Counter[str | None] = Counter()  # per tenant (tenant_key): what its cap counts
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="punica-engine", daemon=True)
        self._thread.start()
        built.result()
        # made now, not by the first constrained request on the event loop
        self._grammars = self.engine.grammars.pool if self.engine.tokenizer is not None else None

    # asyncio side ------------------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between steps and return its result (or raise its error)."""
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                       request_id: str, *, tenant: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; the last has finished=True. Raises ValueError
        for a request the engine rejects (TenantLimitError, before its grammar compiles, for one
        whose tenant has its max_concurrent_requests). Leaving the iteration early aborts the request."""
        self.check_room(tenant, adapter)
        key = tenant_key(tenant, adapter)
        self._num_in_flight[key] += 1
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            grammar = None
            if params.structured_outputs is not None:  # compiled before the request enters the engine
                pool = self._grammars or self.engine.grammars.pool  # a ValueError without a tokenizer
                grammar = await pool.compiled(params.structured_outputs)
            await self.call(lambda: self.engine.add_request(prompt, params, adapter, request_id, tenant=tenant,
                                                            cache_salt=cache_salt, grammar=grammar))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished:  # before the caller can answer it, and its client send the next request
                    self._leave(key)
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # also when cancelled while being added: the abort runs after the add
                self._leave(key)
                self._abort_soon(request_id)

    def check_room(self, tenant: str | None, adapter: str | None) -> None:
        """TenantLimitError when the tenant has its max_concurrent_requests in generate already."""
        key = tenant_key(tenant, adapter)
        limit = self._shares.get(key, DEFAULT_SHARE).max_concurrent_requests
        if limit is not None and self._num_in_flight[key] >= limit:
            raise TenantLimitError(key, limit)

    def _leave(self, key: str | None) -> None:
        self._num_in_flight[key] -= 1
        if not self._num_in_flight[key]:
            del self._num_in_flight[key]

    async def abort(self, request_id: str) -> None:
        await self.call(lambda: self._abort(request_id))

    def _abort_soon(self, request_id: str) -> None:
        """Queue the abort without waiting for it: safe in a cancelled task, and with a hung engine."""
        self._commands.put((lambda: self._abort(request_id), Future()))

    # what the server asks of its backend besides generate/abort (see ClusterBackend too) ----
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def has_adapter(self, name: str) -> bool:
        return self.engine.has_adapter(name)

    async def adapter_residency(self) -> dict:
        return engine_listing(await self.call(self.engine.adapter_snapshot))

    def num_waiting(self) -> int:
        """Requests queued in the engine, and those waiting for their grammars to enter it."""
        return self.engine.stats().num_waiting + (self._grammars.num_waiting if self._grammars is not None else 0)

    async def load_adapter(self, name: str, path: str) -> None:
        """Read the adapter once (so a broken one fails here, one over the engine's rank before its
        tensors are read), then register it."""
        config = self.engine.config
        read = _read_serially if self.engine.on_cpu else load_adapter
        await asyncio.to_thread(read, path, self.engine.model_config, name, adapter_dirs=config.adapter_dirs,
                                max_rank=config.max_lora_rank)
        await self.call(lambda: self.engine.load_adapter(name, path))

    async def unload_adapter(self, name: str) -> None:
        await self.call(lambda: self.engine.unload_adapter(name))

    async def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        await self.call(lambda: self.engine.set_tenants(shares))
        self._shares = checked_shares(shares)

    def update_gauges(self, metrics) -> None:
        metrics.update_gauges(self.engine)

    async def start(self) -> None:
        """Nothing to do: the engine thread runs from construction."""

    async def shutdown(self) -> None:
        """Stop the engine thread after its current step. A step that does not end within
        STOP_TIMEOUT_S is left behind (the thread is a daemon), so a hung engine cannot keep
        the server from exiting."""
        self._stop.set()
        await asyncio.to_thread(self._thread.join, self.STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %g s (a step hangs); exiting without it",
                      self.STOP_TIMEOUT_S)

    # engine thread -----------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Outputs to their streams, the finished ones to on_finished first (so a client that has
        its answer finds it counted). Exactly once each: the engine forgets a request when it
        hands out its finished output."""
        for out in outputs:
            if out.finished and self.on_finished is not None:
                self.on_finished(out)
            self._deliver(out.request_id, out)

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)  # None for a request already finished
        if out is not None:
            self._emit([out])

    def _run_commands(self, wait: float) -> None:
        try:
            fn, future = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # noqa: BLE001 - raised by the constructor
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            self._serve()
        finally:
            self.engine.close()  # a tensor-parallel engine's worker processes

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._run_commands(0 if busy else IDLE_WAIT_S)
            if not self.engine.has_unfinished():
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("engine step failed")
                self._fail_running(e)
                continue
            self._emit(outputs)
            if self.on_step is not None:
                self.on_step(self.engine, outputs, time.perf_counter() - start)

    def _fail_running(self, error: Exception) -> None:
        message = f"internal error while generating: {error}"
        failed = []
        for request_id in self.engine.running_request_ids():
            out = self.engine.abort(request_id)
            if out is not None:
                failed.append(dataclasses.replace(out, finish_reason="error", error=message))
        self._emit(failed)
