"""A cluster worker compiles grammars off the thread that steps its engine: a request waits outside
the engine while its grammar compiles (held by the `held` fixture), the others step on, and the
first step after the compile adds it."""

import re
import threading

import pytest
import torch

from punica.cluster.worker import EngineWorker
from punica.config import EngineArgs
from punica.engine.sampling_params import SamplingParams, StructuredOutputs


@pytest.fixture(scope="module")
def worker():
    num_threads = torch.get_num_threads()  # a CPU worker takes one thread: this process's
    worker = EngineWorker(EngineArgs(max_batch_size=4, device="cpu"), {})
    yield worker
    worker.close()
    torch.set_num_threads(num_threads)


def prompt_ids(worker, text: str) -> list[int]:
    return worker.engine.tokenizer.encode(text)


def step_until(worker, request_id: str, max_steps: int = 500):
    """Step the worker until `request_id` finishes; its last output."""
    for _ in range(max_steps):
        for out in worker.step().outputs:
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"{request_id} did not finish within {max_steps} steps")


def test_a_worker_steps_other_requests_while_a_grammar_compiles(worker, held):
    constrained = SamplingParams(max_tokens=8, temperature=0,
                                 structured_outputs=StructuredOutputs(regex="HOLD[0-9]"))
    adding = threading.Thread(target=worker.add, args=("held", prompt_ids(worker, "Code:"), constrained, None, []))
    adding.start()
    adding.join(30)
    assert not adding.is_alive()  # add did not wait for the compile
    assert held.started.wait(30)
    worker.add("free", prompt_ids(worker, "Once upon a time"), SamplingParams(max_tokens=6, ignore_eos=True), None,
               [])
    out = step_until(worker, "free")
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert not held.ended.is_set() and "held" not in worker.engine.requests
    assert worker.step().num_unfinished == 1  # the request waiting for its grammar
    held.go.set()
    out = step_until(worker, "held")
    assert out.finish_reason == "length" or re.fullmatch("HOLD[0-9]", out.text)
    assert worker.engine.stats().num_constrained_requests == 1


def test_a_request_waiting_for_its_grammar_can_be_aborted_or_taken_back(worker, held):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="HOLD[a-c]+"))
    worker.add("aborted", prompt_ids(worker, "A"), params, None, [])
    worker.add("taken", prompt_ids(worker, "B"), params, None, [7, 8])
    assert held.started.wait(30)
    worker.abort("aborted")
    assert worker.release(["taken"]) == [("taken", [7, 8])]
    held.go.set()
    assert held.ended.wait(30)
    assert worker.step().num_unfinished == 0 and not worker.engine.requests


def test_a_request_the_engine_refuses_after_its_compile_ends_with_an_error(worker):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[xyz]{3}"))
    worker.add("bad", [worker.engine.vocab_size], params, None, [])
    out = step_until(worker, "bad")
    assert out.finish_reason == "error" and "prompt token ids must be integers" in out.error
