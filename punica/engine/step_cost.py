"""How long a step takes, learned from the steps the engine runs, and the prompt tokens a step may
compute beside running decodes so that their inter-token latency stays within a target (torch-free).

A step's time is modelled as linear in what it computes (`StepFeatures`):

    seconds = c0 + c_rows * rows + c_tokens * prompt_tokens + c_attention * attention + c_keys * keys

where `attention` counts the (query, key) pairs of the step's rows: a decode at context n attends
n keys, a prompt chunk of C tokens after n cached ones C * (n + (C + 1) / 2); `keys` counts the
keys each row attends, n + C (a decode's n + 1): the KV a step reads at least, whatever its chunk's
size. A short chunk after a long context costs what reading that context costs, which the pairs
alone put at C times too little. In decode-only steps the two are equal; steps with chunks tell
them apart. The coefficients are fitted to the engine's own steps (seconds measured on the hardware
it runs on; before it serves, placeholder steps of punica.engine.calibration) by least squares,
weighting each past step by FORGETTING per step since, so the model follows what the hardware does
now (a compile, a warm cache, another process on the CPU); coefficients stay non-negative. A small
ridge pulls every coefficient but c0 toward 0: what the steps seen so far cannot tell apart (before
two prompt sizes, a chunk's fixed cost from its per-token cost) is put on the features that did
vary, and steps that all take the same time give c0 alone (no limit).

What a linear model misses (a bucket's padding requests, a slow step now and then) shows in how
far steps with prompt tokens run over their prediction, made before each was fitted: `overrun` is
the OVERRUN_QUANTILE of the last OVERRUN_WINDOW such ratios.

`LatencyBudget` sizes a step's prompt chunk: with decodes running, the most prompt tokens C (at
the position where the first prompt's chunk starts) for which the predicted step, times the
overrun, stays within `max_itl_ratio` times the decode-only step of the same decodes (`steady`);
never fewer than MIN_CHUNK (the floor), so a prompt keeps advancing where a step's cost beside a long
cached context leaves room for few tokens, unless the floor's step would pass FLOOR_HEADROOM times
that bound: then the most tokens within it, one at least. (On a 2-core CPU far into a 4k-token
prompt, an 8-token chunk's step took 2.8-3.1x the decode-only step; with a headroom of 1.1 the
stream beside it kept its largest gap within 2.46-2.75x its steady gap, 2.82-3.38x at 1.25, for a
first token 20-35% later: docs/benchmarks.md.) The steady step is the median of what
the decodes' last STEADY_STEPS decode-only steps took, as measured, each moved to these decodes by
what the model gives for the change from that step's decodes to these. Not a model's prediction
for those steps: one fitted to decode-only steps alone, with forgetting, over steps of other
batches and contexts, is off by a few percent at the last of them (on an H100, 8.21 ms for steps
that took 7.98-8.01), and the chunks beside them would carry that over into the decodes' gaps; and
its cost per key is whatever noise made it, since decode-only steps differ in little but their
growing contexts: while a prompt runs in chunks there are no decode-only steps and the decodes'
contexts grow past every one seen, and extrapolated that far the noise grows the steady step with
every chunk (0.05 ms a step over a 16k prompt on the H200). The model of every step learns the
cost of keys from chunks at every position.

A step that replays a CUDA graph computes its bucket's prompt tokens whatever its chunk
(`chunk_sizes`, punica.engine.cuda_graphs): a chunk one token past a size runs in the next bucket
and costs what that size costs (129 tokens run as 256). Its attention reads the cached context as
if for the size's query rows too: the prefill kernel cuts each query tile's keys into a split count
fixed by the size (punica.ops.attention_triton.prefill_split_count: fewer splits for more tiles, so
that the size's tiles fill one wave), so each program's share of the context, and the attention's
time, grows with the size's tiles, whichever of them the chunk fills (on an H100 at 14.6k cached
tokens, a step of 31 decodes beside a 128-token chunk took 15.9 ms, beside 138 tokens run as 256
21.2). So the model counts a step's prompt tokens as the size that ran them and its pairs over the
cached context as the size's query rows (`attention_rows`: whole tiles of `query_tile` queries)
times the longest cached context of its chunks (`prefix`), and a chunk that fits a size is the most
tokens that its size's step, so padded, has room for. When not even the smallest size has room
(far into a long prompt, where reading its context takes most of the room), the chunk is that size
whole: fewer tokens would cost the same step.

On a CPU the GEMMs of a step's rows (decodes and prompt tokens together) pad from one size to the
next (`row_sizes`, punica.ops.linear: W @ x^T computes 9 to 16 rows as 16): a chunk whose rows fall
in such a block costs the block's top, so it takes the block's top if that step has room, else the
rows up to the block's start. The floor does too: when its rows fall in a block, it is the block's
start if that is at least half the floor (a cheaper step), else the block's top (which costs what
the floor's step costs).

A decode-only step that takes over STALL_RATIO times what a model fitted to decode-only steps
alone predicts stalled (the host paused between steps: a long prompt added, a garbage collection):
neither model learns from it, nor does the steady step; for the same reason, one such step would
read as a steep cost per key. MAX_STALLS of them in a row are no stall but the hardware slowing
down, and the models learn from them again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from punica.config import ceil_div
from punica.engine.scheduler_output import SchedulerOutput

FORGETTING = 0.995          # a step's weight in the fit shrinks by this factor per later step
RIDGE = 1e-6                # on the scaled features but c0: solvable before every feature has varied
MIN_CHUNK = 8               # prompt tokens a step beside decodes computes at least, within FLOOR_HEADROOM
FLOOR_HEADROOM = 1.1        # how far past the ratio's bound the floor's step may go (module docstring)
NUM_FEATURES = 5
OVERRUN_WINDOW = 32         # steps with prompt tokens whose overrun is kept
OVERRUN_QUANTILE = 0.9
MIN_OVERRUNS = 4            # fewer kept: no correction (1.0)
STALL_RATIO = 2.0           # a decode-only step this far over its prediction stalled (module docstring)
MIN_DECODE_STEPS = 8        # decode-only steps seen before any counts as stalled
MAX_STALLS = 4              # stalls in a row that are the hardware slowing instead
STEADY_STEPS = 8            # the last decode-only steps whose times give the steady step


@dataclass(frozen=True)
class StepFeatures:
    rows: int           # requests in the step
    prompt_tokens: int  # tokens of prompt chunks (rows that compute more than one token, or start a prompt)
    attention: float    # (query, key) pairs over the step's rows
    keys: int           # keys attended over the step's rows (each row's context, its own tokens included)
    num_decodes: int    # requests that decode (not in the model: what pads the GEMMs' rows with the chunks')
    prefix: int = 0     # the longest cached context of its prompt chunks (not in the model: what a size's
    #                     padding query rows read, module docstring)

    @classmethod
    def of(cls, output: SchedulerOutput) -> StepFeatures:
        return cls.of_rows(output.num_computed, output.num_scheduled, output.num_prefills)

    @classmethod
    def of_rows(cls, num_computed: Sequence[int], num_scheduled: Sequence[int], num_prefills: int) -> StepFeatures:
        """A step whose rows (prefills first) have these tokens cached before it and run these."""
        prompt = sum(num_scheduled[:num_prefills])
        attention = sum(scheduled * (computed + (scheduled + 1) / 2)
                        for computed, scheduled in zip(num_computed, num_scheduled))
        rows = len(num_computed)
        return cls(rows, prompt, attention, sum(num_computed) + sum(num_scheduled), rows - num_prefills,
                   max(num_computed[:num_prefills], default=0))

    @classmethod
    def decodes(cls, contexts: list[int]) -> StepFeatures:
        """A decode-only step of requests with these contexts (tokens cached before the step)."""
        keys = sum(contexts) + len(contexts)
        return cls(len(contexts), 0, float(keys), keys, len(contexts))

    def vector(self) -> list[float]:
        return [1.0, float(self.rows), float(self.prompt_tokens), self.attention, float(self.keys)]


def solve(gram: list[list[float]], rhs: list[float], active: list[int]) -> list[float]:
    """The least-squares coefficients over the features in `active` (the others 0), by Gaussian
    elimination with partial pivoting on the normal equations."""
    n = len(active)
    a = [[gram[i][j] for j in active] + [rhs[i]] for i in active]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if a[col][col] == 0.0:
            continue
        for r in range(n):
            if r != col and a[r][col] != 0.0:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    coef = [0.0] * NUM_FEATURES
    for k, i in enumerate(active):
        coef[i] = a[k][n] / a[k][k] if a[k][k] != 0.0 else 0.0
    return coef


class StepCostModel:
    """Predicted seconds of a step from its StepFeatures, fitted online (module docstring)."""

    def __init__(self):
        self._gram = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._rhs = [0.0] * NUM_FEATURES
        self._scale = [1.0] * NUM_FEATURES   # the largest |feature| seen: conditions the equations
        self._coef: list[float] | None = None
        self._overruns: deque[float] = deque(maxlen=OVERRUN_WINDOW)
        self.num_observed = 0

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if features.prompt_tokens and (predicted := self.predict(features)) > 0.0:
            self._overruns.append(seconds / predicted)
        x = features.vector()
        for i, v in enumerate(x):
            self._scale[i] = max(self._scale[i], abs(v))
        for i in range(NUM_FEATURES):
            self._rhs[i] = FORGETTING * self._rhs[i] + x[i] * seconds
            for j in range(NUM_FEATURES):
                self._gram[i][j] = FORGETTING * self._gram[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._coef = None

    @property
    def coefficients(self) -> list[float]:
        """(c0, c_rows, c_tokens, c_attention, c_keys): the non-negative least-squares fit (a feature whose
        coefficient comes out negative is dropped, and the others refitted)."""
        if self._coef is None:
            s = self._scale
            gram = [[self._gram[i][j] / (s[i] * s[j]) + (RIDGE if i == j > 0 else 0.0) for j in range(NUM_FEATURES)]
                    for i in range(NUM_FEATURES)]
            rhs = [self._rhs[i] / s[i] for i in range(NUM_FEATURES)]
            active = list(range(NUM_FEATURES))
            while True:
                coef = solve(gram, rhs, active)
                negative = [i for i in active if coef[i] < 0.0]
                if not negative:
                    break
                active.remove(min(negative, key=lambda i: coef[i]))
            self._coef = [c / s[i] for i, c in enumerate(coef)]
        return self._coef

    def predict(self, features: StepFeatures) -> float:
        return sum(c * x for c, x in zip(self.coefficients, features.vector()))

    @property
    def overrun(self) -> float:
        """How far steps with prompt tokens ran over their prediction (module docstring); 1.0 before
        MIN_OVERRUNS of them."""
        if len(self._overruns) < MIN_OVERRUNS:
            return 1.0
        ranked = sorted(self._overruns)
        return ranked[min(len(ranked) - 1, int(OVERRUN_QUANTILE * len(ranked)))]


class LatencyBudget:
    """The prompt tokens of a step beside running decodes (module docstring)."""

    def __init__(self, max_itl_ratio: float, min_chunk: int = MIN_CHUNK, chunk_sizes: tuple[int, ...] = (),
                 row_sizes: tuple[int, ...] = (), query_tile: int = 1):
        assert max_itl_ratio > 1.0, max_itl_ratio
        self.max_itl_ratio, self.min_chunk = max_itl_ratio, min_chunk
        self.chunk_sizes = tuple(sorted(chunk_sizes))  # the prompt tokens steps compute (module docstring)
        self.query_tile = query_tile                   # queries of a prefill attention tile (module docstring)
        self.row_sizes = tuple(sorted(row_sizes))      # rows in (size, next size] compute the next (docstring)
        self.model = StepCostModel()          # every step
        self.decode_model = StepCostModel()   # decode-only steps
        self.num_stalls = 0                   # decode-only steps not learned from as stalls, in a row
        # the last decode-only steps learned from, with their seconds
        self._last_decodes: deque[tuple[StepFeatures, float]] = deque(maxlen=STEADY_STEPS)

    @classmethod
    def of_executor(cls, max_itl_ratio: float, executor) -> LatencyBudget:
        """The budget of the steps that `executor` (punica.engine.executor.Executor) runs: its chunk
        sizes, row sizes and prefill query tile."""
        return cls(max_itl_ratio, chunk_sizes=executor.chunk_sizes, row_sizes=executor.row_sizes,
                   query_tile=executor.query_tile)

    def padded(self, prompt_tokens: int, num_decodes: int = 0) -> int:
        """The prompt tokens a step of this many beside `num_decodes` decodes computes: the smallest
        chunk size that holds them, or the top of the row block that their rows fall in."""
        if self.chunk_sizes:
            return next((size for size in self.chunk_sizes if size >= prompt_tokens), prompt_tokens)
        block = self._row_block(num_decodes, prompt_tokens)
        return block[1] if block else prompt_tokens

    def attention_rows(self, size: int) -> int:
        """The query rows for which a step of this chunk size reads its cached context: its whole tiles."""
        return ceil_div(size, self.query_tile) * self.query_tile

    def _row_block(self, num_decodes: int, prompt_tokens: int) -> tuple[int, int] | None:
        """(start, top) in prompt tokens of the row block that a chunk of this many falls in beside
        `num_decodes` decodes (start < prompt_tokens <= top), or None."""
        sizes = self.row_sizes
        for start, top in zip(sizes, sizes[1:]):
            if prompt_tokens > 0 and start < num_decodes + prompt_tokens <= top:
                return start - num_decodes, top - num_decodes
        return None

    def observe(self, features: StepFeatures, seconds: float) -> None:
        if features.prompt_tokens:
            size = self.padded(features.prompt_tokens, features.num_decodes)
            padding = self.attention_rows(size) - features.prompt_tokens if size in self.chunk_sizes else 0
            features = replace(features, prompt_tokens=size, attention=features.attention + padding * features.prefix)
        else:
            decodes = self.decode_model
            if (decodes.num_observed >= MIN_DECODE_STEPS and seconds > STALL_RATIO * decodes.predict(features)
                    and self.num_stalls < MAX_STALLS):
                self.num_stalls += 1
                return
            self.num_stalls = 0
            decodes.observe(features, seconds)
            self._last_decodes.append((features, seconds))
        self.model.observe(features, seconds)

    def steady(self, decodes: StepFeatures) -> float:
        """The predicted time of this decode-only step (module docstring)."""
        model = self.model
        now = model.predict(decodes)
        if not self._last_decodes:
            return now
        return statistics.median(seconds + now - model.predict(features) for features, seconds in self._last_decodes)

    def prompt_tokens(self, decode_contexts: list[int], position: int) -> int:
        """The most prompt tokens a step may compute beside decodes at these contexts (tokens cached
        before the step), its first chunk starting after `position` cached tokens."""
        model = self.model
        decodes = StepFeatures.decodes(decode_contexts)
        _, c_rows, c_tokens, c_attention, c_keys = model.coefficients
        # overrun * (model's decodes + c_rows + c_tokens * T + c_attention * (R * position + C * (C + 1) / 2)
        #   + c_keys * (position + C)) <= ratio * steady, for a chunk of C tokens that runs as T, its
        # cached context read for R query rows (R = C but in a chunk size: its attention_rows)
        bound = self.max_itl_ratio * self.steady(decodes) / model.overrun
        room = bound - model.predict(decodes) - c_rows - c_keys * position
        a, b = c_attention / 2, c_attention / 2 + c_keys

        def most(room: float, per_token: float) -> float:
            """The largest C with a * C^2 + (b + per_token) * C <= room."""
            if room <= 0.0:
                return 0.0
            if a > 0.0:
                return (-(b + per_token) + math.sqrt((b + per_token) ** 2 + 4 * a * room)) / (2 * a)
            return room / (b + per_token) if b + per_token > 0.0 else math.inf

        token_cost = c_tokens + c_attention * position  # a token of a chunk with T = R = C
        chunk = most(room, token_cost)
        sizes = self.chunk_sizes
        if sizes and chunk <= sizes[-1]:  # T = the size that runs it; at least the smallest size
            chunk = max(sizes[0], *(min(size, most(room - c_tokens * size
                                                   - c_attention * position * self.attention_rows(size), 0.0))
                                    for size in sizes))
        floor, num_decodes = self.min_chunk, len(decode_contexts)
        if block := self._row_block(num_decodes, int(min(chunk, 1 << 30))):  # T = the block's top, else its start
            start, top = block
            chunk = max(start, min(top, most(room - c_tokens * top, c_attention * position)))
        if chunk < floor and bound > 0.0:  # the floor's step within FLOOR_HEADROOM times the bound (docstring)
            headroom = (FLOOR_HEADROOM - 1.0) * bound
            floor = max(1, int(min(floor, most(room + headroom, token_cost))))
        if chunk < floor and (block := self._row_block(num_decodes, floor)):
            start, top = block
            floor = start if 2 * start >= floor else top
        return max(floor, int(min(chunk, 1 << 30)))
