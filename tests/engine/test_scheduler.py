import dataclasses

import pytest
from scheduler_steps import finish_step, schedule

from punica.engine.kv_cache import PageAllocator
from punica.engine.request import PENDING, Request, Status
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import SampledTokens


def request(i, prompt_len=4):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams())


def test_fcfs_admission_and_batch_limit():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=3, max_num_batched_tokens=1000)
    reqs = [request(i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    batch = schedule(sched)
    assert batch.prefills == reqs[:3] and batch.decodes == []
    finish_step(sched, batch)
    batch = schedule(sched)
    assert batch.prefills == [] and batch.decodes == reqs[:3]  # full: nobody else admitted
    sched.finish(reqs[1], "stop")
    finish_step(sched, batch)
    batch = schedule(sched)
    assert batch.prefills == [reqs[3]] and batch.decodes == [reqs[0], reqs[2]]


def test_unchunked_prefill_budget_bounds_tokens_per_step_but_admits_one_long_prompt():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=10, chunked_prefill=False)
    long, short = request(0, prompt_len=30), request(1, prompt_len=4)
    sched.add(long)
    sched.add(short)
    assert schedule(sched).prefills == [long]  # over budget, but alone: runs
    sched2 = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=10, chunked_prefill=False)
    a, b, c = request(2, 4), request(3, 4), request(4, 4)
    for r in (a, b, c):
        sched2.add(r)
    assert schedule(sched2).prefills == [a, b]  # 4 + 4 <= 10 < 12


def test_newest_request_is_preempted_first_and_requeued_at_head():
    alloc = PageAllocator(4, 4)  # 16 tokens
    sched = Scheduler(alloc, max_batch_size=8, max_num_batched_tokens=1000)
    old, new, waiting = request(0, 4), request(1, 4), request(2, 4)
    for r in (old, new):
        sched.add(r)
    finish_step(sched, schedule(sched))          # both hold 1 page, 5 tokens now
    sched.add(waiting)
    batch = schedule(sched)                   # each grows to 2 pages: cache full, waiting stays
    assert batch.decodes == [old, new] and batch.prefills == [] and alloc.num_free == 0
    finish_step(sched, batch)
    for _ in range(3):
        finish_step(sched, schedule(sched))      # up to 9 tokens each: 2 pages still hold 8 cached
    batch = schedule(sched)                   # 9 tokens need 3 pages each, only 4 exist
    assert batch.decodes == [old] and batch.preempted == [new]
    assert new.status is Status.WAITING and new.num_preemptions == 1
    assert old.status is Status.RUNNING and sched.waiting[0] is new and sched.waiting[1] is waiting
    assert new.pages == [] and new.num_cached == 0


def test_no_starvation_head_of_queue_is_never_skipped():
    alloc = PageAllocator(6, 4)
    sched = Scheduler(alloc, max_batch_size=8, max_num_batched_tokens=1000)
    small = request(0, 4)
    sched.add(small)
    finish_step(sched, schedule(sched))
    big, later_small = request(1, 20), request(2, 2)   # big needs 5 pages, only 4 free
    sched.add(big)
    sched.add(later_small)
    batch = schedule(sched)
    assert batch.prefills == []                # later_small must not jump ahead of big
    sched.finish(small, "stop")
    batch = schedule(sched)
    assert batch.prefills[0] is big


def test_finish_frees_pages_everywhere():
    alloc = PageAllocator(10, 4)
    sched = Scheduler(alloc, max_batch_size=1, max_num_batched_tokens=1000)
    a, b = request(0, 9), request(1, 3)
    sched.add(a)
    sched.add(b)
    schedule(sched)
    assert alloc.num_used == 3
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert alloc.num_used == 0 and not sched.has_unfinished()


def sampled(*tokens, ok=None):
    n = len(tokens)
    return SampledTokens(list(tokens), ok if ok is not None else [True] * n, [None] * n, [[]] * n)


