"""The host tier's memory: one arena of rows, each an adapter packed as a pool slot
(punica.lora.manager keeps what is in them), and how many rows it has by default.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

MIN_HOST_BYTES = 4 << 30   # the default host tier holds at least this much (~50 Llama-2-7B adapters of rank 16)
HOST_MEMORY_SHARE = 4      # and takes at most 1 / this of the host's memory
# a container's memory limit (cgroup v2, then v1): "max" or a huge number where there is none
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # an entry per GPU of the host, whatever CUDA_VISIBLE_DEVICES says


def host_memory_bytes() -> int:
    """The memory this process may use: the host's physical memory, or its container's limit where
    lower."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_MEMORY_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            memory = min(memory, int(limit))
    return memory


def gpus_on_host() -> int:
    """The host's NVIDIA GPUs, at least 1: the engines of one host (a Ray worker a GPU) share its
    memory."""
    try:
        return max(1, sum(1 for _ in NVIDIA_GPUS.iterdir()))
    except OSError:
        return 1


def host_tier_rows(capacity_bytes: int | None, slots: int, row_bytes: int) -> int:
    """Adapters the host tier holds: as many as `capacity_bytes` fits, at least one. By default
    (None) room for as many as the GPU has slots, and at least MIN_HOST_BYTES, within this GPU's
    part (gpus_on_host) of a HOST_MEMORY_SHARE-th of the host's memory (host_memory_bytes). The
    queue's adapters are read ahead into free rows, so with fewer rows than slots, slots wait on
    reads that could have run ahead. An adapter on every expert of a mixture-of-experts model
    takes 1.3 GB (rank 16, Qwen3-30B-A3B): 4 GiB would hold 3."""
    if capacity_bytes is None:
        share = host_memory_bytes() // (HOST_MEMORY_SHARE * gpus_on_host())
        capacity_bytes = min(max(MIN_HOST_BYTES, slots * row_bytes), share)
    return max(1, capacity_bytes // row_bytes)


def _cuda_check(error: int, call: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"{call} failed with cudaError {int(error)}")


class HostArena:
    """The host tier's memory, allocated once: `rows` [num_rows, *row_shape], handed out by
    `take` and `give_back`.

    With `pin`, the whole arena is page-locked in place (cudaHostRegister) when it is made, so
    copies from it to the GPU are asynchronous. Page-locking holds a driver-wide lock that
    stalls every CUDA call of the process, the engine's steps too, for as long as it runs: on
    the H200 host, ~70 ms for each 80 MB adapter pinned while serving (through PyTorch's pinned
    allocator, which also rounds 80 MB up to 128 MB). Done once here, it costs start-up time
    instead, in proportion to the budget: 0.5 s for 1 GiB, 1.5 s for 4 GiB there (the least the
    default holds; host_tier_rows).
    """

    def __init__(self, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        self.rows = torch.empty((num_rows, *row_shape), dtype=dtype)
        self._free = list(range(num_rows - 1, -1, -1))
        if pin:
            cudart = torch.cuda.cudart()
            _cuda_check(cudart.cudaHostRegister(self.rows.data_ptr(), self.rows.nbytes, 0), "cudaHostRegister")
            # unregistered before the memory is freed: the finalizer holds the tensor until then
            weakref.finalize(self, _unregister, self.rows)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def give_back(self, row: int) -> None:
        self._free.append(row)


def _unregister(rows: torch.Tensor) -> None:
    _cuda_check(torch.cuda.cudart().cudaHostUnregister(rows.data_ptr()), "cudaHostUnregister")
