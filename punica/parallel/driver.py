"""Rank 0's handle on its tensor-parallel workers: start them, message them, notice failures, stop them.

The calling process becomes rank 0 of the default process group (gloo on CPU, NCCL on GPUs,
rank r on cuda:r) and spawns ranks 1..N-1 (punica.parallel.worker), each with a pipe from
rank 0. Messages go through the pipes; tensors cross ranks only in the model's collectives.
Pipes fit a server that may idle for days: an idle worker waits on its pipe with no
collective pending (so nothing times out), and learns that rank 0 is gone from the pipe's EOF.

A worker that dies or fails puts the group out of step for good: every later `send` (and so
every later engine step) raises WorkerError naming the rank, its exit code and its error. A
worker that hangs inside a collective makes rank 0's side of it time out after `timeout_s`.
"""

from __future__ import annotations

import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from punica.config import EngineConfig
from punica.models.loader import DummyWeights
from punica.parallel.launcher import init_rank, parent_main_not_rerun
from punica.parallel.worker import worker_main

STOP_WAIT_S = 10.0  # a worker told to stop has this long before it is terminated


class WorkerError(RuntimeError):
    """A tensor-parallel rank died or failed; the group is out of step and cannot run on."""


class Workers:
    def __init__(self, world_size: int, backend: str, source: str | Path | DummyWeights, dtype: torch.dtype,
                 config: EngineConfig, timeout_s: float, quantization: str = "none"):
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed process group; "
                             "it can be rank 0 of only one tensor-parallel engine at a time")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.failure: str | None = None
        workdir = tempfile.TemporaryDirectory(prefix="punica-tp-")
        self._stop = weakref.finalize(self, _shut_down, self.processes, self.conns, workdir)
        try:
            context = mp.get_context("spawn")
            for rank in range(1, world_size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=worker_main, name=f"punica-tp-rank-{rank}", daemon=True,
                    args=(rank, world_size, backend, workdir.name, theirs, source, dtype, config, timeout_s,
                          quantization))
                with parent_main_not_rerun():  # it may be no file (stdin) or build this engine again
                    process.start()
                theirs.close()  # the worker's end lives in the worker: its death closes the pipe
                self.processes.append(process)
                self.conns.append(ours)
            for rank in range(1, world_size):
                self._receive(rank, "started")
            self.device = init_rank(0, world_size, backend, workdir.name, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Tell the workers to leave, wait for them (terminating stragglers), leave the group. Idempotent."""
        self._stop()

    def agree(self, value: int) -> int:
        """The least of rank 0's `value` and each worker's first message ("ready", value), sent back to all."""
        values = [value] + [self._receive(rank, "ready") for rank in range(1, self.world_size)]
        self.send(("start", min(values)))
        return min(values)

    def send(self, message: tuple, payloads: list[Any] | None = None) -> None:
        """Send `message` to every worker, each followed by its own payload (a buffer), if given."""
        self.check()
        try:
            for i, conn in enumerate(self.conns):
                conn.send(message)
                if payloads is not None:
                    conn.send_bytes(payloads[i])
        except OSError as e:
            raise self.fail(e) from e

    def check(self) -> None:
        """Raise WorkerError if a worker has died or the group failed earlier."""
        if self.failure is None and not all(p.is_alive() for p in self.processes):
            self.fail()
        if self.failure is not None:
            raise WorkerError(self.failure)

    def fail(self, cause: BaseException | None = None) -> WorkerError:
        """Mark the group failed (for good) and return the error that says why."""
        if self.failure is None:
            self.failure = self._describe(cause)
        return WorkerError(self.failure)

    # internals ---------------------------------------------------------------------------
    def _receive(self, rank: int, kind: str) -> Any:
        """The value of rank `rank`'s next message, which must be `kind` (start-up only)."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(0.5):
            if not process.is_alive():
                raise self.fail()
            if time.monotonic() > deadline:
                raise self.fail(TimeoutError(f"rank {rank} sent no {kind!r} within {self.timeout_s} s"))
        try:
            got, value = conn.recv()
        except EOFError:
            raise self.fail() from None
        if got != kind:
            self.failure = f"tensor-parallel rank {rank} failed while starting:\n{value}"
            raise WorkerError(self.failure)
        return value

    def _describe(self, cause: BaseException | None) -> str:
        problems = []
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            process.join(1.0 if cause is not None else 0)  # a rank whose socket just closed is exiting
            if process.is_alive():
                continue
            problem = f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
            report = _error_report(conn)
            problems.append(problem + (f"; its error:\n{report}" if report else ""))
        if not problems:
            problems.append(f"rank 0: {type(cause).__name__}: {cause}")
        return "tensor-parallel group failed, the ranks are out of step: " + "; ".join(problems)


def _error_report(conn: Connection) -> str | None:
    """The traceback a failed worker sent before exiting, if it could."""
    try:
        while conn.poll(0):
            kind, value = conn.recv()
            if kind == "error":
                return value.strip()
    except (EOFError, OSError):
        pass
    return None


def _shut_down(processes: list[mp.Process], conns: list[Connection], workdir: tempfile.TemporaryDirectory) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except OSError:
            pass
    if dist.is_initialized():
        dist.destroy_process_group()  # a worker stuck in a collective with rank 0 now fails out of it
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join()
    for conn in conns:
        conn.close()
    workdir.cleanup()
