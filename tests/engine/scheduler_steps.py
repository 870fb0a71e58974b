"""Steps of a Scheduler without an engine, for the scheduler's tests (torch-free): plan one, then do
what the engine does once it ran."""

from punica.engine.scheduler_output import SampledTokens


class Step:
    """A planned step's rows as requests: prefills, decodes, all, those it preempted, and the tokens
    each runs."""

    def __init__(self, sched, output):
        rows = list(sched.requests_of(output))
        self.output = output
        self.prefills, self.decodes, self.requests = rows[:output.num_prefills], rows[output.num_prefills:], rows
        self.preempted = [sched.requests[i] for i in output.preempted_ids]
        self.num_scheduled = dict(zip(rows, output.num_scheduled))


def schedule(sched) -> Step:
    return Step(sched, sched.schedule())


def finish_step(sched, batch: Step, token=lambda: 7) -> None:
    """What the engine does once the step ran: its tokens are cached, and each request at the end of
    its tokens gets a token (`token()`), those at max_tokens finish."""
    sched.launched(batch.output)
    n = len(batch.output.sampling_rows)
    sched.update_from_output(batch.output, SampledTokens([token() for _ in range(n)], [True] * n, [None] * n,
                                                         [[]] * n))


def run_step(sched) -> Step:
    """One engine step: schedule, compute the scheduled tokens, sample a token (7) for each request at
    the end of its tokens, finish those at max_tokens. Returns the batch."""
    batch = schedule(sched)
    finish_step(sched, batch)
    return batch
