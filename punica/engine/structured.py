"""Grammar state of constrained requests (structured outputs), on top of xgrammar.

xgrammar (the grammar engine of vLLM and SGLang) compiles a JSON schema, regex, choice or EBNF
grammar against the tokenizer's vocabulary once; its GrammarCompiler caches compiled grammars,
so requests with the same constraint share one. Each constrained request has its own
GrammarMatcher, advanced by every output token whose value reaches the host. Before a step
samples, `fill_bitmasks` writes, on the host, one row of allowed-token bits per constrained
request (xgrammar's BatchGrammarMatcher, over threads) and `apply_bitmasks` masks the logits of
those rows in one batched op on the logits' device; other rows are untouched. A grammar allows
its stop tokens (the engine's EOS tokens) only where the output is complete.
"""

from __future__ import annotations

import json
import os
import re
import time

import torch
import xgrammar as xgr

from punica.engine.sampling_params import StructuredOutputs

COMPILER_CACHE_BYTES = 256 << 20
MATCHER_THREADS = min(8, os.cpu_count() or 1)
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): a small model let free to put any whitespace
# between tokens can emit it without end and never close the object
JSON_FORMAT = {"any_whitespace": False}
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before a message


class GrammarError(ValueError):
    """A constraint the grammar engine rejects; the message says why, naming the constraint as
    structured_outputs.KIND. `kind` and `reason` let a caller name the constraint as its user wrote it."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"structured_outputs.{kind} is not accepted by the grammar engine: {reason}")
        self.kind, self.reason = kind, reason


def _rejected(spec: StructuredOutputs, error: Exception) -> GrammarError:
    return GrammarError(spec.kind, _LOG_PREFIX.sub("", str(error).strip()))


def check_grammar(spec: StructuredOutputs) -> None:
    """GrammarError if the grammar engine rejects the constraint. Needs no tokenizer, so a command
    can check its arguments before loading a model; compiling (GrammarCompiler) checks the same."""
    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(spec.json, **JSON_FORMAT)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None or spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar if spec.grammar is not None else _choice_grammar(spec.choice))
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from RuntimeError
        raise _rejected(spec, e) from e


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar of exactly one of the strings (EBNF string literals escape as JSON's do)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """One engine's compiler over its tokenizer, vocabulary and stop tokens, with its compiled-grammar
    cache; counts what it compiled and for how long (the server's metrics)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=True, cache_limit_bytes=COMPILER_CACHE_BYTES)
        self.batch = xgr.BatchGrammarMatcher(max_threads=MATCHER_THREADS)
        self.vocab_size = vocab_size
        self.compile_seconds = 0.0

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        try:
            if spec.json is not None:
                return self.compiler.compile_json_schema(spec.json, **JSON_FORMAT)
            if spec.json_object:
                return self.compiler.compile_json_schema('{"type": "object"}', **JSON_FORMAT)
            if spec.regex is not None:
                return self.compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return self.compiler.compile_grammar(_choice_grammar(spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from RuntimeError
            raise _rejected(spec, e) from e
        finally:
            self.compile_seconds += time.perf_counter() - start

    def matcher(self, spec: StructuredOutputs, output_token_ids: list[int] = ()) -> xgr.GrammarMatcher:
        """A matcher of the constraint that has accepted `output_token_ids` (a request resumed after
        them); GrammarError if the grammar engine rejects the constraint, ValueError if the tokens do not match it."""
        matcher = xgr.GrammarMatcher(self.compile(spec))
        for token in output_token_ids:
            if not matcher.accept_token(token):
                raise ValueError(f"the output tokens already generated do not match structured_outputs.{spec.kind}")
        return matcher

    def fill_bitmasks(self, matchers: list[xgr.GrammarMatcher], pin: bool) -> torch.Tensor:
        """Allowed-token bits [len(matchers), ceil(V / 32)] int32 on the host (pinned if `pin`), one
        row per matcher (bit t of a row: token t may come next)."""
        bitmask = torch.empty(xgr.get_bitmask_shape(len(matchers), self.vocab_size), dtype=torch.int32, pin_memory=pin)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask


def apply_bitmasks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with the tokens each row `rows[i]` may not take set to -inf (bits of
    bitmask[i], on the logits' device); the other rows are as they were."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))
