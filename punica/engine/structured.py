"""Grammar state of constrained requests (structured outputs), on top of xgrammar.

xgrammar (the grammar engine of vLLM and SGLang) compiles a JSON schema, regex, choice or EBNF
grammar against the tokenizer's vocabulary once, in a GrammarPool (punica.engine.grammar_pool: off
the engine's thread, under the limits of punica.engine.constraint, cached by canonical form), so
requests with the same constraint share one. Each constrained request has its own
GrammarMatcher, advanced by every output token whose value reaches the host. Before a step
samples, `fill_bitmasks` writes, on the host, one row of allowed-token bits per constrained
request (xgrammar's BatchGrammarMatcher, over threads) and `apply_bitmasks` masks the logits of
those rows in one batched op on the logits' device; other rows are untouched. A grammar allows
its stop tokens (the engine's EOS tokens) only where the output is complete.
"""

from __future__ import annotations

import os
import re

import torch
import xgrammar as xgr

from punica.engine.constraint import GrammarLimits, GrammarSource, choice_grammar, rejected
from punica.engine.grammar_pool import GrammarPool
from punica.engine.sampling_params import StructuredOutputs

MATCHER_THREADS = min(8, os.cpu_count() or 1)
# JSON as json.dumps writes it ({"a": 1, "b": [2, 3]}): a small model let free to put any whitespace
# between tokens can emit it without end and never close the object
JSON_FORMAT = {"any_whitespace": False}
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before a message


def check_grammar(spec: StructuredOutputs) -> None:
    """GrammarError (punica.engine.constraint) if the grammar engine rejects the constraint. Needs no
    tokenizer, so a command can check its arguments before loading a model; compiling (GrammarCompiler)
    checks the same."""
    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(spec.json, **JSON_FORMAT)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None or spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar if spec.grammar is not None else choice_grammar(spec.choice))
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from RuntimeError
        raise rejected(spec.kind, _LOG_PREFIX.sub("", str(e).strip())) from e


class GrammarCompiler:
    """One engine's grammars over its tokenizer, vocabulary and stop tokens: compiled by `pool` (off
    the calling thread, under the limits, through its cache; it counts the compiles and their time
    for the server's metrics), matched by a GrammarMatcher per request, masks filled per step."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], limits: GrammarLimits):
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        # one thread a compile (xgrammar's default is 8): on 2 cores beside the engine, the 256-level
        # schema of benchmarks/grammar_stall.py compiled in 0.8 s instead of 3.6 s, and the engine's
        # stream kept its pace; several compiles run at once on the pool's threads
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)  # the pool caches
        self.pool = GrammarPool(self._compile_source, limits)
        self.batch = xgr.BatchGrammarMatcher(max_threads=MATCHER_THREADS)
        self.vocab_size = vocab_size

    def _compile_source(self, source: GrammarSource) -> xgr.CompiledGrammar:
        try:
            if source.kind == "json":
                return self.compiler.compile_json_schema(source.text, **JSON_FORMAT)
            if source.kind == "regex":
                return self.compiler.compile_regex(source.text)
            return self.compiler.compile_grammar(source.text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from RuntimeError
            raise ValueError(_LOG_PREFIX.sub("", str(e).strip())) from e

    def matcher(self, spec: StructuredOutputs, grammar: xgr.CompiledGrammar,
                output_token_ids: list[int] = ()) -> xgr.GrammarMatcher:
        """A matcher of the compiled constraint that has accepted `output_token_ids` (a request resumed
        after them); ValueError if they do not match it."""
        matcher = xgr.GrammarMatcher(grammar)
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
