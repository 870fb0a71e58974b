"""The simulator's step-time model, and how its coefficients are measured on a real engine.

One engine step (prefill and decode fused) takes

    seconds = base + per_request * batch_size + per_context_token * context_tokens
              + per_prefill_token * prefill_tokens

where `context_tokens` is the sum over the batch of the tokens each request attends to and
`prefill_tokens` the prompt tokens computed in the step. `measure` times the real engine
and `fit` solves for the coefficients (least squares); the JSON form lets coefficients
measured elsewhere (a GPU) be dropped into `punica simulate --step-time FILE`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepTimeModel:
    base: float
    per_request: float
    per_context_token: float
    per_prefill_token: float
    source: str = ""

    def seconds(self, batch_size: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        return (self.base + self.per_request * batch_size + self.per_context_token * context_tokens
                + self.per_prefill_token * prefill_tokens)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> StepTimeModel:
        return cls(**json.loads(Path(path).read_text()))


# Fitted by `python -m punica.cluster.step_time` on 2026-11-30 on this project's CPU machine
# (2 cores shared with other jobs, torch 2.13 CPU, SmolLM2-135M fp32, no adapters): fastest
# of 2 runs per point of batch {1, 8, 32} x prompt {16, 128}; the model is within -38%..+40%
# of those 12 steps. Pass GPU-measured coefficients with `punica simulate --step-time FILE`.
CPU_SMOLLM2 = StepTimeModel(base=0.4132, per_request=0.02885, per_context_token=1.342e-4,
                            per_prefill_token=7.384e-3, source="CPU, SmolLM2-135M fp32, 2 shared cores")


def fit(samples: list[tuple[int, int, int, float]], source: str) -> StepTimeModel:
    """Coefficients (clipped at 0) minimising the squared RELATIVE error over
    (batch, context, prefill, seconds) rows, so long prefills do not drown short decodes."""
    import numpy as np

    rows = np.array([(1.0, b, c, p) for b, c, p, _ in samples])
    seconds = np.array([s for *_, s in samples])
    coef, *_ = np.linalg.lstsq(rows / seconds[:, None], np.ones_like(seconds), rcond=None)
    base, per_request, per_context, per_prefill = (max(0.0, float(c)) for c in coef)
    return StepTimeModel(base, per_request, per_context, per_prefill, source)


def measure(engine, batch_sizes=(1, 8, 32), prompt_lens=(16, 128), num_decode_steps: int = 4, repeats: int = 2,
            seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> list[tuple[int, int, int, float]]:
    """(batch, context, prefill, seconds) rows of a real engine (punica.engine.engine.Engine, built
    with overlap_steps=False so that each `step` runs and finishes one whole step) over a small grid:
    per grid point, the fastest prefill step and the fastest decode step over `repeats` runs (the
    minimum filters out other processes sharing the machine), after one warm-up run. What a step ran
    is the engine's own record of it (`Engine.last_step`)."""
    from punica.engine.sampling_params import SamplingParams

    if engine.overlaps_steps:
        raise ValueError("measure step times on an engine built with overlap_steps=False: an overlapped "
                         "step returns (and waits for) the step before it")
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=num_decode_steps + 1, temperature=0, ignore_eos=True)
    samples = []
    grid = [(batch_sizes[0], prompt_lens[0], 1)] + [(b, p, repeats) for b in batch_sizes for p in prompt_lens]
    for point, (batch, prompt_len, num_runs) in enumerate(grid):
        steps: dict[bool, list[tuple[int, int, int, float]]] = {True: [], False: []}
        for _ in range(num_runs):
            for _ in range(batch):
                engine.add_request([rng.randrange(engine.vocab_size) for _ in range(prompt_len)], params)
            while engine.has_unfinished():
                start = clock()
                engine.step()
                seconds = clock() - start
                shape = engine.last_step
                if shape is not None:
                    steps[shape.num_prefill_tokens > 0].append(
                        (shape.num_requests, shape.num_context_tokens, shape.num_prefill_tokens, seconds))
        if point:
            samples += [min(rows, key=lambda row: row[3]) for rows in steps.values() if rows]
    return samples


def main() -> None:
    import argparse

    from punica.config import EngineArgs, add_arguments, from_arguments
    from punica.factory import build_engine

    parser = argparse.ArgumentParser(description="measure engine step times and fit the step-time model")
    add_arguments(parser, EngineArgs, skip=("workers", "overlap_steps"), kv_cache_tokens=1 << 14)
    parser.add_argument("--out", default="step_time.json")
    args = parser.parse_args()
    engine_args = from_arguments(EngineArgs, args, overlap_steps=False)
    engine = build_engine(engine_args, {})
    try:
        samples = measure(engine, batch_sizes=(1, 8, engine_args.max_batch_size))
    finally:
        engine.close()
    source = f"measured on {engine_args.device or 'the default device'}, model {args.model or 'SmolLM2-135M'}"
    model = fit(samples, source=f"{source}, {len(samples)} steps")
    model.to_json(args.out)
    print(json.dumps({"model": asdict(model), "samples": samples}))


if __name__ == "__main__":
    main()
