"""The offline API: `LLM(...).generate(prompts, params, adapter)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from punica.config import EngineArgs
from punica.engine.engine import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.factory import build_engine


class LLM:
    """`model`: an HF checkpoint directory, a .gguf file, or None for the embedded default;
    `adapters`: name -> PEFT directory (None: the demo adapters of the embedded default model);
    `engine_args`: any field of punica.config.EngineArgs (max_batch_size, dtype, device,
    tensor_parallel_size, kv_cache_tokens, enforce_eager, ...)."""

    def __init__(self, model: str | None = None, adapters: dict[str, str] | None = None, **engine_args):
        self.engine = build_engine(EngineArgs(model=model, **engine_args), adapters)
        self.tokenizer = self.engine.tokenizer

    def chat_prompt(self, user_message: str) -> str:
        """The prompt for one user turn, through the tokenizer's chat template if it has one."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            return user_message
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False)

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | None | Sequence[str | None] = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (one string or token list, or a list of them)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        n = len(prompt_list)
        param_list = _per_prompt(params or SamplingParams(), n, "params")
        adapter_list = _per_prompt(adapter, n, "adapter")
        ids: list[str] = []
        for i, (p, sp, a) in enumerate(zip(prompt_list, param_list, adapter_list)):
            try:
                ids.append(self.engine.add_request(p, sp, a))
            except ValueError as e:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise ValueError(f"prompt {i}: {e}") from e
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="generate", disable=not (use_tqdm if use_tqdm is not None else n >= 64))
        for outputs in self.engine.steps():
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def close(self) -> None:
        """Stop the engine's processes (tensor parallelism); the engine is unusable afterwards."""
        self.engine.close()


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
