"""Discrete-event simulation of a GPU cluster running a placement policy (torch-free).

The policy objects are the ones the Ray backend uses. Each GPU runs continuous-batching steps
whose duration comes from a `StepTimeModel`. Between changes of its batch, a GPU's steps form
a *segment* whose step times are known in closed form (context grows by one token per request
per step), so the simulator schedules only the segment's end: the next finish or the step
that runs out of KV cache (evicting the newest request). A request placed on a busy GPU joins
the step in flight (its prefill is charged to that step). Arrivals, segment ends, GPU start-ups
and samples for the time series run through one heap, so 1M requests on 1,000 GPUs take
minutes in one process.

Adapters: every GPU has `policy_config.max_loras` slots and a host tier of `host_tier_adapters`
adapters (LRU). A request placed on a GPU that lacks its adapter waits (holding its batch slot
and prompt KV) for the load: the model's `adapter_load_s`, plus `adapter_read_s` when the adapter
is not in that GPU's host tier; then it joins the step in flight like any placed request. The
report sets each run's loads beside `ideal_cache_loads` of the slots the run held (max_loras x
GPUs held at each arrival).

A request whose prompt + output exceeds one GPU's KV cache could never finish anywhere: it is
refused on arrival (`num_rejected` in the report; the latencies are of the served requests). Should
requests still wait when nothing is left to run, load or start, the run ends with a RuntimeError
naming them rather than simulate an idle cluster forever.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from punica.cluster.placement import POLICIES
from punica.cluster.policy import ClusterPolicy
from punica.cluster.policy_config import PolicyConfig
from punica.cluster.step_time import StepTimeModel
from punica.cluster.trace import Trace

GPU_EVENT, GPU_READY, SAMPLE, ADAPTER_READY = 0, 1, 2, 3


@dataclass(frozen=True)
class SimConfig:
    num_gpus: int
    kv_tokens: int                  # KV capacity of one GPU, in tokens
    step_time: StepTimeModel
    policy: str = "punica"
    policy_config: PolicyConfig = PolicyConfig()
    gpu_startup_s: float = 30.0     # from asking for a GPU to it taking requests
    num_samples: int = 120          # points of the time series over the trace's duration
    host_tier_adapters: int = 48    # adapters a GPU's host tier holds (4 GiB / 80 MiB, rank-16 7B)


@dataclass(eq=False)
class GpuSegment:
    start: float = 0.0          # time of the step boundary the segment starts at
    start_step: int = 0
    first_step_s: float = 0.0   # duration of its first step (with prefill), then + growth per step
    growth_s: float = 0.0       # extra seconds per later step (context grows by batch tokens)
    batch_size: int = 0
    prefill_tokens: int = 0
    num_steps: int = 0          # steps until the segment's end event
    version: int = 0
    finishes: list = field(default_factory=list)          # heap of (step, request, epoch)
    first_tokens: deque = field(default_factory=deque)   # (step, request, epoch), ascending

    def seconds(self, num_steps: int, step_base: float) -> float:
        """Seconds for the segment's first `num_steps` steps."""
        if num_steps <= 0:
            return 0.0
        return self.first_step_s + (num_steps - 1) * step_base + self.growth_s * num_steps * (num_steps - 1) / 2


