from punica.engine.kv_cache import PageAllocator
from punica.engine.request import Request, Status
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler


def request(i, prompt_len=4):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams())


def run_step(sched, batch):
    """What the engine does after the model ran: every scheduled request gains one token."""
    for r in batch.requests:
        r.num_cached += r.num_scheduled
        if r.num_cached == r.num_tokens:
            r.output_token_ids.append(7)


def test_fcfs_admission_and_batch_limit():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=3, max_num_batched_tokens=1000)
    reqs = [request(i) for i in range(5)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert batch.prefills == reqs[:3] and batch.decodes == []
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.prefills == [] and batch.decodes == reqs[:3]  # full: nobody else admitted
    sched.finish(reqs[1], "stop")
    run_step(sched, batch)
    batch = sched.schedule()
    assert batch.prefills == [reqs[3]] and batch.decodes == [reqs[0], reqs[2]]


def test_unchunked_prefill_budget_bounds_tokens_per_step_but_admits_one_long_prompt():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=10, chunked_prefill=False)
    long, short = request(0, prompt_len=30), request(1, prompt_len=4)
    sched.add(long)
    sched.add(short)
    assert sched.schedule().prefills == [long]  # over budget, but alone: runs
    sched2 = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=10, chunked_prefill=False)
    a, b, c = request(2, 4), request(3, 4), request(4, 4)
    for r in (a, b, c):
        sched2.add(r)
    assert sched2.schedule().prefills == [a, b]  # 4 + 4 <= 10 < 12


def test_newest_request_is_preempted_first_and_requeued_at_head():
    alloc = PageAllocator(4, 4)  # 16 tokens
    sched = Scheduler(alloc, max_batch_size=8, max_num_batched_tokens=1000)
    old, new, waiting = request(0, 4), request(1, 4), request(2, 4)
    for r in (old, new):
        sched.add(r)
    run_step(sched, sched.schedule())          # both hold 1 page, 5 tokens now
    sched.add(waiting)
    batch = sched.schedule()                   # each grows to 2 pages: cache full, waiting stays
    assert batch.decodes == [old, new] and batch.prefills == [] and alloc.num_free == 0
    run_step(sched, batch)
    for _ in range(3):
        run_step(sched, sched.schedule())      # up to 9 tokens each: 2 pages still hold 8 cached
    batch = sched.schedule()                   # 9 tokens need 3 pages each, only 4 exist
    assert batch.decodes == [old] and batch.preempted == [new]
    assert new.status is Status.WAITING and new.num_preemptions == 1
    assert old.status is Status.RUNNING and sched.waiting[0] is new and sched.waiting[1] is waiting
    assert new.pages == [] and new.num_cached == 0


def test_no_starvation_head_of_queue_is_never_skipped():
    alloc = PageAllocator(6, 4)
    sched = Scheduler(alloc, max_batch_size=8, max_num_batched_tokens=1000)
    small = request(0, 4)
    sched.add(small)
    run_step(sched, sched.schedule())
    big, later_small = request(1, 20), request(2, 2)   # big needs 5 pages, only 4 free
    sched.add(big)
    sched.add(later_small)
    batch = sched.schedule()
    assert batch.prefills == []                # later_small must not jump ahead of big
    sched.finish(small, "stop")
    batch = sched.schedule()
    assert batch.prefills[0] is big


def test_finish_frees_pages_everywhere():
    alloc = PageAllocator(10, 4)
    sched = Scheduler(alloc, max_batch_size=1, max_num_batched_tokens=1000)
    a, b = request(0, 9), request(1, 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert alloc.num_used == 3
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert alloc.num_used == 0 and not sched.has_unfinished()
