"""Serving on several GPUs through Ray: one `EngineWorker` actor per GPU, driven by the
cluster policy from the driver's asyncio loop.

The driver keeps every request's prompt, parameters and streamed tokens. It places requests
with the policy (`PunicaPolicy` by default, `--cluster-policy`) and sends them to workers; one task per worker
calls `step` over and over while the worker has requests, streams each output to its request,
and places again what the worker handed back (its engine ran out of KV cache: the newest
request) or what the policy evicted. A placed-again request resumes from prompt + generated
tokens. A worker that dies has its requests placed again. Workers are added while
`needs_gpu` holds (up to `max_workers`) and released when idle (down to `min_workers`).
Ray is the only distributed machinery.

Adapters: the driver's `adapters` (name -> directory) is the served set. Every worker
registers exactly that set: `load_adapter` / `unload_adapter` send it to all workers, a
joining worker gets it before it takes requests, one lock orders the two. Each step's result
says which adapters the worker's GPU holds (resident or loading), and the policy follows it
(`ClusterPolicy.set_adapters`): the adapter-aware policy places by it.

Tenants: `set_tenants` gives every worker, and a joining one, the tenants' weights and KV caps
(Engine.set_tenants); each tenant's max_concurrent_requests is counted here, over the whole cluster,
with its requests waiting here for their grammars: a tenant at its cap is refused before a compile.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import ray
from ray.exceptions import RayActorError

from punica.cluster.placement import POLICIES, PunicaPolicy
from punica.cluster.policy import ClusterPolicy
from punica.cluster.policy_config import PolicyConfig
from punica.cluster.tracked import Tracked
from punica.cluster.worker import EngineWorker, StepResult, WorkerInfo
from punica.config import EngineArgs, EngineConfig
from punica.engine.admission import checked_prompt
from punica.engine.constraint import GrammarLimits
from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.stats import EngineStats
from punica.engine.structured import GrammarCompiler
from punica.engine.tenancy import TenantLimitError, TenantShare, checked_shares, tenant_key
from punica.lora.adapter import load_adapter


class ClusterEngine:
    """The async front the OpenAI server calls: `generate` streams RequestOutput deltas."""

    def __init__(self, make_worker: Callable[[], ray.actor.ActorHandle], min_workers: int, max_workers: int,
                 policy: ClusterPolicy | None = None, tokenizer=None, adapters: dict[str, str] | None = None,
                 grammar_limits: GrammarLimits | None = None):
        if not 1 <= min_workers <= max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {min_workers} and {max_workers}")
        self.make_worker, self.min_workers, self.max_workers = make_worker, min_workers, max_workers
        self.policy = policy or PunicaPolicy(PolicyConfig(min_gpus=min_workers))
        self.tokenizer, self.adapters = tokenizer, dict(adapters or {})
        self.grammar_limits = grammar_limits or GrammarLimits.of(EngineConfig())
        self.grammars: GrammarCompiler | None = None  # the driver's, made by `start` (with a tokenizer)
        self.model_config = None            # from the first worker: what adapters are checked against
        self.max_lora_rank, self.adapter_dirs = None, ()  # and their rank, and where they are read from
        self.tenant_shares: dict[str, TenantShare] = {}
        # one change of the served set (adapters, tenants) at a time; workers join between
        self._adapters_lock = asyncio.Lock()
        self.workers: dict[int, ray.actor.ActorHandle] = {}
        self.requests: dict[str, Tracked] = {}
        self._num_compiling: Counter[str | None] = Counter()  # per tenant (tenant_key): requests whose grammars compile
        self.worker_stats: dict[int, EngineStats] = {}  # each worker's after its last step (kept when it leaves)
        self.num_migrations = 0
        self._wake: dict[int, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._next_id = 0
        self._num_starting = 0
        self.max_model_len: int | None = None

    async def start(self) -> None:
        await asyncio.gather(*(self._add_worker() for _ in range(self.min_workers)))
        if self.tokenizer is not None:
            stop_token_ids = set(self.model_config.eos_token_ids) | (
                {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
            self.grammars = await asyncio.to_thread(GrammarCompiler, self.tokenizer, self.model_config.vocab_size,
                                                    stop_token_ids, self.grammar_limits)

    def num_waiting(self) -> int:
        """Requests waiting to be placed, and those waiting for their grammars to be checked first."""
        return self.policy.num_waiting + (self.grammars.pool.num_waiting if self.grammars is not None else 0)

    async def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.pool.close()
        for task in list(self._tasks):
            task.cancel()
        for actor in self.workers.values():
            ray.kill(actor)
        self.workers.clear()

    # ---- the server's API ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                       request_id: str, *, tenant: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last has finished=True. ValueError on bad input.
        `tenant` and `cache_salt` go with it to each worker it runs on (Engine.add_request). Its
        grammar is compiled here first (GrammarError, a ValueError, past the limits), so that a bad one
        is refused before it is placed; each worker it runs on compiles it again, off its step thread.
        TenantLimitError, before any compile, when its tenant has its max_concurrent_requests."""
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs need a tokenizer, and this server has none")
            self.check_room(tenant, adapter)
            key = tenant_key(tenant, adapter)
            self._num_compiling[key] += 1
            try:
                await self.grammars.pool.compiled(params.structured_outputs)
            finally:
                self._num_compiling[key] -= 1
                if not self._num_compiling[key]:
                    del self._num_compiling[key]
        tracked = self._track(prompt, params, adapter, request_id, tenant, cache_salt)
        self.policy.submit(request_id, len(tracked.prompt_token_ids), adapter)
        self._place()
        finished = False
        try:
            while not finished:
                out = await tracked.outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """End a request with finish_reason "abort": its final output (also put on its stream), or
        None if it is unknown or already finished."""
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self.policy.finish(request_id)
        if tracked.gpu_id in self.workers:
            self.workers[tracked.gpu_id].abort.remote(request_id)
        out = tracked.output(finished=True, finish_reason="abort")
        tracked.outputs.put_nowait(out)
        self._place()
        return out

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve a new adapter on every worker; requests may name it once this returns.

        The adapter is read once here, on the driver, so a broken one raises ValueError (as does
        a name in use) and no worker changes. If a worker then fails to register it, every worker
        is set back to the previous set (rolled back) and RuntimeError names the failed workers.
        """
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already registered")
        await asyncio.to_thread(load_adapter, path, self.model_config, name, adapter_dirs=self.adapter_dirs,
                                max_rank=self.max_lora_rank)
        async with self._adapters_lock:
            if name in self.adapters:  # loaded meanwhile
                raise ValueError(f"adapter {name!r} is already registered")
            failed = await self._send_all("set_adapters", {**self.adapters, name: path})
            if failed:
                await self._send_all("set_adapters", self.adapters)
                raise RuntimeError(f"loading adapter {name!r} failed on {failed}; rolled back, no worker serves it")
            self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter: new requests for it are refused at once (ValueError when it is
        not served); on each worker, as Engine.unload_adapter, its running requests finish and its
        queued ones fail (so do its requests waiting here, or migrated later, when placed).

        A worker that fails to unload it is named in a RuntimeError; no request is sent there for
        the adapter any more, and the next change of the set sends the whole set again.
        """
        async with self._adapters_lock:
            if self.adapters.pop(name, None) is None:
                raise ValueError(f"unknown adapter {name!r}")
            failed = await self._send_all("set_adapters", self.adapters)
        if failed:
            raise RuntimeError(f"unloading adapter {name!r} failed on {failed}")

    async def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """Replace the tenants' shares (Engine.set_tenants) on every worker, and on workers that join
        later; RuntimeError names the workers that failed to take them."""
        shares = checked_shares(shares)
        async with self._adapters_lock:
            self.tenant_shares = shares
            failed = await self._send_all("set_tenants", self._worker_shares())
        if failed:
            raise RuntimeError(f"setting the tenants' shares failed on {failed}")

    def _worker_shares(self) -> dict[str, TenantShare]:
        """The shares as workers apply them: without max_concurrent_requests, which the driver counts
        (a worker sees only the requests placed on it)."""
        return {name: replace(share, max_concurrent_requests=None) for name, share in self.tenant_shares.items()}

    async def _send_all(self, method: str, value) -> str:
        """Call a method of every worker (set_adapters, set_tenants) with `value`; the workers that
        failed and why ('' when none did). A dead worker is not a failure: it leaves, its requests
        are placed again."""
        workers = list(self.workers.items())
        results = await asyncio.gather(*(getattr(actor, method).remote(value) for _, actor in workers),
                                       return_exceptions=True)
        failed = []
        for (gpu_id, _), result in zip(workers, results):
            if isinstance(result, RayActorError):
                self._worker_died(gpu_id)
            elif isinstance(result, BaseException):
                cause = getattr(result, "cause", None) or result  # a RayTaskError carries the worker's error
                failed.append(f"worker {gpu_id} ({type(cause).__name__}: {cause})")
        return ", ".join(failed)

    # ---- requests -----------------------------------------------------------------------
    def _track(self, prompt, params: SamplingParams, adapter: str | None, request_id: str, tenant: str | None,
               cache_salt: str | None) -> Tracked:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"unknown adapter {adapter!r} ({len(self.adapters)} adapters are registered)")
        text, token_ids = checked_prompt(prompt, self.tokenizer, self.max_model_len)
        self.check_room(tenant, adapter)
        tracked = self.requests[request_id] = Tracked(request_id, text, token_ids, params, adapter, tenant, cache_salt)
        return tracked

    def check_room(self, tenant: str | None, adapter: str | None) -> None:
        """TenantLimitError if the tenant of a request of `tenant` on `adapter` has its
        max_concurrent_requests here already (tracked, or waiting for their grammars)."""
        key = tenant_key(tenant, adapter)
        share = self.tenant_shares.get(key)
        limit = share.max_concurrent_requests if share is not None else None
        if limit is None:
            return
        num_tracked = sum(tenant_key(t.tenant, t.adapter) == key for t in self.requests.values())
        if num_tracked + self._num_compiling[key] >= limit:
            raise TenantLimitError(key, limit)

    def _place(self) -> None:
        for request_id, gpu_id in self.policy.schedule(time.monotonic()):
            tracked = self.requests[request_id]
            tracked.gpu_id = gpu_id
            ref = self.workers[gpu_id].add.remote(request_id, tracked.prompt_token_ids, tracked.params,
                                                  tracked.adapter, list(tracked.output_token_ids), tracked.tenant,
                                                  tracked.cache_salt)
            self._spawn(self._check_add(tracked, ref))
            self._wake[gpu_id].set()
        self._scale()

    async def _check_add(self, tracked: Tracked, ref: ray.ObjectRef) -> None:
        """A worker refusing a request ends its stream with the error."""
        try:
            await ref
        except RayActorError:
            return  # the worker died; its drive loop places the request again
        except Exception as e:  # the worker's ValueError, wrapped by Ray
            if self.requests.pop(tracked.request_id, None) is not None:
                self.policy.finish(tracked.request_id)
                tracked.outputs.put_nowait(tracked.output(finished=True, finish_reason="error",
                                                          error=str(e.__cause__ or e)))

    def _requeue(self, gpu_id: int, evicted: list[tuple[str, list[int]]]) -> None:
        """Requests a worker handed back wait to be placed again, with the tokens they have."""
        for request_id, output_token_ids in evicted:
            tracked = self.requests.get(request_id)
            if tracked is None or tracked.gpu_id != gpu_id:
                continue
            assert output_token_ids == tracked.output_token_ids, "a worker lost or repeated tokens"
            self._moved(tracked)
            self.policy.evict(request_id, len(tracked.prompt_token_ids) + len(output_token_ids), time.monotonic())

    # ---- workers ------------------------------------------------------------------------
    async def _add_worker(self) -> None:
        actor = self.make_worker()
        try:
            info: WorkerInfo = await actor.info.remote()
            async with self._adapters_lock:  # joins with the current adapters and tenants, none changing meanwhile
                await actor.set_adapters.remote(self.adapters)
                await actor.set_tenants.remote(self._worker_shares())
        except BaseException:
            ray.kill(actor)  # cancelled by shutdown, or the worker failed to start
            raise
        gpu_id, self._next_id = self._next_id, self._next_id + 1
        self.max_model_len = min(self.max_model_len or info.max_model_len, info.max_model_len)
        self.model_config = self.model_config or info.model_config
        self.max_lora_rank = min(self.max_lora_rank or info.max_lora_rank, info.max_lora_rank)
        self.adapter_dirs = info.adapter_dirs
        self.workers[gpu_id] = actor  # no await since the lock: later changes of the set reach it
        self._wake[gpu_id] = asyncio.Event()
        self.policy.limit_adapter_slots(info.num_adapter_slots)
        self.policy.add_gpu(gpu_id, info.kv_tokens, time.monotonic())
        self._spawn(self._drive(gpu_id, actor))
        self._place()

    async def _drive(self, gpu_id: int, actor: ray.actor.ActorHandle) -> None:
        """Step one worker while it has requests; stream, finish, migrate."""
        wake = self._wake[gpu_id]
        while gpu_id in self.workers:
            if not self.policy.gpus[gpu_id].running:
                # idle: look again once it may be released
                asyncio.get_running_loop().call_later(self.policy.config.idle_release_s, self._scale)
                wake.clear()
                await wake.wait()
                continue
            try:
                result: StepResult = await actor.step.remote()
            except RayActorError:
                self._worker_died(gpu_id)
                return
            if gpu_id in self.workers:
                self._apply(gpu_id, actor, result)

    def _apply(self, gpu_id: int, actor: ray.actor.ActorHandle, result: StepResult) -> None:
        now = time.monotonic()
        self.worker_stats[gpu_id] = result.stats
        self.policy.set_adapters(gpu_id, result.adapters)
        for out in result.outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None or tracked.gpu_id != gpu_id:
                continue  # aborted, or handed back meanwhile
            tracked.output_token_ids.extend(out.new_token_ids)
            tracked.outputs.put_nowait(tracked.record(out, now))
            if out.finished:
                del self.requests[out.request_id]
                self.policy.finish(out.request_id, now)
        self._requeue(gpu_id, result.evicted)
        evicted = self.policy.step(gpu_id, 1, now)  # the policy's view ran out of KV before the engine
        for request_id in evicted:
            self._moved(self.requests[request_id])
        if evicted:
            actor.release.remote(evicted)  # before any later placement on this worker
        self._place()

    def _worker_died(self, gpu_id: int) -> None:
        if self.workers.pop(gpu_id, None) is None:
            return  # seen dead already
        self._wake.pop(gpu_id).set()
        for request_id in self.policy.remove_gpu(gpu_id):
            self._moved(self.requests[request_id])
        self._place()

    def _moved(self, tracked: Tracked) -> None:
        tracked.moved()
        self.num_migrations += 1

    def _scale(self) -> None:
        for gpu_id in self.policy.release_idle(time.monotonic()):
            ray.kill(self.workers.pop(gpu_id))
            self._wake.pop(gpu_id).set()
        if self.policy.needs_gpu() and len(self.workers) + self._num_starting < self.max_workers:
            self._num_starting += 1
            self._spawn(self._start_one())

    async def _start_one(self) -> None:
        try:
            await self._add_worker()
        finally:
            self._num_starting -= 1

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def build_cluster_engine(args: EngineArgs, adapters: dict[str, str], max_workers: int | None = None,
                         policy_config: PolicyConfig | None = None, policy: str = "punica",
                         max_packed_kv_tokens: int | None = None) -> ClusterEngine:
    """A ClusterEngine over `args.workers` Ray actors, each an engine of `args` (one GPU each, or
    `args.tensor_parallel_size` GPUs each, where there are GPUs; CPU workers otherwise), growing to
    `max_workers`, placing requests by the policy named `policy` (punica.cluster.placement.POLICIES),
    with KV-aware packing at `max_packed_kv_tokens` (PolicyConfig's) when given without `policy_config`.
    Call `await engine.start()` in the server's loop; Ray must be initialised first."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cluster policy {policy!r}; known: {', '.join(POLICIES)}")
    from punica.factory import load_tokenizer, model_source

    use_gpu = bool(ray.cluster_resources().get("GPU"))
    actor_class = ray.remote(num_gpus=args.tensor_parallel_size if use_gpu else 0, num_cpus=0 if use_gpu else 1)(
        EngineWorker)
    max_workers = max_workers or args.workers
    config = policy_config or PolicyConfig(max_batch_size=args.max_batch_size,
                                           light_load_batch=max(1, args.max_batch_size // 2), min_gpus=args.workers,
                                           max_loras=args.max_loras, max_packed_kv_tokens=max_packed_kv_tokens)
    return ClusterEngine(lambda: actor_class.remote(args, adapters), args.workers, max_workers,
                         POLICIES[policy](config), load_tokenizer(model_source(args)[1]), adapters,
                         GrammarLimits.of(args))
