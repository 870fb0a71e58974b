"""The prefix cache and chunked prefill at the level of pages: names, sharing, eviction, and a
scheduler soak that checks, at every step, that every token a request attends to holds the KV its
own adapter made of its own token there."""

import functools
import random
from pathlib import Path

from scheduler_steps import finish_step, schedule

from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler, is_decode
from punica.lora.manager import Registration


@functools.cache
def registration(adapter, version):
    """The one registration of `adapter` numbered `version` (an AdapterManager makes one per load)."""
    return Registration(adapter, Path(adapter), version)


def request(name, tokens, adapter=None, version=0):
    return Request(name, list(tokens), SamplingParams(), adapter=adapter,
                   registration=registration(adapter, version) if adapter else None)


def computed(alloc, r):
    """Take r's cached prefix and compute the rest of its tokens, then release it into the cache."""
    alloc.take(r, alloc.match(r))
    alloc.grow(r, r.num_tokens)
    r.num_cached = r.num_tokens
    alloc.free(r)


def test_pages_are_named_by_namespace_and_every_earlier_token():
    alloc = PageAllocator(32, 4, prefix_caching=True)
    prompt = list(range(10, 23))                                 # 13 tokens: 3 full pages
    computed(alloc, request("first", prompt, "a", version=1))
    assert alloc.num_cached == 3 and alloc.num_used == 0
    assert len(alloc.match(request("same", prompt, "a", version=1))) == 3
    assert alloc.match(request("other adapter", prompt, "b", version=1)) == []
    assert alloc.match(request("reloaded", prompt, "a", version=2)) == []
    assert alloc.match(request("base", prompt)) == []
    half = request("half strength", prompt, "a", version=1)
    half.params = SamplingParams(lora_scale=0.5)
    assert alloc.match(half) == [], "another lora_scale makes other KV"

    changed_head = [99] + prompt[1:]
    assert alloc.match(request("head", changed_head, "a", version=1)) == []  # later pages differ by their chain
    assert len(alloc.match(request("longer", prompt + [5, 6], "a", version=1))) == 3


def test_a_match_stops_short_of_the_last_token():
    alloc = PageAllocator(32, 4, prefix_caching=True)
    computed(alloc, request("first", range(8)))                    # exactly 2 pages
    again = request("again", range(8))
    hit = alloc.match(again)
    assert len(hit) == 1, "the last token must be computed again to sample from it"
    alloc.take(again, hit)
    assert again.num_cached == 4 and alloc.num_used == 1


def test_idle_cached_pages_count_free_and_leave_least_recently_released_first():
    alloc = PageAllocator(4, 2, prefix_caching=True)
    old, new = request("old", [1, 2, 3]), request("new", [7, 8, 9])
    computed(alloc, old)
    computed(alloc, new)
    assert alloc.num_free == 4 and alloc.num_cached == 2
    taker = request("taker", range(100, 105))                      # needs 3 pages: 2 never cached, then one idle
    alloc.grow(taker, 5)
    assert alloc.num_cached == 1 and alloc.match(request("new again", [7, 8, 9])) != []
    assert alloc.match(request("old again", [1, 2, 3])) == []
    alloc.free(taker)
    assert alloc.num_used == 0


def test_shared_pages_are_held_until_their_last_holder_leaves():
    alloc = PageAllocator(8, 2, prefix_caching=True)
    computed(alloc, request("first", [1, 2, 3, 4, 5]))
    a, b = request("a", [1, 2, 3, 4, 6]), request("b", [1, 2, 3, 4, 7])
    for r in (a, b):
        alloc.take(r, alloc.match(r))
        alloc.grow(r, r.num_tokens)
    assert a.pages[:2] == b.pages[:2] and a.pages[2] != b.pages[2]
    assert alloc.num_used == 4
    alloc.free(a)
    assert alloc.num_used == 3
    alloc.free(b)
    assert alloc.num_used == 0


def test_failed_requests_leave_nothing_in_the_cache():
    alloc = PageAllocator(8, 2, prefix_caching=True)
    r = request("failed", [1, 2, 3, 4, 5])
    alloc.grow(r, 5)
    r.num_cached = 5
    alloc.free(r, cache=False)
    assert alloc.num_cached == 0 and alloc.num_free == 8


