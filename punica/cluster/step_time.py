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

`fit` solves for the step coefficients from measured steps (least squares on relative error;
benchmarks/cluster_step_time.py measures them on the real engine). Models ship by name (`MODELS`,
`load_model`); a JSON file of the same fields works too (`punica simulate --step-time NAME|FILE`).
This module imports no torch.
"""

from __future__ import annotations

import json
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


# Fitted from engine steps measured on 2026-11-30 on this project's CPU machine
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
