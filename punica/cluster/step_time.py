"""The simulator's GPU model: step times and adapter load times, and how they are measured.

One engine step (prefill and decode fused) takes

    seconds = base + per_request * batch_size + per_context_token * context_tokens
              + per_prefill_token * prefill_tokens
              + (lora_base + lora_per_request * batch_size + lora_per_prefill_token * prefill_tokens)  [LoRA]

where `context_tokens` is the sum over the batch of the tokens each request attends to,
`prefill_tokens` the prompt tokens computed in the step, and the bracket is added when the
step's requests use adapters (measured with a distinct adapter per request, the costliest mix).
An adapter that is not on the GPU takes `adapter_load_s` to copy from the host tier into a slot,
plus `adapter_read_s` first if it is not in the host tier either (read from disk).

`measure` times the real engine and `fit` solves for the step coefficients (least squares on
relative error). Models ship by name (`MODELS`, `load_model`); a JSON file of the same fields
works too (`punica simulate --step-time NAME|FILE`). This module imports no torch.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class StepTimeModel:
    base: float
    per_request: float
    per_context_token: float
    per_prefill_token: float
    lora_base: float = 0.0
    lora_per_request: float = 0.0
    lora_per_prefill_token: float = 0.0
    adapter_load_s: float = 0.0     # host tier -> GPU slot
    adapter_read_s: float = 0.0     # disk -> host tier
    source: str = ""

    def seconds(self, batch_size: int, context_tokens: int, prefill_tokens: int = 0, lora: bool = False) -> float:
        s = (self.base + self.per_request * batch_size + self.per_context_token * context_tokens
             + self.per_prefill_token * prefill_tokens)
        if lora:
            s += self.lora_base + self.lora_per_request * batch_size + self.lora_per_prefill_token * prefill_tokens
        return s

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> StepTimeModel:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"step-time model {path}: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


# Fitted by `python -m punica.cluster.step_time` on 2026-11-30 on this project's CPU machine
# (2 cores shared with other jobs, torch 2.13 CPU, SmolLM2-135M fp32, no adapters): fastest
# of 2 runs per point of batch {1, 8, 32} x prompt {16, 128}; the model is within -38%..+40%
# of those 12 steps.
CPU_SMOLLM2 = StepTimeModel(base=0.4132, per_request=0.02885, per_context_token=1.342e-4,
                            per_prefill_token=7.384e-3, source="CPU, SmolLM2-135M fp32, 2 shared cores")

H200_LLAMA2_7B_FILE = Path(__file__).with_name("h200_llama2_7b.json")
DEFAULT_MODEL = "h200-llama-2-7b"
MODELS: dict[str, Callable[[], StepTimeModel]] = {
    "h200-llama-2-7b": lambda: StepTimeModel.from_json(H200_LLAMA2_7B_FILE),
    "cpu-smollm2": lambda: CPU_SMOLLM2,
}


def load_model(name_or_path: str = DEFAULT_MODEL) -> StepTimeModel:
    """A shipped model by name (MODELS), else a JSON file of StepTimeModel's fields."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]()
    if not Path(name_or_path).is_file():
        raise ValueError(f"--step-time {name_or_path!r} is neither a model name ({', '.join(MODELS)}) nor a file")
    return StepTimeModel.from_json(name_or_path)


class Sample(NamedTuple):
    batch: int
    context: int
    prefill: int
    lora: bool
    seconds: float


def fit(samples: Sequence[Sample], source: str, adapter_load_s: float = 0.0, adapter_read_s: float = 0.0,
        ) -> StepTimeModel:
    """Coefficients (clipped at 0) minimising the squared RELATIVE error over the samples, so long
    prefills do not drown short decodes. Without LoRA samples the LoRA terms are 0."""
    import numpy as np

    with_lora = any(s.lora for s in samples)
    rows = np.array([(1.0, s.batch, s.context, s.prefill) + ((s.lora, s.lora * s.batch, s.lora * s.prefill)
                                                             if with_lora else ()) for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples])
    coef, *_ = np.linalg.lstsq(rows / seconds[:, None], np.ones_like(seconds), rcond=None)
    values = [max(0.0, float(c)) for c in coef] + [0.0] * (7 - len(coef))
    return StepTimeModel(*values, adapter_load_s=adapter_load_s, adapter_read_s=adapter_read_s, source=source)


