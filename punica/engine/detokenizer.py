"""Incremental detokenization, correct for multi-byte characters split across tokens, with stop strings."""

from __future__ import annotations

# tokens of the prompt decoded with the output, so that word-boundary spaces come out right
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
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
