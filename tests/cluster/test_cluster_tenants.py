"""Tenants' shares across Ray workers (CPU, tiny model): every worker, and one that joins later, gets
the weights and KV caps; the driver counts max_concurrent_requests over the whole cluster."""

import asyncio

import pytest
import ray

from punica.cluster.ray_backend import ClusterEngine
from punica.cluster.worker import EngineWorker
from punica.config import EngineArgs
from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import TenantLimitError, TenantShare

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("tenants")
    tiny_llama(seed=3).save_pretrained(tmp / "base")
    return str(tmp / "base")


def recording_worker():
    """A worker class that keeps the shares it was given (defined in a function, so Ray ships it by value)."""
    class RecordingWorker(EngineWorker):
        shares = None

        def set_tenants(self, shares):
            self.shares = shares
            EngineWorker.set_tenants(self, shares)

        def received(self):
            return self.shares
    return RecordingWorker


def test_shares_reach_every_worker_late_ones_too_and_the_driver_counts_concurrent_requests(ray_cluster, model):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        actor_class = ray.remote(num_cpus=1)(recording_worker())
        args = EngineArgs(model=model, page_size=4, dtype="float32", device="cpu")
        cluster = ClusterEngine(lambda: actor_class.remote(args, {}), min_workers=1, max_workers=2)
        await cluster.start()
        try:
            assert await cluster.workers[0].received.remote() == {}, "a worker joins with the (empty) shares"
            await cluster.set_tenants({"A": TenantShare(weight=2.0, max_concurrent_requests=1, max_kv_tokens=64),
                                       "B": TenantShare(max_kv_tokens=32)})
            await cluster._add_worker()
            on_workers = {"A": TenantShare(weight=2.0, max_kv_tokens=64), "B": TenantShare(max_kv_tokens=32)}
            assert [await actor.received.remote() for actor in cluster.workers.values()] == [on_workers] * 2
            with pytest.raises(TypeError, match="TenantShare"):
                await cluster.set_tenants({"A": {"weight": 3.0}})
            assert [await actor.received.remote() for actor in cluster.workers.values()] == [on_workers] * 2

            stream = cluster.generate(PROMPT, params, None, "a1", tenant="A")
            await anext(stream)
            with pytest.raises(TenantLimitError, match="tenant 'A' already has 1 requests"):
                await anext(cluster.generate(PROMPT, params, None, "a2", tenant="A"))
            assert "a2" not in cluster.requests
            other = cluster.generate(PROMPT, params, None, "b1", tenant="B")
            await anext(other)
            await cluster.abort("a1")
            again = cluster.generate(PROMPT, params, None, "a3", tenant="A")
            await anext(again)
            for request_id in ("b1", "a3"):
                await cluster.abort(request_id)
        finally:
            await cluster.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_driver_counts_requests_waiting_for_their_grammars_and_refuses_before_compiling(held):
    """No worker is needed: the requests never get past their grammars (held by the `held` fixture)."""
    from transformers import AutoTokenizer

    from punica.config import EngineConfig, ModelConfig
    from punica.engine.constraint import GrammarLimits
    from punica.engine.sampling_params import StructuredOutputs
    from punica.engine.structured import GrammarCompiler
    from punica.models.sources import resolve_model_dir

    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def constrained(regex: str) -> SamplingParams:
        return SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex=regex))

    async def main():
        cluster = ClusterEngine(lambda: None, min_workers=1, max_workers=1, tokenizer=tokenizer)
        # the driver's compiler, as `start` makes it once its first worker is up; a held compile
        # stays within its time limit however slow the machine
        limits = GrammarLimits.of(EngineConfig(max_grammar_compile_seconds=600))
        cluster.grammars = GrammarCompiler(tokenizer, ModelConfig.from_dir(model_dir).vocab_size,
                                           {tokenizer.eos_token_id}, limits)
        pool = cluster.grammars.pool
        try:
            await cluster.set_tenants({"A": TenantShare(max_concurrent_requests=1)})
            compiling = asyncio.ensure_future(anext(cluster.generate(PROMPT, constrained("HOLD[0-9]{4}"), None,
                                                                     "a1", tenant="A")))
            assert await asyncio.to_thread(held.started.wait, 60)
            for request_id, params in (("a2", SamplingParams(max_tokens=4)), ("a3", constrained("[a-f]{5}"))):
                with pytest.raises(TenantLimitError, match="tenant 'A' already has 1 requests"):
                    await asyncio.wait_for(anext(cluster.generate(PROMPT, params, None, request_id, tenant="A")), 30)
            assert pool.num_waiting == 1  # a1's: a3 never waited for a compile
            compiling.cancel()  # its client went away: A has room again
            again = asyncio.ensure_future(anext(cluster.generate(PROMPT, constrained("HOLD[0-9]{5}"), None, "a4",
                                                                 tenant="A")))
            for _ in range(600):  # until a1 has left the pool and a4 waits in it, or a4 is refused
                if again.done() or (compiling.done() and pool.num_waiting == 1):
                    break
                await asyncio.sleep(0.05)
            assert not again.done() and pool.num_waiting == 1
            again.cancel()
        finally:
            held.go.set()
            pool.close()

    asyncio.run(asyncio.wait_for(main(), 120))
