"""On-demand adapters: a registry, a host tier, the GPU slot pool, and the loads between them.

    registry (name -> directory; metadata only, 10,000s are fine)
      -> host tier: adapters packed as pool slots (LoraPool.pack) into the rows of a HostArena
         (as many as the byte budget holds; page-locked on CUDA), LRU; read and packed on a
         worker thread, off the engine thread
      -> GPU slots of the LoraPool, LRU; one host->device copy on a side CUDA stream, finished
         when its event has completed (no device-wide sync)

The engine calls `acquire` when it wants to admit a request: True (and the slot is held)
when the adapter is resident; otherwise the load is started or advanced and the request
waits in the queue while others run. `poll` advances loads once per step and prefetches the
adapters of the next queued requests. A slot held by an admitted request, pinned, or wanted by
one of the next `max_loras` adapters in the queue is never evicted (so loads never evict each
other before their requests get in).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from punica.config import ModelConfig
from punica.lora.adapter import read_adapter
from punica.lora.pool import LoraPool


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
    instead, in proportion to the budget: 0.5 s for 1 GiB, 1.5 s for the default 4 GiB there.
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

    def give_back(self, row: int) -> None:
        self._free.append(row)


def _unregister(rows: torch.Tensor) -> None:
    _cuda_check(torch.cuda.cudart().cudaHostUnregister(rows.data_ptr()), "cudaHostUnregister")


@dataclass
class _HostAdapter:
    row: int                           # of the arena: the slot's contents
    scale: float


@dataclass
class _Copy:
    slot: int
    event: torch.cuda.Event | None     # None on CPU: the copy was synchronous


class AdapterManager:
    def __init__(self, config: ModelConfig, pool: LoraPool, host_capacity_bytes: int, io_threads: int = 2):
        self.config, self.pool = config, pool
        self.dtype, self.device = pool.buffer.dtype, pool.buffer.device
        row_bytes = math.prod(pool.packed_shape) * pool.buffer.element_size()
        self.arena = HostArena(max(1, host_capacity_bytes // row_bytes), pool.packed_shape, self.dtype,
                               pin=self.device.type == "cuda")
        self.registry: dict[str, Path] = {}
        self.pinned: set[str] = set()
        self.host: OrderedDict[str, _HostAdapter] = OrderedDict()    # least recently used first
        self.resident: OrderedDict[str, int] = OrderedDict()          # name -> slot, LRU first
        self.refs: Counter[str] = Counter()                           # admitted requests per adapter
        self.free_slots = list(range(pool.max_loras - 1, -1, -1))
        self.wanted: dict[str, None] = {}                             # asked for, not resident (in order)
        self.demand: set[str] = set()                                 # adapters of queued requests
        self.reads: dict[str, tuple[Future, int]] = {}               # the read and its arena row
        self.copies: dict[str, _Copy] = {}
        self.failed: dict[str, str] = {}
        self.num_errors = 0  # failed reads and unloads so far: when `error` may have changed
        self.executor = ThreadPoolExecutor(io_threads, thread_name_prefix="punica-lora-io")
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_loads = 0

    # registry ----------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, pinned: bool = False) -> None:
        if not name or name in self.registry:
            raise ValueError(f"adapter name {name!r} is empty or already registered")
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"adapter {name!r}: {path} is not a directory")
        self.registry[name] = path
        self.failed.pop(name, None)
        if pinned:
            self.pinned.add(name)

    def unregister(self, name: str) -> None:
        """Forget an adapter. Its slot is freed once no admitted request holds it."""
        if name not in self.registry:
            raise ValueError(f"unknown adapter {name!r}")
        del self.registry[name]
        self.num_errors += 1
        self.pinned.discard(name)
        self.wanted.pop(name, None)
        if name in self.host and name not in self.copies:  # else its row is freed after the copy
            self.arena.give_back(self.host.pop(name).row)
        if self.refs[name] == 0 and name in self.resident:
            self.free_slots.append(self.resident.pop(name))

    def error(self, name: str) -> str | None:
        """Why the adapter cannot be loaded, or None."""
        if name not in self.registry:
            return f"adapter {name!r} was unloaded"
        return self.failed.get(name)

    # admission ---------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """The adapter's slot, held for one more request, or None while it is being loaded."""
        if name in self.resident:
            self.resident.move_to_end(name)
            self.refs[name] += 1
            return self.resident[name]
        if name in self.registry and name not in self.failed:
            self.wanted[name] = None
            self._advance(name)
        return None

    def release(self, name: str) -> None:
        self.refs[name] -= 1
        if self.refs[name] == 0:
            del self.refs[name]
            if name not in self.registry and name in self.resident:  # unloaded while in use
                self.free_slots.append(self.resident.pop(name))

    def poll(self, demand: list[str]) -> None:
        """Advance every load: finished reads enter the host tier, finished copies the pool.

        `demand`: the adapters of the requests now in the queue, in queue order. The first
        `max_loras` of them are the lookahead: never evicted, and prefetched before their
        requests are considered for admission (read into the host tier, copied into free slots;
        a prefetch never evicts). Adapters wanted only further back stay evictable, so a long
        queue cannot pin every slot.
        """
        lookahead = list(dict.fromkeys(demand))[:self.pool.max_loras]
        self.demand = set(lookahead)
        queued = set(demand)
        self.wanted = {name: None for name in self.wanted if name in queued}
        for name, (future, row) in list(self.reads.items()):
            if future.done():
                del self.reads[name]
                self._read_done(name, future, row)
        for name, copy in list(self.copies.items()):
            if copy.event is None or copy.event.query():
                del self.copies[name]
                if name in self.registry:
                    self.resident[name] = copy.slot
                else:
                    self.free_slots.append(copy.slot)
                    self.arena.give_back(self.host.pop(name).row)
        for name in list(self.wanted):
            self._advance(name)
        spare = len(self.free_slots)  # given out in queue order, also to reads not done yet
        for name in lookahead:
            if (name not in self.registry or name in self.failed or name in self.resident
                    or name in self.copies):
                continue
            if name in self.host:
                if spare > 0:
                    self._start_copy(name, self.free_slots.pop())
            elif name not in self.reads:
                self._start_read(name)
            spare -= 1

    # internals ---------------------------------------------------------------------------
    def _advance(self, name: str) -> None:
        if name in self.resident or name in self.copies or name in self.reads:
            if name in self.resident:
                self.wanted.pop(name, None)
            return
        if name in self.host:
            self.host.move_to_end(name)
            slot = self._free_slot()
            if slot is not None:
                self._start_copy(name, slot)
            return
        self._start_read(name)

    def _start_read(self, name: str) -> None:
        """Read into a free arena row, else into the least recently used host adapter's that is
        neither being copied nor in the lookahead; with none, the read starts at a later poll."""
        row = self.arena.take()
        if row is None:
            victim = next((n for n in self.host if n not in self.copies and n not in self.demand), None)
            if victim is None:
                return
            row = self.host.pop(victim).row
        self.reads[name] = (self.executor.submit(self._read, name, self.registry[name], row), row)

    def _read(self, name: str, path: Path, row: int) -> _HostAdapter:
        adapter = read_adapter(path, self.config, name=name, dtype=self.dtype)
        self.pool.pack(adapter, out=self.arena.rows[row])
        return _HostAdapter(row, adapter.scale)

    def _read_done(self, name: str, future: Future, row: int) -> None:
        try:
            adapter = future.result()
        except Exception as e:  # noqa: BLE001 - any failure fails this adapter's requests only
            self.arena.give_back(row)
            self.failed[name] = str(e)
            self.num_errors += 1
            self.wanted.pop(name, None)
            return
        if name not in self.registry:
            self.arena.give_back(row)
            return
        self.host[name] = adapter
        self.num_loads += 1

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for name in self.resident:  # least recently used first
            if self.refs[name] == 0 and name not in self.pinned and name not in self.demand:
                return self.resident.pop(name)
        return None

    def _start_copy(self, name: str, slot: int) -> None:
        """Copy the adapter's arena row into the slot; the row is not reused until it is done."""
        adapter = self.host[name]
        packed = self.arena.rows[adapter.row]
        if self.copy_stream is None:
            self.pool.write_packed(slot, packed, adapter.scale)
            self.copies[name] = _Copy(slot, None)
            return
        # the slot may still be read by kernels queued earlier on the compute stream
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.pool.write_packed(slot, packed, adapter.scale, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.copies[name] = _Copy(slot, event)
