"""Page accounting for the paged KV cache (torch-free): which pages each request holds, and the
prefix cache of full pages.

Prefix caching: a full page's K and V are a function of the model, the adapter and every token
up to the page's end, so a full page is named by a hash chain: digest(page i) = sha256(digest(page
i - 1), namespace, the page's token ids), the namespace being the adapter's identity (base
requests share one), the request's tenant and its cache salt. The identity is the adapter's
registration version, which changes on every load, never its name alone, and the request's
lora_scale: a tenant that loads new weights under the same name never reads KV its old weights
made. The tenant and the salt keep the cache private: a request finds only pages that requests of
its own tenant and salt computed (so its cached_tokens and time to first token say nothing of
other tenants' prompts). SHA-256, not Python's hash, because a tenant who could make a collision
would read another tenant's KV.

Pages are reference-counted. A page whose last holder lets go returns to the free list, or, if
it is in the prefix cache, stays there (its KV intact) until the allocator needs a page and no
never-cached one is left: then the least recently released cached page is taken. Requests
release their pages last page first, so a chain's tail leaves the cache before its head.

Free pages are handed out from the two ends of one list: a request still in its prompt takes the
lowest (at first; then the last freed, a freed request's pages in their order), a decoding one the
highest, unless the page at the low end follows its last page. So a prompt prefilled in chunks
beside running decodes holds consecutive pages, not pages interleaved with the decodes' new ones,
a long prompt's decode goes on in the pages after it while nobody took them, and the CPU attention
reads such a context in place instead of copying it (punica.ops.attention_cpu).

When an adapter is unregistered (`drop`), the pages its KV fills leave the cache at once: nobody
can hit them again (a new registration is a new namespace), so they should not outlive live pages
in the LRU order.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from array import array
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from punica.config import ceil_div
from punica.engine.request import PENDING, Request

if TYPE_CHECKING:
    from punica.lora.manager import Registration


def namespace(request: Request) -> bytes:
    """Whose KV a request makes: the base model's, or that of one registration of its adapter at
    the request's lora_scale (the scale changes k_proj's and v_proj's outputs as the weights do);
    then, if it has a tenant or a cache salt, those two as a JSON array after a NUL byte (JSON
    escapes a NUL, so no two namespaces read alike)."""
    if request.adapter is None:
        weights = b"base"
    else:
        weights = f"adapter {request.adapter} #{request.registration.version} x{request.params.lora_scale!r}".encode()
    if request.tenant is None and request.cache_salt is None:
        return weights
    return weights + b"\0" + json.dumps([request.tenant, request.cache_salt]).encode()


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"the KV cache needs at least one page of at least one token "
                             f"(got {num_pages} pages of {page_size})")
        self.num_pages, self.page_size = num_pages, page_size
        self.prefix_caching = prefix_caching
        self._free = deque(range(num_pages - 1, -1, -1))  # pop(): low pages first; popleft(): high
        self._refs = [0] * num_pages
        self._digest_of: dict[int, bytes] = {}           # cached page -> its digest
        self._page_of: dict[bytes, int] = {}             # digest -> cached page
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recent first
        self._owner_of: dict[int, Registration | None] = {}        # cached page -> whose KV (None: base)
        self._pages_of: dict[Registration | None, set[int]] = {}   # the inverse
        self._dropped: weakref.WeakSet[Registration] = weakref.WeakSet()  # unregistered, still held by requests

    @property
    def num_free(self) -> int:
        """Pages a request can take: never-cached ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages some request holds."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages in the prefix cache, held or not."""
        return len(self._page_of)

    def pages_needed(self, request: Request, num_tokens: int) -> int:
        """Extra pages `request` needs to hold `num_tokens` tokens."""
        return max(0, ceil_div(num_tokens, self.page_size) - len(request.pages))

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        return self.pages_needed(request, num_tokens) <= self.num_free

    def grow(self, request: Request, num_tokens: int) -> None:
        needed = self.pages_needed(request, num_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"KV cache out of pages: need {needed}, {self.num_free} free")
        decoding = request.num_cached >= len(request.prompt_token_ids)  # the module docstring
        for _ in range(needed):
            if not self._free:
                page = self._evict()
            elif not decoding or (request.pages and self._free[-1] == request.pages[-1] + 1):
                page = self._free.pop()
            else:
                page = self._free.popleft()
            self._refs[page] = 1
            request.pages.append(page)

    def _evict(self) -> int:
        page, _ = self._idle.popitem(last=False)
        self._uncache(page)
        return page

    def _uncache(self, page: int) -> None:
        del self._page_of[self._digest_of.pop(page)]
        owner = self._owner_of.pop(page)
        self._pages_of[owner].discard(page)
        if not self._pages_of[owner]:
            del self._pages_of[owner]

    def free(self, request: Request, cache: bool = True) -> None:
        """Let go of the request's pages; `cache`: first put its full pages into the prefix cache
        (False when its KV may be wrong, e.g. its step failed)."""
        if cache:
            self.cache_full_pages(request)
        for page in reversed(request.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._digest_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
        request.pages = []
        request.num_cached = 0
        request.num_pages_cached = 0

    # the prefix cache -------------------------------------------------------------------------
    def _digests(self, request: Request, num_pages: int) -> list[bytes]:
        """The digests of the request's first `num_pages` full pages (fewer if its tokens run out or
        one is still PENDING), computed once per request."""
        digests = request.page_digests
        size = self.page_size
        num_pages = min(num_pages, (request.num_tokens - request.num_pending) // size)
        if len(digests) < num_pages:
            tokens = request.token_ids[len(digests) * size:num_pages * size]
            assert PENDING not in tokens
            parent = digests[-1] if digests else namespace(request)
            data, page_bytes = array("q", tokens).tobytes(), size * array("q").itemsize
            for i in range(len(tokens) // size):
                parent = hashlib.sha256(parent + data[i * page_bytes:(i + 1) * page_bytes]).digest()
                digests.append(parent)
        return digests[:num_pages]

    def match(self, request: Request) -> list[int]:
        """The cached pages of the longest prefix of the request's tokens that is cached, in whole
        pages and short of its last token (a step must compute at least one token to sample from)."""
        if not self.prefix_caching or request.pages:
            return []
        hit = []
        for digest in self._digests(request, (request.num_tokens - 1) // self.page_size):
            page = self._page_of.get(digest)
            if page is None:
                break
            hit.append(page)
        return hit

    def num_free_after(self, hit: list[int]) -> int:
        """num_free once the request took its hit pages (those nobody held were counted free)."""
        return self.num_free - sum(self._refs[page] == 0 for page in hit)

    def take(self, request: Request, hit: list[int]) -> None:
        """Give a request without pages the cached pages `match` found: their tokens count as computed."""
        assert not request.pages
        for page in hit:
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
        request.pages = list(hit)
        request.num_pages_cached = len(hit)
        request.num_cached = len(hit) * self.page_size

    def drop(self, registration: Registration) -> None:
        """Forget the KV of an unregistered adapter: its cached pages nobody holds are free at once,
        held ones leave the cache (free when let go), and its requests still running cache nothing."""
        self._dropped.add(registration)
        for page in list(self._pages_of.get(registration, ())):
            self._uncache(page)
            if self._refs[page] == 0:
                del self._idle[page]
                self._free.append(page)

    def cache_full_pages(self, request: Request) -> None:
        """Put the request's pages that are full of computed tokens into the prefix cache (a page
        whose digest another page already has stays the request's own)."""
        if not self.prefix_caching:
            return
        full = min(request.num_cached, request.num_tokens) // self.page_size
        if full <= request.num_pages_cached or request.registration in self._dropped:
            return
        digests = self._digests(request, full)
        for i in range(request.num_pages_cached, len(digests)):
            page = request.pages[i]
            if digests[i] not in self._page_of and page not in self._digest_of:
                self._page_of[digests[i]] = page
                self._digest_of[page] = digests[i]
                self._owner_of[page] = request.registration
                self._pages_of.setdefault(request.registration, set()).add(page)
        request.num_pages_cached = len(digests)
