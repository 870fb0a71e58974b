"""OpenAI's objects built from the engine's outputs: the logprobs of tokens (the legacy form of
completions and chat's content entries), usage, and the error object."""

from __future__ import annotations

import itertools
from typing import Any

from punica.engine.engine import RequestOutput


class Logprobs:
    """The logprobs objects of tokens, each token named by its text under the model's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: a model served without a tokenizer

    def token_text(self, token_id: int) -> str:
        """A token's text; "token_id:N" (vLLM's form) for a model without a tokenizer."""
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def completion(self, token_ids: list[int], logprobs: list[float] | None,
                   tops: list[list[tuple[int, float]]] | None, prompt: RequestOutput | None = None,
                   offset: int = 0) -> dict | None:
        """OpenAI's legacy logprobs of these tokens, after those of the prompt when `prompt` (echo)
        has prompt logprobs (its first token's are null); text_offset: where each token's text starts
        (vLLM's way: the lengths of the tokens' texts before it, from `offset`)."""
        if logprobs is None:
            return None
        if prompt is not None and prompt.prompt_logprobs is not None:
            token_ids, logprobs = prompt.prompt_token_ids + token_ids, prompt.prompt_logprobs + logprobs
            tops = None if tops is None else prompt.prompt_top_logprobs + tops
        tokens = [self.token_text(t) for t in token_ids]
        top = None if tops is None else [
            None if row is None else {self.token_text(t): lp for t, lp in row} for row in tops]
        offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}

    def chat(self, token_ids: list[int], logprobs: list[float] | None,
             tops: list[list[tuple[int, float]]] | None) -> dict | None:
        if logprobs is None:
            return None
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
            top = [self._entry(u, ulp) for u, ulp in tops[i]] if tops is not None else []
            content.append({**self._entry(t, lp), "top_logprobs": top})
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def usage(prompts: list[list[int]], finals: list[RequestOutput]) -> dict:
    """OpenAI's usage of choices on these prompts (one each) that ended in `finals`; a prompt shared
    by n choices (the same list) counts once, with the cached tokens of its first choice."""
    seen, prompt, cached = set(), 0, 0
    for prompt_ids, final in zip(prompts, finals):
        if id(prompt_ids) not in seen:
            seen.add(id(prompt_ids))
            prompt += len(prompt_ids)
            cached += final.num_cached_tokens
    completion = sum(len(f.token_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: `kind` is its `type` ("invalid_request_error" for a client's error,
    "server_error" for ours), `param` the request field at fault, `code` a string or None."""
    return {"message": message, "type": kind, "param": param, "code": code}
