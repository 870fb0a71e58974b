"""The output processor over the scheduler's updates (no model): a stop string ends its request
through the scheduler, also at the token that reached max_tokens and with a token in flight; text is
held back while it could still become a stop string; each request's finished output comes once."""

from punica.engine.kv_cache import PageAllocator
from punica.engine.output_processor import OutputProcessor
from punica.engine.request import PENDING, Request
from punica.engine.sampling_params import SamplingParams
from punica.engine.scheduler import Scheduler
from punica.engine.scheduler_output import RequestUpdate, SampledTokens

WORDS = {1: "x", 2: " the", 3: " END", 4: " more"}


class Words:
    """A tokenizer that decodes each token to its word."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(WORDS[i] for i in ids)


def engine_parts():
    sched = Scheduler(PageAllocator(100, 4), max_batch_size=8, max_num_batched_tokens=100)
    return sched, OutputProcessor(Words(), sched.stop)


def step(sched, outputs, *tokens):
    """One planned and launched step, its tokens put: its outputs."""
    out = sched.schedule()
    sched.launched(out)
    n = len(tokens)
    return outputs.process(sched.update_from_output(out, SampledTokens(list(tokens), [True] * n, [None] * n,
                                                                       [[]] * n)))


def add(sched, outputs, request):
    outputs.add(request)
    sched.add(request)


def test_a_stop_string_at_the_last_token_ends_by_stop_and_the_text_is_cut_before_it():
    sched, outputs = engine_parts()
    add(sched, outputs, r := Request("r", [1], SamplingParams(max_tokens=2, stop=["END"])))
    first = step(sched, outputs, 2)
    assert [(o.new_text, o.finished) for o in first] == [(" t", False)], "its last 2 characters could begin END"
    (last,) = step(sched, outputs, 3)
    assert last.finished and last.finish_reason == "stop", "not length: the stop string ends it"
    assert (last.text, last.new_text, last.token_ids) == (" the ", "he ", [2, 3])
    assert r.finish_reason == "stop" and not sched.requests and not sched.running


def test_a_stop_string_drops_the_token_in_flight_and_its_row_reaches_nobody():
    sched, outputs = engine_parts()
    add(sched, outputs, r := Request("r", [1], SamplingParams(max_tokens=10, stop=["END"])))
    first = sched.schedule()
    sched.launched(first)
    second = sched.schedule()                                  # planned before the first's token is known
    sched.launched(second)
    assert r.output_token_ids == [PENDING, PENDING]
    (out,) = outputs.process(sched.update_from_output(first, SampledTokens([3], [True], [None], [[]])))
    assert out.finished and out.finish_reason == "stop" and out.token_ids == [3] and out.text == " "
    assert r.output_token_ids == [3] and not r.pages
    assert outputs.process(sched.update_from_output(second, SampledTokens([4], [True], [None], [[]]))) == []


def test_an_abort_gives_one_finished_output_with_the_text_so_far():
    sched, outputs = engine_parts()
    add(sched, outputs, r := Request("r", [1], SamplingParams(max_tokens=10)))
    step(sched, outputs, 2)
    step(sched, outputs, 4)
    sched.finish(r, "abort")
    (out,) = outputs.process([RequestUpdate(r)])
    assert out.finished and out.finish_reason == "abort" and out.text == " the more" and out.new_token_ids == []
