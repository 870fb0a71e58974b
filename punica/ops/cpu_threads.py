"""Threads beside the engine's that run torch's CPU ops without OpenMP workers of their own.

torch's CPU ops run their parallel parts on OpenMP; GNU libgomp keeps a team of workers for each
thread that has run parallel work, and once the process holds more such workers than it has cores,
every team's workers sleep between parallel regions instead of spinning, so each region of an
engine step waits for them to wake. On a 2-core CPU a decode step of the embedded model took 50 ms
instead of 33 while one more thread's team existed (the thread that had loaded an adapter).
Threads that read and check tensors beside an engine running on the CPU (adapter loads) call
`serial_torch()` first: their ops then run on the calling thread alone and make no team. Several
such threads beside an engine on a GPU share the host's cores instead (`torch_threads`): each
with a team as large as the engine thread's, two reads of a 1.29 GB adapter at once took 1.0-1.46 s
each on a 16-core host, against 0.3 s for one alone.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _omp_set_num_threads():
    """The process's omp_set_num_threads (the OpenMP runtime that torch loaded), or None."""
    return getattr(ctypes.CDLL(None), "omp_set_num_threads", None)


def torch_threads(num_threads: int) -> None:
    """Make this thread's torch CPU ops run their parallel regions on teams of `num_threads`
    (OpenMP's count is the calling thread's own; other threads keep theirs); where no OpenMP
    runtime is loaded, there are no teams to size."""
    torch.get_num_threads()  # torch sets each thread's OpenMP thread count at its first use: before ours
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(num_threads)


def serial_torch() -> None:
    """Make this thread's torch CPU ops run without parallel regions (module docstring)."""
    torch_threads(1)
