"""Incremental detokenization, correct for multi-byte characters split across tokens, with stop strings.

Each token decodes the window of ids since the last text was emitted (and a few before, for word
boundaries). A token that the decode skips (a special token: EOS that `ignore_eos` runs past, a
chat-template marker) adds no text, and it is not put in the window: otherwise the window would never
close, and each such token would decode every one before it again, a cost quadratic in the run.
"""

from __future__ import annotations

# tokens of the prompt decoded with the output, so that word-boundary spaces come out right
CONTEXT_TOKENS = 6


def skipped_ids(tokenizer) -> frozenset[int]:
    """The ids that `tokenizer.decode(..., skip_special_tokens=True)` drops: its special tokens (none
    for a tokenizer that names none)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return (frozenset(i for i, token in added.items() if token.special)
            | frozenset(getattr(tokenizer, "all_special_ids", ())))


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False, skipped: frozenset[int] | None = None):
        """`skipped`: skipped_ids(tokenizer), made once per tokenizer by the caller (None: made here)."""
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer) if skipped is None else skipped
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop, self.include_stop = stop, include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self.num_emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int) -> bool:
        """Append one output token; True when a stop string ended the text."""
        if self.stopped:
            raise RuntimeError("token added after a stop string")
        if token_id in self.skipped:
            return False  # no text, and no part of any other token's (module docstring)
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[: at + len(s) if self.include_stop else at]
                self.stopped = True
                return True
        return False

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; holds back a tail that could still become a stop string."""
        end = len(self.text)
        if self.stop and not (finished or self.stopped):
            end = max(self.num_emitted, end - self.max_stop_len + 1)
        new, self.num_emitted = self.text[self.num_emitted:end], end
        return new
