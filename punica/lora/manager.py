"""On-demand adapters: a registry, a host tier, the GPU slot pool, and the loads between them.

    registry (name -> directory; the config's rank checked at registration, weights not read;
              10,000s are fine)
      -> host tier: adapters packed as pool slots (LoraPool.pack) into the rows of a HostArena
         (as many as the byte budget holds; page-locked on CUDA), LRU; read, checked and packed
         on a worker thread, off the engine thread, so a bad adapter fails there, only its own
         requests failing
      -> GPU slots of the LoraPool, LRU; one host->device copy on a side CUDA stream, finished
         when its event has completed (no device-wide sync)

The engine calls `acquire` when it wants to admit a request: the slot (held until `release`)
when the adapter is resident; otherwise None, the load is started or advanced and the request
waits in the queue while others run. `poll` advances loads once per step and prefetches the
adapters of the next queued requests. A slot held by an admitted request, pinned, or wanted by
one of the next `max_loras` adapters in the queue is never evicted (so loads never evict each
other before their requests get in).

Names are how users and the engine ask; inside, every registration of a name is its own
Registration, the key of the host tier, the slots, the loads and the failures. So after
unregister(name) + register(name, new_path), requests admitted before keep the old adapter's
slot until they leave, new ones load and get the new adapter, and a read or copy of the old one
still in flight is thrown away when it finishes.

Each registration has its counters (punica.lora.residency): loads and evictions per tier, load
time, hits and misses; `snapshot` hands them out with where each adapter is, as plain data.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from punica.config import ModelConfig
from punica.lora.adapter import read_adapter
from punica.lora.adapter_config import adapter_rank, adapter_uses_dora
from punica.lora.host_arena import HostArena, host_tier_rows
from punica.lora.names import check_adapter_name
from punica.lora.pool import LoraPool
from punica.lora.residency import AdapterCounters
from punica.ops.cpu_threads import torch_threads


@dataclass(frozen=True, eq=False)
class Registration:
    """One registration of an adapter, compared and hashed by identity: after `unregister(name)`
    and `register(name, ...)` the name has a new one, and nothing read, copied or held for the
    old one (host row, slot, read or copy in flight) is used for the new one."""
    name: str
    path: Path
    version: int                       # registrations made by the manager before this one
    dora: bool = False                 # its config sets use_dora


@dataclass
class _HostAdapter:
    row: int                           # of the arena: the slot's contents
    scale: float
    dora: bool
    num_bytes: int                     # of its weights as read (AdapterWeights.num_bytes)


@dataclass
class _Copy:
    slot: int
    event: torch.cuda.Event | None     # None on CPU: the copy was synchronous


IO_THREADS = 2  # reader threads: reads from disk into the host tier run this many at once


def reader_threads(device: torch.device, num_threads: int = IO_THREADS) -> ThreadPoolExecutor:
    """The threads that read adapters for a pool on `device`. On a CPU, no OpenMP team beside the
    engine thread's (punica.ops.cpu_threads); on a GPU the engine thread runs little parallel CPU
    work for them to slow, and the readers share the threads torch has (those of the calling
    thread), each its part, so that reads at once do not oversubscribe the cores."""
    share = 1 if device.type == "cpu" else max(1, torch.get_num_threads() // num_threads)
    return ThreadPoolExecutor(num_threads, thread_name_prefix="punica-lora-io", initializer=torch_threads,
                              initargs=(share,))


class AdapterManager:
    def __init__(self, config: ModelConfig, pool: LoraPool, host_capacity_bytes: int | None,
                 io_threads: int = IO_THREADS,
                 adapter_dirs: tuple[str, ...] = ()):
        self.config, self.pool = config, pool
        self.adapter_dirs = adapter_dirs  # an adapter inside one reads only files inside it (read_adapter)
        self.dtype, self.device = pool.buffer.dtype, pool.buffer.device
        self.row_bytes = row_bytes = math.prod(pool.packed_shape) * pool.buffer.element_size()
        rows = host_tier_rows(host_capacity_bytes, pool.max_loras, row_bytes)
        self.arena = HostArena(rows, pool.packed_shape, self.dtype, pin=self.device.type == "cuda")
        self.registry: dict[str, Path] = {}                           # name -> directory
        self.current: dict[str, Registration] = {}                    # name -> its registration
        self._versions = itertools.count()
        # everything below is keyed by Registration (or by slot), never by name
        self.pinned: set[Registration] = set()
        self.host: OrderedDict[Registration, _HostAdapter] = OrderedDict()  # least recently used first
        self.resident: OrderedDict[Registration, int] = OrderedDict()       # -> slot, LRU first
        self.refs: Counter[int] = Counter()                           # slot -> admitted requests holding it
        self.retired: set[int] = set()                                # slots of unregistered adapters still held
        self.free_slots = list(range(pool.max_loras - 1, -1, -1))
        self.wanted: dict[Registration, None] = {}                    # asked for, not resident (in order)
        self.demand: set[Registration] = set()                        # the lookahead of the queue
        self.reads: dict[Registration, tuple[Future, int]] = {}       # the read and its arena row
        self.copies: dict[Registration, _Copy] = {}
        self.failed: dict[Registration, str] = {}
        self.counters: dict[Registration, AdapterCounters] = {}       # of the current registrations
        self.num_bytes: dict[Registration, int] = {}  # of the current registrations read at least once
        self.load_started: dict[Registration, float] = {}             # perf_counter of each read or copy in flight
        self.num_errors = 0  # failed reads and unloads so far: when `error` may have changed
        self.num_load_failures = 0  # reads that failed (a broken adapter directory)
        self.executor = reader_threads(self.device, io_threads)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.num_loads = 0

    # registry ----------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, pinned: bool = False) -> None:
        """Add an adapter under a new name; ValueError for a bad name, a name in use, a path that
        is not a directory, a config that cannot be served or a rank over the pool's."""
        check_adapter_name(name)
        if name in self.registry:
            raise ValueError(f"adapter name {name!r} is already registered")
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"adapter {name!r}: {path} is not a directory")
        rank = adapter_rank(path, self.adapter_dirs)
        if rank > self.pool.max_rank:
            raise ValueError(f"adapter {name!r} has rank {rank}, over this engine's max_lora_rank "
                             f"{self.pool.max_rank} (start it with max_lora_rank / --max-lora-rank >= {rank})")
        registration = Registration(name, path, next(self._versions), adapter_uses_dora(path, self.adapter_dirs))
        self.registry[name], self.current[name] = path, registration
        self.counters[registration] = AdapterCounters()
        if pinned:
            self.pinned.add(registration)

    def unregister(self, name: str) -> None:
        """Forget an adapter. Its slot is freed once no admitted request holds it."""
        if name not in self.registry:
            raise ValueError(f"unknown adapter {name!r}")
        del self.registry[name]
        registration = self.current.pop(name)
        self.num_errors += 1
        self.pinned.discard(registration)
        self.wanted.pop(registration, None)
        self.demand.discard(registration)
        self.failed.pop(registration, None)
        self.num_bytes.pop(registration, None)
        del self.counters[registration]
        if registration in self.host and registration not in self.copies:  # else freed after the copy
            self.arena.give_back(self.host.pop(registration).row)
        slot = self.resident.pop(registration, None)
        if slot is not None:
            if self.refs[slot] == 0:
                self.free_slots.append(slot)
            else:  # freed when the last request holding it leaves
                self.retired.add(slot)

    def error(self, name: str) -> str | None:
        """Why the adapter cannot be loaded, or None."""
        if name not in self.registry:
            return f"adapter {name!r} was unloaded"
        return self.failed.get(self.current[name])

    # admission ---------------------------------------------------------------------------
    def acquire(self, name: str, queued_residency: int | None = None) -> int | None:
        """The slot of the adapter's current registration, held for one more request until
        `release(slot)`, or None while it is being loaded (or unknown, or failed: see `error`).
        A slot returned admits a request: a hit if `queued_residency` (`residency(name)` when the
        request was queued) is the GPU residency it finds, else a miss."""
        registration = self.current.get(name)
        if registration is None:
            return None
        slot = self.resident.get(registration)
        if slot is not None:
            self.resident.move_to_end(registration)
            self.refs[slot] += 1
            self.counters[registration].admitted(queued_residency)
            return slot
        if registration not in self.failed:
            self.wanted[registration] = None
            self._advance(registration)
        return None

    def residency(self, name: str | None) -> int | None:
        """A number for the adapter's current stay on the GPU (its count of copies to the GPU so far,
        which grows only after it left), or None when it is not on the GPU (or `name` is None)."""
        registration = self.current.get(name)
        if registration is None or registration not in self.resident:
            return None
        return self.counters[registration].loads["gpu"]

    def release(self, slot: int) -> None:
        """Let go of a slot `acquire` returned; an unregistered adapter's slot is freed with its last holder."""
        if self.refs[slot] <= 0:
            raise ValueError(f"slot {slot} is not held by any request")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            del self.refs[slot]
            if slot in self.retired:
                self.retired.remove(slot)
                self.free_slots.append(slot)

    def poll(self, demand: list[str]) -> None:
        """Advance every load: finished reads enter the host tier, finished copies the pool.

        `demand`: the adapters of the requests now in the queue, in queue order. The first
        `max_loras` registered ones are the lookahead: never evicted, and prefetched before their
        requests are considered for admission (read into the host tier, copied into free slots;
        a prefetch never evicts). Adapters wanted only further back stay evictable, so a long
        queue cannot pin every slot.
        """
        queued = [self.current[name] for name in dict.fromkeys(demand) if name in self.current]
        lookahead = queued[:self.pool.max_loras]
        self.demand = set(lookahead)
        in_queue = set(queued)
        self.wanted = {registration: None for registration in self.wanted if registration in in_queue}
        for registration, (future, row) in list(self.reads.items()):
            if future.done():
                del self.reads[registration]
                self._read_done(registration, future, row)
        for registration, copy in list(self.copies.items()):
            if copy.event is None or copy.event.query():
                del self.copies[registration]
                started = self.load_started.pop(registration)
                if self._is_current(registration):
                    self.resident[registration] = copy.slot
                    self.counters[registration].loaded("gpu", time.perf_counter() - started)
                else:
                    self.free_slots.append(copy.slot)
                    self.arena.give_back(self.host.pop(registration).row)
        for registration in list(self.wanted):
            self._advance(registration)
        spare = len(self.free_slots)  # given out in queue order, also to reads not done yet
        for registration in lookahead:
            if registration in self.failed or registration in self.resident or registration in self.copies:
                continue
            if registration in self.host:
                if spare > 0:
                    self._start_copy(registration, self.free_slots.pop())
            elif registration not in self.reads:
                self._start_read(registration)
            spare -= 1

    def snapshot(self) -> dict:
        """Where every registered adapter is and what it has counted, as plain data (JSON-ready):
        {"gpu_slots": {"total", "used" (holding an adapter), "held" (by admitted requests)},
         "host_tier": {"adapters", "bytes_used", "bytes_limit"},
         "adapters": {name: {"path", "tier" ("gpu", "host" or "disk"), "slot" (its GPU slot or None),
                             "loading" (the tier a read or copy in flight goes to, or None), "pinned",
                             "error" (why it cannot load, or None), "bytes" (of its weights as read, in
                             the pool's dtype: attention and experts alike; None before its first
                             read), and AdapterCounters.as_dict()}}}"""
        adapters = {}
        for name, registration in self.current.items():
            slot = self.resident.get(registration)
            tier = "gpu" if slot is not None else "host" if registration in self.host else "disk"
            loading = "gpu" if registration in self.copies else "host" if registration in self.reads else None
            adapters[name] = {"path": str(registration.path), "tier": tier, "slot": slot, "loading": loading,
                              "pinned": registration in self.pinned, "error": self.failed.get(registration),
                              "bytes": self.num_bytes.get(registration),
                              **self.counters[registration].as_dict()}
        rows = self.arena.rows.shape[0]
        return {"gpu_slots": {"total": self.pool.max_loras, "used": len(self.resident), "held": len(self.refs)},
                "host_tier": {"adapters": len(self.host), "bytes_used": (rows - self.arena.num_free) * self.row_bytes,
                              "bytes_limit": rows * self.row_bytes},
                "adapters": adapters}

    def held(self) -> list[str]:
        """Names of the adapters on the GPU or on their way there: resident (least recently used
        first), then those being copied, then those being read."""
        return [r.name for group in (self.resident, self.copies, self.reads) for r in group if self._is_current(r)]

    # internals ---------------------------------------------------------------------------
    def _is_current(self, registration: Registration) -> bool:
        return self.current.get(registration.name) is registration

    def _advance(self, registration: Registration) -> None:
        if registration in self.resident or registration in self.copies or registration in self.reads:
            if registration in self.resident:
                self.wanted.pop(registration, None)
            return
        if registration in self.host:
            self.host.move_to_end(registration)
            slot = self._free_slot()
            if slot is not None:
                self._start_copy(registration, slot)
            return
        self._start_read(registration)

    def _start_read(self, registration: Registration) -> None:
        """Read into a free arena row, else into the least recently used host adapter's that is
        neither being copied nor in the lookahead; with none, the read starts at a later poll."""
        row = self.arena.take()
        if row is None:
            victim = next((r for r in self.host if r not in self.copies and r not in self.demand), None)
            if victim is None:
                return
            row = self.host.pop(victim).row
            self.counters[victim].evictions["host"] += 1
        self.load_started[registration] = time.perf_counter()
        self.reads[registration] = (self.executor.submit(self._read, registration, row), row)

    def _read(self, registration: Registration, row: int) -> _HostAdapter:
        """On a worker thread: everything that can fail for a bad adapter fails here, not in the
        engine's step (read_adapter bounds the weights and the scale, which float32 then holds;
        pack refuses a rank over the pool's)."""
        adapter = read_adapter(registration.path, self.config, name=registration.name, dtype=self.dtype,
                               adapter_dirs=self.adapter_dirs, max_rank=self.pool.max_rank)
        self.pool.pack(adapter, out=self.arena.rows[row])
        return _HostAdapter(row, adapter.scale, adapter.dora, adapter.num_bytes)

    def _read_done(self, registration: Registration, future: Future, row: int) -> None:
        started = self.load_started.pop(registration)
        try:
            adapter = future.result()
        except Exception as e:  # noqa: BLE001 - any failure fails this adapter's requests only
            self.arena.give_back(row)
            self.num_load_failures += 1
            if self._is_current(registration):
                self.failed[registration] = str(e)
                self.num_errors += 1
                self.wanted.pop(registration, None)
            return
        if not self._is_current(registration):  # unregistered while it was read
            self.arena.give_back(row)
            return
        self.host[registration] = adapter
        self.num_bytes[registration] = adapter.num_bytes
        self.num_loads += 1
        self.counters[registration].loaded("host", time.perf_counter() - started)

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for registration, slot in self.resident.items():  # least recently used first
            if self.refs[slot] == 0 and registration not in self.pinned and registration not in self.demand:
                self.counters[registration].evictions["gpu"] += 1
                return self.resident.pop(registration)
        return None

    def _start_copy(self, registration: Registration, slot: int) -> None:
        """Copy the adapter's arena row into the slot; the row is not reused until it is done. A
        copy that cannot start (a tensor-parallel rank that died, say) fails this adapter alone."""
        adapter = self.host[registration]
        packed = self.arena.rows[adapter.row]
        self.load_started[registration] = time.perf_counter()
        try:
            if self.copy_stream is None:
                self.pool.write_packed(slot, packed, adapter.scale, dora=adapter.dora)
                self.copies[registration] = _Copy(slot, None)
                return
            # the slot may still be read by kernels queued earlier on the compute stream
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self.pool.write_packed(slot, packed, adapter.scale, non_blocking=True, dora=adapter.dora)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
        except Exception as e:  # noqa: BLE001 - this adapter's requests fail; the others go on
            del self.load_started[registration]
            self.free_slots.append(slot)
            self.failed[registration] = f"adapter {registration.name!r} could not be copied to its GPU slot: {e}"
            self.num_errors += 1
            self.wanted.pop(registration, None)
            return
        self.copies[registration] = _Copy(slot, event)
