"""GrammarPool: grammars compiled on threads of their own, under a time limit, through a bounded cache.

Nothing a tenant sends compiles on the thread that runs engine steps: the server awaits `compiled`
(its event loop is free meanwhile) and hands the engine the compiled grammar. xgrammar releases the
GIL while it compiles (measured: a Python loop beside a 13 s compile in a thread runs as fast as
beside the same compile in another process), so a compile thread takes a core, not the engine's
thread; the compile threads run at a lower priority (COMPILE_NICENESS), so that where cores are
short the engine's steps go first. Threads, not processes: a compiled grammar crosses processes only
as xgrammar's JSON serialization, which is far slower than compiling (a 700-property schema: 0.6 s
to compile, 97 s and 818 MB to serialize; four tools of 50 arguments: 29 ms, 1.3 s and 34 MB).

A thread cannot be stopped: a compile past the time limit is answered with GrammarError at the
limit, and goes on to its end (its grammar then serves a later request from the cache); one not
started yet is dropped when the last request waiting for it goes away. The limits that
punica.engine.constraint checks first bound how long a compile can run.

The cache maps each canonical source (punica.engine.constraint.GrammarSource) to its compile, done
or running: requests for the same grammar share one compile. Finished grammars leave it, least
recently used first, once they take more than `max_cache_bytes`; so do refused ones (kept so that
a grammar xgrammar rejects is not compiled again at every retry).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from punica.engine.constraint import GrammarError, GrammarLimits, GrammarSource, checked_source, rejected
from punica.engine.sampling_params import StructuredOutputs

COMPILE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))  # compiles at once: half the cores at most
CACHE_BYTES = 256 << 20
COMPILE_NICENESS = 10  # a compile thread's niceness on Linux: where cores are short, engine steps go first


@dataclass(eq=False)
class _Compile:
    """One grammar's compile, shared by the requests waiting for it."""
    future: concurrent.futures.Future | None = None
    started_at: float | None = None  # time.monotonic() when a thread took it up
    num_waiting: int = 0
    num_bytes: int = 0               # what it holds in the cache, once done


class GrammarPool:
    """Compiles `compile_source(source) -> compiled grammar` (ValueError: the grammar engine refuses
    it) on `num_threads` threads; counts the compiles it ran and their time."""

    def __init__(self, compile_source: Callable[[GrammarSource], object], limits: GrammarLimits,
                 num_threads: int = COMPILE_THREADS, max_cache_bytes: int = CACHE_BYTES):
        self.limits, self.max_cache_bytes = limits, max_cache_bytes
        self._compile_source = compile_source
        self._executor = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="punica-grammar",
                                                               initializer=_lower_priority)
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSource, _Compile] = OrderedDict()
        self._num_cached_bytes = 0
        self.num_waiting = 0         # callers waiting for a compile
        self.num_compiles = 0        # started
        self.compile_seconds = 0.0   # of the finished ones

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec`, waiting on this thread; GrammarError if it is over the
        limits, refused, or not compiled within the time limit."""
        source, job = self._join(spec)
        try:
            while not job.future.done():
                concurrent.futures.wait([job.future], timeout=self._time_left(spec, job))
            return self._result(spec, job.future.result())
        finally:
            self._leave(source, job)

    async def compiled(self, spec: StructuredOutputs):
        """As `compile`, awaited: this event loop's thread waits for nothing. Cancelling the caller
        (its client went away) drops the compile if no other request waits for it and it has not
        started."""
        source, job = self._join(spec)
        done = asyncio.wrap_future(job.future)  # never cancelled: that would cancel the shared compile
        try:
            while not job.future.done():
                await asyncio.wait([done], timeout=self._time_left(spec, job))
            return self._result(spec, job.future.result())
        finally:
            if not done.done():
                done.add_done_callback(_retrieve)
            self._leave(source, job)

    def cache_size(self) -> tuple[int, int]:
        """(compiles done in the cache, bytes they hold); those still running are not counted."""
        with self._lock:
            return sum(job.future.done() for job in self._cache.values()), self._num_cached_bytes

    def close(self) -> None:
        """Drop the compiles not started; those running finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------
    def _join(self, spec: StructuredOutputs) -> tuple[GrammarSource, _Compile]:
        source = checked_source(spec, self.limits)
        with self._lock:
            job = self._cache.get(source)
            if job is None:
                job = self._cache[source] = _Compile()
                job.future = self._executor.submit(self._run, source, job)
            else:
                self._cache.move_to_end(source)
            job.num_waiting += 1
            self.num_waiting += 1
        return source, job

    def _leave(self, source: GrammarSource, job: _Compile) -> None:
        with self._lock:
            job.num_waiting -= 1
            self.num_waiting -= 1
            if job.num_waiting == 0 and job.future.cancel():  # only a compile not started yet cancels
                if self._cache.get(source) is job:
                    del self._cache[source]

    def _time_left(self, spec: StructuredOutputs, job: _Compile) -> float:
        """Seconds the caller may still wait; GrammarError once the compile has run past the limit. A
        compile still queued behind others has not started its time: the wait is the whole limit, then
        looked at again."""
        limit = self.limits.max_compile_seconds
        if job.started_at is None:
            return limit
        left = job.started_at + limit - time.monotonic()
        if left <= 0:
            raise GrammarError(spec.kind, f"took longer than {limit:g} s to compile, this server's limit "
                                          f"(--max-grammar-compile-seconds)")
        return left

    @staticmethod
    def _result(spec: StructuredOutputs, result):
        if isinstance(result, ValueError):
            raise rejected(spec.kind, str(result))
        return result

    def _run(self, source: GrammarSource, job: _Compile):
        """On a pool thread: the compiled grammar, or the ValueError of a refused one (a result, so that
        each waiter raises its own); then the cache is trimmed to its bound."""
        job.started_at = time.monotonic()
        with self._lock:
            self.num_compiles += 1
        result = None
        try:
            result = self._compile_source(source)
        except ValueError as e:
            result = e
        finally:
            with self._lock:
                self.compile_seconds += time.monotonic() - job.started_at
                self._keep(source, job, result)
        return result

    def _keep(self, source: GrammarSource, job: _Compile, result) -> None:
        """Count what a finished compile holds (the grammar's memory, the key's text), and drop the least
        recently used finished grammars while the cache is over its bound (under the lock)."""
        job.num_bytes = len(source.text) + getattr(result, "memory_size_bytes", 0)
        self._num_cached_bytes += job.num_bytes
        for old_source, old in list(self._cache.items()):
            if self._num_cached_bytes <= self.max_cache_bytes:
                break
            if old is not job and old.future.done():
                del self._cache[old_source]
                self._num_cached_bytes -= old.num_bytes


def _lower_priority() -> None:
    """Make this (compile) thread yield its core to the engine's under contention: on Linux a thread's
    niceness is its own (setpriority of its thread id); elsewhere nothing changes."""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        except OSError:  # not allowed here: the thread keeps the process's priority
            pass


def _retrieve(future: asyncio.Future) -> None:
    """Read a result nobody awaits any more, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
