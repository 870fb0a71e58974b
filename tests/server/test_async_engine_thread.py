"""AsyncEngine builds its engine on the engine thread, where every step runs (so that no other
thread keeps an OpenMP team: punica.ops.cpu_threads); what the build raises, the constructor raises."""

import asyncio
import threading

import pytest

from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.server.async_engine import AsyncEngine


class OneTokenEngine:
    """Finishes each request in one step; records the threads it was built and stepped on."""

    tokenizer = None  # no structured outputs: AsyncEngine makes no grammar compiler

    def __init__(self):
        self.built_on = threading.current_thread().name
        self.stepped_on: set[str] = set()
        self.requests: list[str] = []

    def add_request(self, prompt, params, adapter, request_id, *, tenant=None, cache_salt=None, grammar=None):
        self.requests.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.stepped_on.add(threading.current_thread().name)
        done, self.requests = self.requests, []
        return [RequestOutput(r, None, [1], None, text="x", token_ids=[2], new_text="x", new_token_ids=[2],
                              finished=True, finish_reason="length") for r in done]

    def close(self):
        pass


def test_the_engine_is_built_and_stepped_on_the_engine_thread():
    backend = AsyncEngine(OneTokenEngine)
    try:
        async def run():
            return [out async for out in backend.generate([1], SamplingParams(max_tokens=1), None, "r1")]

        outputs = asyncio.run(run())
        assert [o.finish_reason for o in outputs] == ["length"]
        assert backend.engine.built_on == "punica-engine" and backend.engine.stepped_on == {"punica-engine"}
    finally:
        asyncio.run(backend.shutdown())


def test_what_the_build_raises_the_constructor_raises():
    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)
