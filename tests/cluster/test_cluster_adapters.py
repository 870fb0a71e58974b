"""Adapters loaded and unloaded at run time across Ray workers (CPU, tiny model): every worker
serves the driver's set, a worker that joins later gets it, a worker that refuses rolls it back."""

import asyncio

import pytest
import ray
import torch

from punica.cluster.ray_backend import ClusterEngine
from punica.cluster.worker import EngineWorker
from punica.config import EngineArgs, EngineConfig
from punica.engine.sampling_params import SamplingParams
from punica.factory import engine_on_model
from punica.lora.pool import slot_bytes
from punica.models.loader import load_hf_dir

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory, make_peft_adapter, tiny_llama):
    tmp = tmp_path_factory.mktemp("adapters")
    hf = tiny_llama(seed=3)
    hf.save_pretrained(tmp / "base")
    return str(tmp / "base"), {name: str(make_peft_adapter(hf, tmp / name, r=8, alpha=16, seed=i))
                               for i, name in enumerate("ac")}


def refusing_worker():
    """A worker class that fails to register the adapter named "refused" (defined in a function,
    so Ray ships it by value)."""
    class RefusingWorker(EngineWorker):
        def set_adapters(self, adapters):
            if "refused" in adapters:
                raise ValueError("this worker refuses")
            EngineWorker.set_adapters(self, adapters)
    return RefusingWorker


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def single_engine_tokens(model, adapter, max_tokens):
    base, adapters = model
    engine = engine_on_model(load_hf_dir(base, dtype=torch.float32), EngineConfig(page_size=4), adapters)
    engine.add_request(PROMPT, greedy(max_tokens), adapter)
    while engine.has_unfinished():
        outs = [o for o in engine.step() if o.finished]
    return outs[0].token_ids


def test_run_time_adapters_reach_every_worker_late_ones_too_and_roll_back_on_refusal(ray_cluster, model, tmp_path):
    base, adapters = model
    expected = single_engine_tokens(model, "c", 8)
    assert expected != single_engine_tokens(model, None, 8)

    async def last(cluster, request_id, adapter, max_tokens, progress=None):
        async for out in cluster.generate(PROMPT, greedy(max_tokens), adapter, request_id):
            if progress is not None:
                progress.append(out)
        return out

    async def served(cluster):
        return [await actor.adapters.remote() for actor in cluster.workers.values()]

    async def main():
        classes = iter([ray.remote(num_cpus=1)(EngineWorker), ray.remote(num_cpus=1)(refusing_worker())])
        # a pool of 3 slots by its bytes (max_loras 8): the placement counts 3 adapters a GPU
        one = slot_bytes(load_hf_dir(base, dtype=torch.float32).config, EngineConfig.max_lora_rank, torch.float32)
        args = EngineArgs(model=base, page_size=4, dtype="float32", device="cpu", max_lora_bytes=3 * one)
        cluster = ClusterEngine(lambda: next(classes).remote(args, {"a": adapters["a"]}),
                                min_workers=1, max_workers=2, adapters={"a": adapters["a"]})
        await cluster.start()
        try:
            assert cluster.policy.config.max_loras == 3
            (tmp_path / "empty").mkdir()
            with pytest.raises(ValueError, match="adapter_config.json"):
                await cluster.load_adapter("c", str(tmp_path / "empty"))
            assert await served(cluster) == [{"a": adapters["a"]}]
            await cluster.load_adapter("c", adapters["c"])
            with pytest.raises(ValueError, match="already registered"):
                await cluster.load_adapter("c", adapters["c"])

            await cluster._add_worker()  # scale-up: the new worker joins with "c"
            assert await served(cluster) == [{"a": adapters["a"], "c": adapters["c"]}] * 2
            outs = await asyncio.gather(*(last(cluster, f"r{i}", "c", 8) for i in range(4)))
            assert [o.token_ids for o in outs] == [expected] * 4

            with pytest.raises(RuntimeError, match="worker 1 .*this worker refuses.*rolled back"):
                await cluster.load_adapter("refused", adapters["c"])
            assert "refused" not in cluster.adapters
            assert await served(cluster) == [{"a": adapters["a"], "c": adapters["c"]}] * 2

            progress = []
            running = asyncio.ensure_future(last(cluster, "long", "c", 40, progress))
            while not progress:
                await asyncio.sleep(0.01)
            await cluster.unload_adapter("c")
            assert await served(cluster) == [{"a": adapters["a"]}] * 2
            with pytest.raises(ValueError, match="unknown adapter"):
                await anext(cluster.generate(PROMPT, greedy(4), "c", "late"))
            with pytest.raises(ValueError, match="unknown adapter"):
                await cluster.unload_adapter("c")
            return await running
        finally:
            await cluster.shutdown()

    finished = asyncio.run(asyncio.wait_for(main(), 180))
    assert finished.finish_reason == "length" and len(finished.token_ids) == 40  # it ran on after the unload