def fit_errors(model: StepTimeModel, samples: Sequence[Sample]) -> list[float]:
    """(model - measured) / measured for each sample."""
    return [model.seconds(s.batch, s.context, s.prefill, s.lora) / s.seconds - 1 for s in samples]


def measure(engine, batch_sizes: Sequence[int] = (1, 8, 32), prompt_lens: Sequence[int] = (16, 128),
            mixed_prefills: Sequence[int] = (), adapters: Sequence[str] = (), num_decode_steps: int = 4,
            deadline: float | None = None, on_sample: Callable[[Sample], None] | None = None, seed: int = 0,
            clock: Callable[[], float] = time.perf_counter) -> list[Sample]:
    """Steps of a real engine (punica.engine.engine.Engine, built with overlap_steps=False so that
    each `step` runs and finishes one whole step) over a grid of batch x prompt length, each point
    without LoRA and, when `adapters` are given, with a distinct adapter per request (they must
    be resident already, or the first steps wait for loads). Per point: `batch` requests are
    prefilled (their prefill steps, and decodes beside later prefills, are samples), then
    `num_decode_steps` decode-only steps, then one mixed step per `mixed_prefills` entry (a new
    prompt of that many tokens beside the batch's decodes, while the batch has room); then every
    request is aborted. The first point runs once more before, unrecorded (warm-up). What a step
    ran is the engine's own record of it (`Engine.last_step`). Stops starting points at `deadline`
    (a `clock` time)."""
    from punica.engine.sampling_params import SamplingParams

    if engine.overlaps_steps:
        raise ValueError("measure step times on an engine built with overlap_steps=False: an overlapped "
                         "step returns (and waits for) the step before it")
    max_batch = engine.config.max_batch_size
    needed = max(batch_sizes) + len(mixed_prefills)
    if adapters and len(adapters) < min(needed, max_batch):
        raise ValueError(f"distinct adapters for batches up to {min(needed, max_batch)} requests, got {len(adapters)}")
    rng = random.Random(seed)
    samples: list[Sample] = []
    modes = [False, True] if adapters else [False]
    grid = [(batch_sizes[0], prompt_lens[0], lora, False) for lora in modes]
    grid += [(b, p, lora, True) for b in batch_sizes for p in prompt_lens for lora in modes]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(engine.vocab_size) for _ in range(n)]

    def run_step(lora: bool, record: bool) -> bool:
        start = clock()
        engine.step()
        seconds = clock() - start
        shape = engine.last_step
        if shape is None:
            return False
        if record:
            sample = Sample(shape.num_requests, shape.num_context_tokens, shape.num_prefill_tokens, lora, seconds)
            samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
        return shape.num_prefill_tokens == 0

    for batch, prompt_len, lora, record in grid:
        if deadline is not None and clock() > deadline:
            break
        params = SamplingParams(max_tokens=max(1, engine.max_model_len - prompt_len), temperature=0, ignore_eos=True)
        ids = [engine.add_request(prompt(prompt_len), params, adapters[i] if lora else None) for i in range(batch)]
        decodes = 0
        while decodes < num_decode_steps and engine.has_unfinished():
            decodes += run_step(lora, record)
        for k, mixed in enumerate(mixed_prefills):
            if batch + k + 1 > max_batch:
                break
            one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            ids.append(engine.add_request(prompt(mixed), one, adapters[batch + k] if lora else None))
            run_step(lora, record)
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    return samples


def main() -> None:
    import argparse

    from punica.config import EngineArgs, add_arguments, from_arguments
    from punica.factory import build_engine

    parser = argparse.ArgumentParser(description="measure engine step times (no adapters) and fit the model; "
                                                 "benchmarks/cluster_step_time.py measures with adapters too")
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
    print(json.dumps({"model": asdict(model), "samples": [s._asdict() for s in samples]}))


if __name__ == "__main__":
    main()
