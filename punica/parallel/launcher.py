"""Start N ranks on this machine and return rank 0's result.

Each rank is a process (torch.multiprocessing spawn) in one process group: gloo on CPU, NCCL
on GPUs (rank r uses cuda:r). The rendezvous is a FileStore in a private temporary directory,
so nothing listens on a TCP port for it and no port can be taken by another run; gloo's and
NCCL's own sockets are bound to the loopback interface. Every rank runs `fn(group, *args)`,
which must issue the same collectives in the same order on every rank (lockstep).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_MAIN_SWAP = threading.Lock()


@contextmanager
def parent_main_not_rerun() -> Iterator[None]:
    """Processes started (spawn) inside this block do not run the parent's __main__ again.

    multiprocessing's spawn runs the parent's main script (or module) once more in each child,
    before it unpickles the child's target, so that functions defined there can be found. A rank
    runs only punica's code, and the parent's main may be no file at all (`python - < script.py`
    names it "<stdin>", which the child cannot open) or a script without an `if __name__ ==
    "__main__":` guard, whose engine each rank would build again. A process takes its preparation
    data from sys.modules["__main__"] as it starts; a bare module stands in for the parent's main
    meanwhile, so the child keeps its own main."""
    with _MAIN_SWAP:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def init_rank(rank: int, world_size: int, backend: str, workdir: str | Path, timeout_s: float) -> torch.device:
    """Join this process to the default group as `rank` (rendezvous in `workdir`); its device.

    NCCL: rank r uses cuda:r, made the current device. Collectives time out after `timeout_s`.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    store = dist.FileStore(str(Path(workdir) / "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return device


def exit_after_clean_stop() -> NoReturn:
    """End a rank's process that has stopped cleanly and left its group, without the interpreter's
    teardown: under load a C++ destructor there now and then aborted a process whose group was
    already gone ("terminate called without an active exception", exit code -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, backend: str, workdir: str,
               timeout_s: float, args: tuple) -> None:
    init_rank(rank, world_size, backend, workdir, timeout_s)
    try:
        result = fn(dist.group.WORLD, *args)
        if rank == 0:
            torch.save(result, Path(workdir) / "result.pt")
    finally:
        dist.destroy_process_group()
    exit_after_clean_stop()  # a rank that raised goes on to the spawn wrapper, which reports the error


def run_parallel(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
                 timeout_s: float = 600.0) -> Any:
    """Run fn(group, *args) on `world_size` ranks in lockstep; return rank 0's (torch.save-able) result.

    A rank that raises makes this raise (the others are terminated); after `timeout_s` every
    rank is terminated and TimeoutError raised. `fn` must be importable (a module-level function).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory(prefix="punica-tp-") as workdir:
        context = mp.start_processes(_rank_main, args=(fn, world_size, backend, workdir, timeout_s, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks still running after {timeout_s} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                process.join()
        return torch.load(Path(workdir) / "result.pt")
