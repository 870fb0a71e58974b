"""One GPU's engine, as a cluster worker: it hands preempted requests back to the cluster
scheduler instead of requeueing them locally, and resumes requests that already have output.

Resuming recomputes prompt + generated tokens with the same SamplingParams; seeded sampling
is keyed by position and penalties see the same output tokens, so a migrated request produces
exactly the tokens it would have produced where it started.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from punica.config import ModelConfig
from punica.engine.engine import Engine, RequestOutput
from punica.engine.sampling_params import SamplingParams


class MigratableEngine(Engine):
    """An Engine whose requests can leave (`take_preempted`) and arrive mid-generation (`resume_request`)."""

    def resume_request(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                       request_id: str, output_token_ids: list[int]) -> str:
        """Add a request that has already generated `output_token_ids` elsewhere."""
        request_id = self.add_request(prompt_token_ids, params, adapter, request_id)
        self.requests[request_id].output_token_ids.extend(output_token_ids)
        detokenizer = self._detokenizers.get(request_id)
        if detokenizer is not None:
            for token in output_token_ids:
                detokenizer.add_token(token)
            detokenizer.take_new_text(finished=False)  # that text was streamed where it ran before
        return request_id

    def take_preempted(self) -> list[tuple[str, list[int]]]:
        """Remove every request this engine preempted (it ran out of KV cache) and return
        (request_id, output_token_ids) of each, newest first, to be placed again elsewhere."""
        preempted = [r for r in self.scheduler.waiting if r.num_preemptions]
        taken = [(r.request_id, r.resolved_output_token_ids) for r in preempted]
        for request in preempted:
            self.abort(request.request_id)
        return taken


@dataclass(frozen=True)
class WorkerInfo:
    kv_tokens: int
    max_batch_size: int
    max_model_len: int
    model_config: ModelConfig   # what an adapter must fit (the driver checks adapters against it)


@dataclass(frozen=True)
class StepResult:
    outputs: list[RequestOutput]
    evicted: list[tuple[str, list[int]]]   # (request_id, output_token_ids) handed back
    num_unfinished: int


class EngineWorker:
    """Runs one MigratableEngine; the Ray backend wraps this class as an actor."""

    def __init__(self, model: str | None, adapters: dict[str, str] | None, engine_kwargs: dict,
                 device: str | None = None, dtype: str | None = None):
        import torch

        from punica.config import EngineConfig
        from punica.engine.llm import generation_eos_ids, resolve_dtype
        from punica.models.loader import load_model

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu":
            torch.set_num_threads(1)  # workers share the machine's cores
        loaded, model_dir = load_model(model, resolve_dtype(dtype, device), device)
        tokenizer = load_tokenizer(model_dir)
        self.engine = MigratableEngine(loaded, tokenizer, EngineConfig(**engine_kwargs), adapters,
                                       generation_eos_ids(model_dir))

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(e.allocator.num_pages * e.allocator.page_size, e.config.max_batch_size, e.max_model_len,
                          e.adapters.config)

    def adapters(self) -> dict[str, str]:
        """The adapters this worker serves: name -> directory."""
        return {name: str(path) for name, path in self.engine.adapters.registry.items()}

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """Make the served adapters equal `adapters` (name -> directory): unload the others (as
        Engine.unload_adapter: running requests finish, queued ones fail), register the missing
        ones. Idempotent; the driver sends its whole set on every change and when a worker joins."""
        wanted = {name: Path(path) for name, path in adapters.items()}
        registry = self.engine.adapters.registry
        for name in [n for n, path in registry.items() if wanted.get(n) != path]:
            self.engine.unload_adapter(name)
        for name, path in wanted.items():
            if name not in registry:
                self.engine.load_adapter(name, str(path))

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            adapter: str | None, output_token_ids: list[int]) -> None:
        self.engine.resume_request(prompt_token_ids, params, adapter, request_id, output_token_ids)

    def step(self) -> StepResult:
        outputs = self.engine.step()
        evicted = self.engine.take_preempted()
        return StepResult(outputs, evicted, len(self.engine.requests))

    def release(self, request_ids: list[str]) -> list[tuple[str, list[int]]]:
        """Take requests out unfinished (the cluster evicts them): (request_id, output_token_ids)."""
        taken = []
        for request_id in request_ids:
            request = self.engine.requests.get(request_id)
            if request is not None:
                taken.append((request_id, request.resolved_output_token_ids))  # a token in flight is recomputed
                self.engine.abort(request_id)
        return taken

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (token-id-only test models)."""
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
