"""Grammars compile off the engine's thread: a request waiting for its grammar holds up nobody else,
is refused at the compile time limit, never enters the engine if its client goes away, and grammars
differing only in annotations compile once. xgrammar's compile of regexes holding "HOLD" waits for
the test's go (the `held` fixture), so that what happens meanwhile is certain, not a matter of timing."""

import asyncio
import json
import socket
import threading
import time

import openai
import pytest
import xgrammar as xgr

from punica.config import EngineArgs
from punica.server.serve import build_state

COMPILE_LIMIT_S = 3.0


class CountedSchemas:
    """Wraps xgrammar's JSON-schema compile, counting the schemas that hold `marker`."""

    def __init__(self, compile_json_schema, marker: str):
        self.compile_json_schema, self.marker, self.count = compile_json_schema, marker, 0

    def __call__(self, compiler, schema, **kwargs):
        if self.marker in schema:
            self.count += 1
        return self.compile_json_schema(compiler, schema, **kwargs)


@pytest.fixture(scope="module")
def server(start_server):
    running = start_server(build_state(EngineArgs(max_batch_size=4, max_grammar_compile_seconds=COMPILE_LIMIT_S)))
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_call(server, fn):
    """fn() run on the engine thread between steps: after every command sent before it."""
    return asyncio.run(server.state.backend.call(fn))


def test_a_stream_runs_to_its_end_while_another_requests_grammar_compiles(server, client, held):
    model = server.state.base_model_name
    engine = server.engine
    constrained = engine.stats().num_constrained_requests
    answer = {}

    def constrained_request():
        try:
            answer["ok"] = client.completions.create(model=model, prompt="Code:", max_tokens=8,
                                                     extra_body={"guided_regex": "HOLD[0-9]{2}"})
        except openai.APIStatusError as e:
            answer["error"] = e

    waiting = threading.Thread(target=constrained_request)
    waiting.start()
    try:
        assert held.started.wait(30)
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [c for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len("".join(c.choices[0].text for c in chunks)) > 0
        # the compile is still held: the request waiting for it never took a place in the engine
        assert not held.ended.is_set()
        assert engine_call(server, lambda: engine.stats().num_constrained_requests) == constrained
    finally:
        held.go.set()
        waiting.join(60)
    assert "ok" in answer or "took longer than" in answer["error"].message


def test_a_compile_past_the_time_limit_is_a_400_that_says_so(server, client, held):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.state.base_model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": "A code"}],
                                       extra_body={"structured_outputs": {"regex": "HOLD[a-z]"}})
    assert not held.ended.is_set()
    assert e.value.body["message"] == (f"structured_outputs.regex took longer than {COMPILE_LIMIT_S:g} s to "
                                       f"compile, this server's limit (--max-grammar-compile-seconds)")
    assert e.value.body["param"] == "structured_outputs.regex"
    held.go.set()
    assert held.ended.wait(30)


def test_a_request_whose_client_goes_away_during_its_compile_never_enters_the_engine(server, held):
    engine = server.engine
    constrained = engine.stats().num_constrained_requests
    body = json.dumps({"model": server.state.base_model_name, "prompt": "Hi", "max_tokens": 4, "stream": True,
                       "guided_regex": "HOLD!"}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert held.started.wait(30)
    wait_until(lambda: server.state.backend.num_waiting() == 0)  # the request left its compile
    held.go.set()
    assert held.ended.wait(30)
    assert engine_call(server, lambda: (engine.stats().num_constrained_requests, len(engine.requests))) == (
        constrained, 0)


def test_schemas_differing_only_in_annotations_compile_once(server, client, monkeypatch):
    counted = CountedSchemas(xgr.GrammarCompiler.compile_json_schema, "zebra_count")
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_json_schema",
                        lambda compiler, schema, **kwargs: counted(compiler, schema, **kwargs))
    schema = {"type": "object", "properties": {"zebra_count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["zebra_count"], "additionalProperties": False}
    for extra in ({}, {"description": "How many zebras"}, {"title": "Zebras", "$comment": "for the zoo"}):
        fmt = {"type": "json_schema", "json_schema": {"name": "zebras", "schema": {**schema, **extra}}}
        out = client.completions.create(model=server.state.base_model_name, prompt="Zebras:", max_tokens=12,
                                        temperature=0, extra_body={"response_format": fmt})
        assert out.choices[0].finish_reason in ("stop", "length")
    assert counted.count == 1


def nested_arrays(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("extra, message", [
    ({"guided_json": nested_arrays(65)}, "guided_json nests objects and arrays more than 64 levels deep, this "
                                         "server's limit (--max-grammar-depth)"),
    ({"guided_choice": ["x" * 256] * 300}, "guided_choice has 76800 characters, over this server's limit of 65536 "
                                           "(--max-grammar-chars)"),
])
def test_constraints_over_the_limits_are_a_400_before_compiling(server, client, extra, message, monkeypatch):
    compiles = []
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_json_schema", lambda *a, **k: compiles.append(a))
    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", lambda *a, **k: compiles.append(a))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.state.base_model_name, prompt="Hi", max_tokens=2, extra_body=extra)
    assert e.value.body["message"] == message and e.value.body["param"] == next(iter(extra)) and not compiles
    monkeypatch.undo()
    client.completions.create(model=server.state.base_model_name, prompt="Hi", max_tokens=2,
                              extra_body={"guided_json": nested_arrays(64)})


def wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