def test_the_plan_is_a_frozen_output_in_adapter_slot_order_and_only_launched_changes_the_requests():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=10)
    a, b, c = request(0, 4), request(1, 8), request(2, 3)
    a.slot, b.slot, c.slot = 2, -1, 0
    for r in (a, c, b):
        sched.add(r)
    out = sched.schedule()
    assert out.request_ids == ("r1", "r2", "r0") and out.num_prefills == 3, "prompts by adapter slot"
    assert out.num_computed == (0, 0, 0) and out.num_scheduled == (3, 3, 4), "b's prompt is cut at the budget"
    assert out.sampling_rows == (1, 2), "b's chunk ends short of its prompt: it samples nothing"
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.num_scheduled = (1, 1, 1)
    assert [r.num_cached for r in (a, b, c)] == [0, 0, 0] and not a.output_token_ids, "planning changes no counts"
    sched.launched(out)
    assert [r.num_cached for r in (a, b, c)] == [4, 3, 3] and a.output_token_ids == [PENDING] and not b.output_token_ids
    updates = sched.update_from_output(out, sampled(5, 6))
    assert [(u.request, u.token_id) for u in updates] == [(c, 5), (a, 6)]
    assert a.output_token_ids == [6] and a.num_pending == 0
    out = sched.schedule()
    assert out.request_ids == ("r1", "r2", "r0") and out.num_prefills == 1 and out.num_computed == (3, 3, 4)
    assert out.num_scheduled == (5, 1, 1) and out.sampling_rows == (0, 1, 2), "decodes (by slot) after the prompt"


def test_update_from_output_ends_requests_at_eos_stop_tokens_grammar_and_length_and_frees_them():
    alloc = PageAllocator(100, 4)
    sched = Scheduler(alloc, max_batch_size=8, max_num_batched_tokens=100, eos_token_ids=frozenset({2}),
                      max_model_len=7)
    eos = Request("eos", [1, 1], SamplingParams())
    ignores = Request("ignores", [1, 1], SamplingParams(ignore_eos=True))
    stop = Request("stop", [1, 1], SamplingParams(stop_token_ids=[9]))
    short = Request("short", [1, 1], SamplingParams(max_tokens=1))
    context = Request("context", [1] * 6, SamplingParams())
    bad = Request("bad", [1, 1], SamplingParams())
    for r in (eos, ignores, stop, short, context, bad):
        sched.add(r)
    out = sched.schedule()
    sched.launched(out)
    updates = sched.update_from_output(out, sampled(2, 2, 9, 3, 3, 3, ok=[True] * 5 + [False]))
    assert [(u.request.request_id, u.token_id, u.error is not None) for u in updates] == [
        ("eos", 2, False), ("ignores", 2, False), ("stop", 9, False), ("short", 3, False), ("context", 3, False),
        ("bad", None, True)]
    assert [(r.finish_reason, r.output_token_ids) for r in (eos, stop, short, context, bad)] == [
        ("stop", [2]), ("stop", [9]), ("length", [3]), ("length", [3]), ("error", [])]
    assert not ignores.finished and list(sched.requests) == ["ignores"] and sched.running == [ignores]
    assert alloc.num_used == 1 and eos.first_token_time is not None and bad.first_token_time is None


def test_a_row_of_a_request_that_ended_while_its_step_ran_reaches_nobody_not_even_a_new_request_of_its_id():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=100)
    old = request(0)
    sched.add(old)
    out = sched.schedule()
    sched.launched(out)
    assert old.output_token_ids == [PENDING]
    sched.finish(old, "abort")
    assert old.output_token_ids == [] and not old.pages, "its token in flight is dropped"
    new = request(0)
    sched.add(new)
    assert sched.update_from_output(out, sampled(5)) == []
    assert new.output_token_ids == [] and new.status is Status.WAITING and sched.requests == {"r0": new}


def test_the_next_step_waits_for_the_tokens_of_a_request_with_penalties_or_at_its_length():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=100)
    plain, last = request(0), Request("last", [1, 2], SamplingParams(max_tokens=2))
    penalized = Request("penalized", [1, 2], SamplingParams(presence_penalty=0.5))
    for r in (plain, last):
        sched.add(r)
    out = sched.schedule()
    sched.launched(out)
    assert sched.may_run_ahead(out), "last has 1 of its 2 tokens"
    sched.update_from_output(out, sampled(5, 5))
    out = sched.schedule()
    sched.launched(out)
    assert not sched.may_run_ahead(out), "last ends at the token in flight: it must leave the batch"
    sched.update_from_output(out, sampled(5, 5))
    sched.add(penalized)
    out = sched.schedule()
    sched.launched(out)
    assert not sched.may_run_ahead(out), "penalties read the output tokens"