class Simulator:
    def __init__(self, config: SimConfig, trace: Trace):
        self.config, self.trace, self.model = config, trace, config.step_time
        policy_config = dataclasses.replace(config.policy_config, models_loads=True)
        self.policy: ClusterPolicy = POLICIES[config.policy](policy_config, sync=self._sync)
        self.lora = any(a is not None for a in trace.adapters)
        self.host_tiers: dict[int, OrderedDict] = {}
        self.num_reads = 0
        n = len(trace)
        self.generated = [0] * n           # tokens generated before the current placement
        self.epoch = [0] * n
        self.first_token = [math.nan] * n
        self.finish = [math.nan] * n
        self.segments: dict[int, GpuSegment] = {}
        self.events: list = []
        self.free_ids = list(range(config.num_gpus))
        self.num_starting = 0
        self.now = 0.0
        self.num_finished = 0
        self.rejected: list[int] = []
        self.num_held_at_arrival = [0] * n
        self.held_since: dict[int, float] = {}
        self.gpu_seconds = 0.0
        self.bin_s = trace.duration_s / config.num_samples
        self.series: dict[str, list] = {"arrivals": [], "tokens": [], "held_gpus": [], "batch_sizes": []}

    # ---- driving --------------------------------------------------------------------------
    def run(self) -> dict:
        start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(self.config.num_gpus):
            self._add_gpu()
        heapq.heappush(self.events, (0.0, SAMPLE, 0, 0))
        arrivals, i = self.trace.arrivals, 0
        while i < len(arrivals) or self.num_finished < len(arrivals):
            if i < len(arrivals) and (not self.events or arrivals[i] <= self.events[0][0]):
                self.now = arrivals[i]
                self._arrive(i)
                i += 1
            else:
                self.now, kind, key, version = heapq.heappop(self.events)
                if kind == GPU_EVENT:
                    if key in self.segments and self.segments[key].version == version:
                        self._segment_end(key)
                elif kind == GPU_READY:
                    self.num_starting -= 1
                    self._add_gpu()
                elif kind == ADAPTER_READY:
                    self._adapter_ready(key, version)
                else:
                    self._sample(key)
                    if i == len(arrivals) and len(self.events) == 1 and self.num_finished < len(arrivals):
                        self._stalled()
            self._scale()
        for gpu_id in list(self.held_since):
            self._release(gpu_id)
        return self._report(time.perf_counter() - start, time.process_time() - cpu_start)

    def _arrive(self, i: int) -> None:
        self._count("arrivals", 1)
        self.num_held_at_arrival[i] = len(self.policy.gpus)
        if self.trace.prompt_lens[i] + self.trace.output_lens[i] > self.config.kv_tokens:
            self.rejected.append(i)     # would outgrow any GPU's KV cache: refused, as a server would
            self.num_finished += 1
            return
        self.policy.submit(i, self.trace.prompt_lens[i], self.trace.adapters[i])
        self._place()

    def _place(self) -> None:
        for request, gpu_id in self.policy.schedule(self.now):
            if not self.policy.is_loading(request):
                self._join(request, gpu_id)
        for gpu_id, adapter in self.policy.started_loads:
            tier = self.host_tiers[gpu_id]
            seconds = self.model.adapter_load_s
            if adapter in tier:
                tier.move_to_end(adapter)
            else:
                seconds += self.model.adapter_read_s
                self.num_reads += 1
                if len(tier) >= self.config.host_tier_adapters:
                    tier.popitem(last=False)
                tier[adapter] = None
            heapq.heappush(self.events, (self.now + seconds, ADAPTER_READY, gpu_id, adapter))
        self.policy.started_loads.clear()

    def _adapter_ready(self, gpu_id: int, adapter) -> None:
        gpu = self.policy.gpus.get(gpu_id)
        if gpu is None or adapter not in gpu.loading:
            return
        self._sync(gpu_id)
        for request in self.policy.adapter_loaded(gpu_id, adapter):
            self._join(request, gpu_id)
        self._place()

    def _scale(self) -> None:
        for gpu_id in self.policy.release_idle(self.now):
            self._release(gpu_id)
        if self.free_ids and self.policy.needs_gpu():
            config = self.config.policy_config
            wanted = max(1, math.ceil(self.policy.num_placeable_waiting / config.max_batch_size))
            while self.num_starting < min(wanted, len(self.free_ids)):
                self.num_starting += 1
                heapq.heappush(self.events, (self.now + self.config.gpu_startup_s, GPU_READY, 0, 0))

    # ---- GPUs -----------------------------------------------------------------------------
    def _add_gpu(self) -> None:
        gpu_id = heapq.heappop(self.free_ids)
        self.policy.add_gpu(gpu_id, self.config.kv_tokens, self.now)
        self.segments[gpu_id] = GpuSegment(start=self.now)
        self.host_tiers.setdefault(gpu_id, OrderedDict())
        self.held_since[gpu_id] = self.now
        self._place()

    def _release(self, gpu_id: int) -> None:
        if gpu_id in self.policy.gpus:
            self.policy.remove_gpu(gpu_id)
        del self.segments[gpu_id]
        self.gpu_seconds += self.now - self.held_since.pop(gpu_id)
        heapq.heappush(self.free_ids, gpu_id)

    def _sync(self, gpu_id: int) -> None:
        """Report the segment's steps completed by now to the policy; restart from there."""
        seg = self.segments[gpu_id]
        done = self._completed_steps(seg)
        if done:
            self.policy.step(gpu_id, done, self.now)
            self._record(seg, done)
            self._restart(gpu_id, seg, seg.start + seg.seconds(done, self._step_base(seg)), 0)

    def _join(self, request: int, gpu_id: int) -> None:
        """`request` was just placed on a GPU synced to now: it joins the step in flight."""
        seg, gpu = self.segments[gpu_id], self.policy.gpus[gpu_id]
        self.epoch[request] += 1
        remaining = self.trace.output_lens[request] - self.generated[request]
        heapq.heappush(seg.finishes, (gpu.num_steps + remaining, request, self.epoch[request]))
        if self.generated[request] == 0:
            seg.first_tokens.append((gpu.num_steps + 1, request, self.epoch[request]))
        if seg.batch_size:
            self._restart(gpu_id, seg, seg.start, seg.prefill_tokens + self.policy.num_tokens(request))
        else:
            self._restart(gpu_id, seg, self.now, self.policy.num_tokens(request))

    def _segment_end(self, gpu_id: int) -> None:
        seg = self.segments[gpu_id]
        gpu = self.policy.gpus[gpu_id]
        steps = seg.num_steps
        evicted = self.policy.step(gpu_id, steps, self.now)  # only the last step can evict
        for request in evicted:
            self.generated[request] = self.policy.num_tokens(request) - self.trace.prompt_lens[request]
        self._record(seg, steps, evicted)
        while seg.finishes and seg.finishes[0][0] <= gpu.num_steps:
            _, request, epoch = heapq.heappop(seg.finishes)
            if epoch == self.epoch[request] and request in gpu.running:
                self.finish[request] = self.now
                self.num_finished += 1
                self.policy.finish(request, self.now)
        self._restart(gpu_id, seg, self.now, 0)
        self._place()

    def _record(self, seg: GpuSegment, steps: int, evicted: tuple[int, ...] | list[int] = ()) -> None:
        """First tokens and throughput of the segment's first `steps` steps (in the last of
        which the `evicted` requests left instead of running)."""
        base = self._step_base(seg)
        last = seg.start_step + steps
        while seg.first_tokens and seg.first_tokens[0][0] <= last:
            step, request, epoch = seg.first_tokens.popleft()
            if epoch == self.epoch[request] and not (step == last and request in evicted):
                self.first_token[request] = seg.start + seg.seconds(step - seg.start_step, base)
        self._count("tokens", steps * seg.batch_size - len(evicted))

    def _restart(self, gpu_id: int, seg: GpuSegment, start: float, prefill: int) -> None:
        """A new segment from a step boundary; schedule its end (next finish or KV exhaustion)."""
        gpu = self.policy.gpus[gpu_id]
        m, batch = self.model, len(gpu.running)
        seg.start, seg.start_step, seg.batch_size, seg.version = start, gpu.num_steps, batch, seg.version + 1
        seg.prefill_tokens = prefill
        if not batch:
            return
        seg.growth_s = m.per_context_token * batch
        context = gpu.kv_used - sum(self.policy.requests[r].num_tokens for r in gpu.waiting_load) + batch
        seg.first_step_s = m.seconds(batch, context, prefill, self.lora)
        while seg.finishes[0][1] not in gpu.running or seg.finishes[0][2] != self.epoch[seg.finishes[0][1]]:
            heapq.heappop(seg.finishes)
        steps = min(seg.finishes[0][0] - gpu.num_steps, gpu.kv_free // batch + 1)
        seg.num_steps = steps
        heapq.heappush(self.events, (start + seg.seconds(steps, self._step_base(seg)), GPU_EVENT, gpu_id, seg.version))

    def _step_base(self, seg: GpuSegment) -> float:
        """Duration of the segment's first step without its prefill."""
        m = self.model
        return seg.first_step_s - (m.per_prefill_token + self.lora * m.lora_per_prefill_token) * seg.prefill_tokens

    def _completed_steps(self, seg: GpuSegment) -> int:
        """Steps of the segment finished by now (fewer than the one that ends it)."""
        if not seg.batch_size:
            return 0
        base, elapsed = self._step_base(seg), self.now - seg.start
        if elapsed < seg.first_step_s:
            return 0
        a, b = seg.growth_s / 2, base - seg.growth_s / 2
        c = seg.first_step_s - base - elapsed
        k = int((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)) if a > 0 else int(-c / b)
        while k > 0 and seg.seconds(k, base) > elapsed:
            k -= 1
        while seg.seconds(k + 1, base) <= elapsed:
            k += 1
        return min(k, seg.num_steps - 1)

    def _stalled(self) -> None:
        """Every request has arrived, nothing is running, loading or starting, yet some wait: no
        event can ever place them."""
        waiting = self.policy.waiting_ids()
        raise RuntimeError(f"simulation stalled at t={self.now:.1f} s: {len(waiting)} requests can never be placed "
                           f"(first: request {waiting[0]} with {self.policy.num_tokens(waiting[0])} tokens, adapter "
                           f"{self.trace.adapters[waiting[0]]}; {len(self.policy.gpus)} GPUs of "
                           f"{self.config.kv_tokens} KV tokens held)")

    # ---- output ---------------------------------------------------------------------------
    def _count(self, name: str, value: int) -> None:
        series, index = self.series[name], int(self.now / self.bin_s)
        series.extend([0] * (index + 1 - len(series)))
        series[index] += value

    def _sample(self, index: int) -> None:
        gpus = self.policy.gpus
        self.series["held_gpus"].append(len(gpus))
        self.series["batch_sizes"].append(
            [gpus[g].batch_size if g in gpus else -1 for g in range(self.config.num_gpus)])
        if self.num_finished < len(self.trace):
            heapq.heappush(self.events, ((index + 1) * self.bin_s, SAMPLE, index + 1, 0))

    def _report(self, wall_s: float, cpu_s: float) -> dict:
        served = [i for i, f in enumerate(self.finish) if not math.isnan(f)]
        if not served:
            raise RuntimeError(f"no request was served: all {len(self.rejected)} outgrow a GPU's KV cache "
                               f"({self.config.kv_tokens} tokens)")
        arrivals = self.trace.arrivals
        latency = sorted(self.finish[i] - arrivals[i] for i in served)
        ttft = sorted(self.first_token[i] - arrivals[i] for i in served)
        makespan = max(self.finish[i] for i in served)
        tokens = sum(self.trace.output_lens[i] for i in served)
        return {
            "policy": self.config.policy, "num_gpus": self.config.num_gpus, "num_requests": len(self.trace),
            "num_rejected": len(self.rejected),
            "gpu_hours": self.gpu_seconds / 3600, "makespan_s": makespan, "output_tokens": tokens,
            "throughput_tokens_per_s": tokens / makespan, "num_evictions": self.policy.num_evictions,
            "adapter_loads": self.policy.num_loads, "adapter_reads": self.num_reads,
            "loads_per_1k_requests": 1000 * self.policy.num_loads / len(self.trace),
            "floor_loads_per_1k_requests": 1000 * ideal_cache_loads(
                self.trace.adapters, [self.policy.config.max_loras * h for h in self.num_held_at_arrival])
            / len(self.trace),
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "sim_wall_s": wall_s, "sim_cpu_s": cpu_s, "bin_s": self.bin_s, "series": self.series,
        }


def ideal_cache_loads(adapters: list, num_slots: list[int]) -> int:
    """Adapter loads if the slots held, when request i arrives, the `num_slots[i]` adapters most
    requested over the whole trace (each loaded once, at its first use) and a request of any other
    adapter loaded it: the floor of caching by popularity, which LFU slots approach. Not a bound
    for every rule: one that sees the future does better, and so may recency on a trace whose
    popularity drifts."""
    counts = Counter(a for a in adapters if a is not None)
    rank = {adapter: r for r, (adapter, _) in enumerate(counts.most_common())}
    seen: set = set()
    num_loads = 0
    for adapter, slots in zip(adapters, num_slots):
        if adapter is None:
            continue
        if adapter not in seen or rank[adapter] >= slots:
            num_loads += 1
        seen.add(adapter)
    return num_loads


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    return sorted_values[max(0, math.ceil(q / 100 * len(sorted_values)) - 1)]