def test_an_unregistered_adapters_pages_leave_the_cache_and_it_caches_no_more():
    alloc = PageAllocator(16, 4, prefix_caching=True)
    prompt = list(range(10, 23))                                   # 13 tokens: 3 full pages
    computed(alloc, request("a done", prompt, "a", version=1))
    computed(alloc, request("base done", prompt))
    computed(alloc, request("a reloaded", prompt, "a", version=2))
    held = request("a running", prompt + [7, 7, 7], "a", version=1)
    alloc.take(held, alloc.match(held))
    alloc.grow(held, held.num_tokens)
    held.num_cached = held.num_tokens
    alloc.cache_full_pages(held)                                   # its 4th page joins its 3 cached ones
    assert alloc.num_cached == 10 and alloc.num_used == 4

    alloc.drop(registration("a", 1))
    assert alloc.num_cached == 6 and alloc.num_used == 4, "idle pages are free at once, held ones stay held"
    assert alloc.match(request("a again", prompt, "a", version=1)) == []
    assert len(alloc.match(request("base again", prompt))) == 3
    assert len(alloc.match(request("reload again", prompt, "a", version=2))) == 3
    held.output_token_ids = [8, 8, 8, 8]                           # it keeps decoding on the old weights
    alloc.grow(held, held.num_tokens)
    held.num_cached = held.num_tokens
    alloc.free(held)
    assert alloc.num_cached == 6 and alloc.num_used == 0 and alloc.num_free == 16
    alloc.grow(request("taker", range(40)), 40)                    # 10 never-cached pages first, no eviction
    assert alloc.num_cached == 6


def test_chunked_prefill_runs_decodes_first_and_prompts_in_budgeted_chunks():
    sched = Scheduler(PageAllocator(64, 4), max_batch_size=4, max_num_batched_tokens=10)
    short = request("short", range(3))
    sched.add(short)
    finish_step(sched, schedule(sched))                              # it decodes from now on
    long = request("long", range(30))
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        batch = schedule(sched)
        assert batch.decodes == [short] and batch.prefills == [long]
        chunks.append(batch.num_scheduled[long])
        finish_step(sched, batch)
    assert chunks == [9, 9, 9, 3] and sched.num_chunked_steps == 3


def test_scheduler_soak_every_attended_token_holds_its_own_kv_and_no_page_leaks():
    """Random chat-like traffic (shared system prompts per adapter, a reload of one adapter, random
    aborts) over a tiny cache with prefix caching and chunked prefill: constant eviction and
    preemption. A simulated KV cache records who wrote each slot; every step checks that each
    request's cached tokens are slots holding (its namespace, its token)."""
    rng = random.Random(0)
    page_size, num_pages = 4, 24
    alloc = PageAllocator(num_pages, page_size, prefix_caching=True)
    sched = Scheduler(alloc, max_batch_size=6, max_num_batched_tokens=24)
    kv = {}                                              # (page, offset) -> (namespace, token)
    systems = {name: [rng.randrange(50) for _ in range(rng.randint(5, 14))] for name in (None, "a", "b")}
    versions = {None: 0, "a": 0, "b": 0}
    live, finished, ids = [], 0, iter(range(10 ** 6))

    def owner(r):
        return r.adapter, versions[r.adapter] if r.adapter else 0

    for step in range(1500):
        if len(live) < 10 and step < 1200:
            adapter = rng.choice([None, "a", "b"])
            r = request(f"r{next(ids)}", systems[adapter] + [rng.randrange(50) for _ in range(rng.randint(1, 20))],
                        adapter, versions[adapter])
            r.params = SamplingParams(max_tokens=rng.randint(1, 30))
            r.kv_owner = owner(r)
            live.append(r)
            sched.add(r)
        if step == 600:                                  # reload: later requests of "a" get new weights
            alloc.drop(registration("a", versions["a"]))
            versions["a"] += 1
        batch = schedule(sched)
        assert sum(batch.num_scheduled[r] for r in batch.requests) <= 24
        assert all(is_decode(r) for r in batch.decodes)
        held = [p for r in sched.running for p in r.pages]
        assert len(set(held)) == len(held) or alloc.num_cached, "only cached pages are shared"
        for r in batch.requests:
            tokens = r.token_ids
            for pos in range(r.num_cached):
                assert kv[r.pages[pos // page_size], pos % page_size] == (r.kv_owner, tokens[pos]), r.request_id
            for pos in range(r.num_cached, r.num_cached + batch.num_scheduled[r]):
                kv[r.pages[pos // page_size], pos % page_size] = (r.kv_owner, tokens[pos])
        finish_step(sched, batch, lambda: rng.randrange(50))
        for r in list(live):
            if r.status is Status.RUNNING and rng.random() < 0.005:
                sched.finish(r, "abort")
            if r.finished:
                live.remove(r)
                finished += 1
    while sched.has_unfinished():
        for r in sched.running + list(sched.waiting):
            sched.finish(r, "abort")
    assert finished > 200 and sched.num_preemptions > 100 and sched.num_chunked_steps > 100
    counts = sched.prefix_cache
    assert sum(c.hit_tokens for c in counts.values()) > 0
    assert alloc.num_used == 0 and alloc.num_free == num_pages
