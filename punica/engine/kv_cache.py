"""Page accounting for the paged KV cache (torch-free): which pages each request holds."""

from __future__ import annotations

from punica.config import ceil_div
from punica.engine.request import Request


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"the KV cache needs at least one page of at least one token "
                             f"(got {num_pages} pages of {page_size})")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, request: Request, num_tokens: int) -> int:
        """Extra pages `request` needs to hold `num_tokens` tokens."""
        return max(0, ceil_div(num_tokens, self.page_size) - len(request.pages))

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        return self.pages_needed(request, num_tokens) <= len(self._free)

    def grow(self, request: Request, num_tokens: int) -> None:
        needed = self.pages_needed(request, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of pages: need {needed}, {len(self._free)} free")
        request.pages.extend(self._free.pop() for _ in range(needed))

    def free(self, request: Request) -> None:
        self._free.extend(reversed(request.pages))
        request.pages = []
        request.num_cached = 0
