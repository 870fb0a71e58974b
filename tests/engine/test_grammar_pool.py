"""Constraints before compiling (limits, canonical form) and the GrammarPool (shared compiles, time
limit, dropped compiles, bounded cache), over a fake compile that the tests hold and release."""

import asyncio
import json
import os
import threading
import time

import pytest

from punica.config import EngineConfig
from punica.engine.constraint import GrammarError, GrammarLimits, GrammarSource, checked_source
from punica.engine.grammar_pool import COMPILE_NICENESS, GrammarPool
from punica.engine.sampling_params import SamplingParamsError, StructuredOutputs

LIMITS = GrammarLimits(max_chars=1000, max_depth=6, max_compile_seconds=30)
SCHEMA = {"type": "object", "title": "Person", "description": "someone",
          "properties": {"name": {"type": "string", "description": "their name", "examples": ["Ada"]},
                         "title": {"enum": [{"title": "Dr"}, "Mx"], "$comment": "a property named title"},
                         "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "title", "age"], "additionalProperties": False}


def nested_arrays(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_annotations_and_keyword_order_do_not_change_the_canonical_source():
    plain = {"required": ["name", "title", "age"], "additionalProperties": False, "type": "object",
             "properties": {"name": {"type": "string"}, "title": {"enum": [{"title": "Dr"}, "Mx"]},
                            "age": {"minimum": 0, "type": "integer"}}}
    source = checked_source(StructuredOutputs(json=SCHEMA), LIMITS)
    assert source == checked_source(StructuredOutputs(json=plain), LIMITS)
    assert json.loads(source.text) == plain
    # the property named "title" and the enum's data stay; the order of properties is what is generated
    assert list(json.loads(source.text)["properties"]) == ["name", "title", "age"]
    reordered = dict(plain, properties=dict(reversed(plain["properties"].items())))
    assert checked_source(StructuredOutputs(json=reordered), LIMITS) != source


def test_each_kind_has_its_source():
    assert checked_source(StructuredOutputs(json_object=True), LIMITS) == GrammarSource("json", '{"type":"object"}')
    assert checked_source(StructuredOutputs(regex="[a-z]+"), LIMITS) == GrammarSource("regex", "[a-z]+")
    assert checked_source(StructuredOutputs(choice=["a", 'b"']), LIMITS) == GrammarSource(
        "grammar", 'root ::= "a" | "b\\""')
    assert checked_source(StructuredOutputs(grammar='root ::= "x"'), LIMITS) == GrammarSource(
        "grammar", 'root ::= "x"')


@pytest.mark.parametrize("spec, fragment", [
    (StructuredOutputs(regex="a" * 1001), "structured_outputs.regex has 1001 characters, over this server's "
                                          "limit of 1000 (--max-grammar-chars)"),
    (StructuredOutputs(choice=["x" * 250] * 5), "structured_outputs.choice has 1250 characters"),
    (StructuredOutputs(grammar="root ::= " + '"a" ' * 300), "structured_outputs.grammar has 1209 characters"),
    (StructuredOutputs(json={"enum": ["y" * 1000]}), "structured_outputs.json has 1014 characters"),
    (StructuredOutputs(json=nested_arrays(6)), "structured_outputs.json nests objects and arrays more than 6 "
                                               "levels deep, this server's limit (--max-grammar-depth)"),
])
def test_constraints_over_the_limits_are_refused_naming_the_field_and_the_limit(spec, fragment):
    with pytest.raises(GrammarError) as e:
        checked_source(spec, LIMITS)
    assert fragment in str(e.value) and e.value.kind == spec.kind


def test_the_deepest_schema_within_the_limit_passes():
    checked_source(StructuredOutputs(json=nested_arrays(5)), LIMITS)  # 6 objects, each the items of the one around it


def test_a_schema_too_deep_to_read_is_a_sampling_params_error():
    text = '{"items":' * 5000 + "{}" + "}" * 5000
    with pytest.raises(SamplingParamsError, match="too deep"):
        StructuredOutputs(json=text)


def test_engine_config_bounds_the_grammar_limits():
    for kwargs in ({"max_grammar_depth": 0}, {"max_grammar_depth": 10**4}, {"max_grammar_chars": 0},
                   {"max_grammar_compile_seconds": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            EngineConfig(**kwargs)


class FakeCompiler:
    """compile_source for a GrammarPool: records what it compiles; a source whose text holds "hold"
    waits for `release` (and says it started)."""

    def __init__(self):
        self.compiled: list[GrammarSource] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, source: GrammarSource):
        self.compiled.append(source)
        if "hold" in source.text:
            self.started.set()
            assert self.release.wait(30)
        if "refuse" in source.text:
            raise ValueError("no such rule")
        return object()


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def fake():
    compiler = FakeCompiler()
    yield compiler
    compiler.release.set()


def test_requests_for_one_canonical_grammar_share_one_compile(fake):
    pool = GrammarPool(fake, LIMITS)
    first = pool.compile(StructuredOutputs(json=SCHEMA))
    second = pool.compile(StructuredOutputs(json=dict(SCHEMA, description="someone else", title="Other")))
    assert first is second and pool.num_compiles == 1 and len(fake.compiled) == 1
    assert pool.compile(StructuredOutputs(regex="[a-z]")) is not first and pool.num_compiles == 2
    assert pool.num_waiting == 0


def test_a_refused_grammar_names_the_callers_field_and_is_not_compiled_again(fake):
    pool = GrammarPool(fake, LIMITS)
    for spec in (StructuredOutputs(choice=["refuse"]), StructuredOutputs(grammar='root ::= "refuse"')):
        with pytest.raises(GrammarError, match=f"structured_outputs.{spec.kind} is not accepted by the grammar "
                                               "engine: no such rule"):
            pool.compile(spec)
    assert len(fake.compiled) == 1


def test_a_compile_past_the_time_limit_is_refused_at_the_limit_and_kept_when_it_ends(fake):
    pool = GrammarPool(fake, GrammarLimits(1000, 6, max_compile_seconds=0.2))
    spec = StructuredOutputs(regex="hold")
    with pytest.raises(GrammarError, match=r"structured_outputs.regex took longer than 0.2 s to compile, this "
                                           r"server's limit \(--max-grammar-compile-seconds\)"):
        pool.compile(spec)
    assert not fake.release.is_set() and pool.num_waiting == 0
    fake.release.set()
    wait_for(lambda: pool.cache_size()[0] == 1)  # the compile went on to its end
    assert asyncio.run(pool.compiled(spec)) is not None  # a cache hit
    assert pool.num_compiles == 1


def test_an_awaited_compile_past_the_time_limit_is_refused(fake):
    pool = GrammarPool(fake, GrammarLimits(1000, 6, max_compile_seconds=0.2))
    with pytest.raises(GrammarError, match="took longer than 0.2 s"):
        asyncio.run(pool.compiled(StructuredOutputs(grammar='root ::= "hold"')))
    assert not fake.release.is_set()


def test_a_compile_nobody_waits_for_any_more_is_dropped_before_it_starts(fake):
    """One thread, held by a compile: a second grammar queues behind it; its only caller is cancelled
    (its client went away), so it is never compiled; the first one's caller still gets its grammar."""
    pool = GrammarPool(fake, LIMITS, num_threads=1)

    async def scenario():
        held = asyncio.ensure_future(pool.compiled(StructuredOutputs(regex="hold")))
        queued = asyncio.ensure_future(pool.compiled(StructuredOutputs(regex="queued")))
        await asyncio.to_thread(fake.started.wait, 30)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pool.num_waiting == 1 and pool.cache_size() == (0, 0)
        fake.release.set()
        return await held

    assert asyncio.run(scenario()) is not None
    assert [s.text for s in fake.compiled] == ["hold"] and pool.num_compiles == 1


def test_the_cache_keeps_the_most_recently_used_grammars_within_its_bound(fake):
    pool = GrammarPool(fake, LIMITS, max_cache_bytes=10)  # a fake grammar holds the bytes of its source text
    for text in ("aaaa", "bbbb", "aaaa", "cccc"):  # a hit moves "aaaa" ahead of "bbbb"
        pool.compile(StructuredOutputs(regex=text))
    assert [s.text for s in fake.compiled] == ["aaaa", "bbbb", "cccc"]
    assert pool.cache_size() == (2, 8)
    pool.compile(StructuredOutputs(regex="aaaa"))
    pool.compile(StructuredOutputs(regex="bbbb"))
    assert [s.text for s in fake.compiled][3:] == ["bbbb"]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="a thread's own niceness is Linux's")
def test_compiles_run_at_a_lower_priority_than_the_engine():
    niceness = []

    def compile_source(source):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return object()

    GrammarPool(compile_source, LIMITS).compile(StructuredOutputs(regex="[a-z]"))
    assert niceness[0] >= COMPILE_NICENESS > os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
