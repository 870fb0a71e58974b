"""Start-up calibration of the latency budget (punica.engine.step_cost.LatencyBudget).

Before the engine serves, it runs a few steps of placeholder tokens on the hardware it runs on, timed
by the clock that times served steps (punica.engine.core.step_clock), and the budget learns from them.
Without them the budget sizes the first chunk beside running decodes from decode-only steps and
lone prompts, which cannot tell what a prompt token costs beside decodes or after a long context.

The steps (`shapes`), cheapest first: one decode at a short context, several decodes, one decode at a
long context, then one decode beside a prompt chunk of the floor, of 64 tokens and of the whole step
budget, each at position 0 and after a long context. A shape runs until a run takes at least
SETTLED of the one before (at most MAX_RUNS runs) and the budget learns the last: the first runs
pay one-time costs (a kernel's compile, a cache's first touch; a fresh process's first step on a
2-core CPU took 1.2 s, its second 98 ms, then 33-34 ms). On a GPU that also warms the kernels of
those shapes before any request waits on them. No shape starts once CALIBRATION_S of the clock has
passed, so a slow CPU spends about a second; a GPU runs them all in milliseconds.

Every page is free at start-up: the steps write their keys and values into pages no request holds
yet (a request writes each position of its pages before it reads it) and register nothing in the
prefix cache. They run without adapters and their logits are dropped.
"""

from __future__ import annotations

from punica.config import ceil_div
from punica.engine import core
from punica.engine.step_cost import LatencyBudget, StepFeatures
from punica.engine.step_input import StepInput

CALIBRATION_S = 1.0  # clock seconds after which no further shape starts
SHORT = 64           # a decode's context in the short shapes
LONG = 2048          # the long context, at most (the KV cache and the context limit may allow less)
MANY = 8             # decodes in the step of several, at most
SETTLED = 0.8        # a run at least this fraction of the one before ends its shape's runs
MAX_RUNS = 4         # runs of a shape, at most
PLACEHOLDER = 0      # every calibration token's id

Shape = tuple[tuple[int, ...], int, int]  # (the decodes' contexts, the chunk's tokens, its position)


def shapes(max_batch_size: int, max_num_batched_tokens: int, min_chunk: int, num_pages: int, page_size: int,
           max_context: int) -> list[Shape]:
    """The calibration steps (module docstring) that fit the batch, the step's tokens, the KV cache's
    pages and the context limit, cheapest first."""
    long = min(LONG, max_context - max_num_batched_tokens)
    longs = [long] if long > SHORT else []
    candidates: list[Shape] = [((SHORT,), 0, 0), ((SHORT,) * min(MANY, max_batch_size), 0, 0)]
    candidates += [((c,), 0, 0) for c in longs]
    for chunk in sorted({min_chunk, 64, max_num_batched_tokens - 1}):
        candidates += [((SHORT,), chunk, position) for position in [0, *longs]]

    def fits(shape: Shape) -> bool:
        contexts, chunk, position = shape
        pages = sum(ceil_div(c + 1, page_size) for c in contexts) + ceil_div(position + chunk, page_size)
        return (len(contexts) + (chunk > 0) <= max_batch_size and len(contexts) + chunk <= max_num_batched_tokens
                and pages <= num_pages and max(max(contexts) + 1, position + chunk) <= max_context)

    return [shape for shape in candidates if fits(shape)]


def _rows(shape: Shape) -> list[tuple[int, int]]:
    """(tokens run, tokens cached before) of each of the step's rows: the chunk (if any), then the decodes."""
    contexts, chunk, position = shape
    return ([(chunk, position)] if chunk else []) + [(1, c) for c in contexts]


def features(shape: Shape) -> StepFeatures:
    """The StepFeatures of a calibration step, as StepFeatures.of gives a served step's."""
    rows = _rows(shape)
    return StepFeatures.of_rows([done for _, done in rows], [new for new, _ in rows], int(shape[1] > 0))


def step_input(shape: Shape, page_size: int) -> StepInput:
    """The step of placeholder tokens: the chunk (if any) first, on the first pages, then the decodes."""
    rows = _rows(shape)
    tokens, cached, pages, first = [], [], [], 0
    for new, done in rows:
        needed = ceil_div(done + new, page_size)
        tokens.append([PLACEHOLDER] * new)
        cached.append(done)
        pages.append(list(range(first, first + needed)))
        first += needed
    return StepInput.build(tokens, cached, pages, [-1] * len(rows), int(shape[1] > 0), page_size)


def calibrate(executor, budget: LatencyBudget, steps: list[Shape], page_size: int) -> int:
    """Run the calibration steps on `executor` (punica.engine.executor.Executor) and let `budget`
    learn each one's settled run (module docstring); returns how many it learned."""
    deadline, learned = core.step_clock() + CALIBRATION_S, 0  # the module's clock at each call: tests replace it
    for shape in steps:
        if core.step_clock() >= deadline:
            break
        step, times = step_input(shape, page_size), []
        while len(times) < MAX_RUNS and (len(times) < 2 or times[-1] < SETTLED * times[-2]):
            started = core.step_clock()
            executor.run(step)[:1].cpu()  # waits for the step
            times.append(core.step_clock() - started)
        budget.observe(features(shape), times[-1])
        learned += 1
    return learned
