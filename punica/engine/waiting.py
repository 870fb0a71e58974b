"""The scheduler's waiting queue and its tenants' accounts (torch-free).

The queue holds the requests waiting to run and, for every tenant (punica.engine.tenancy's
`tenant_key`), what it has queued and running, what the engine computed for it and its share. The
scheduler asks it which waiting request to admit next (`next_candidate`), in which order the
running requests keep their place (`rank`: under KV pressure the last is preempted first), and
which running request a waiting one takes the place of when the batch is full (`displaced`).
`FcfsQueue` answers in arrival order; punica.engine.fair_share.FairQueue by the tenants' service.

Service: each token the scheduler schedules (a prompt chunk's, a decode's) is charged to its
request's tenant: `num_computed_tokens` counts them, `service` counts them divided by the tenant's
weight (the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24). A tenant that returns from idle (nothing queued or running) has its service lifted to the
least service of the active tenants (to that of the last tenant to go idle, when none is active):
credit banked while away never lets it starve the others.

Both orders rank last the running requests of a tenant whose KV is over its max_kv_tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from punica.engine.request import Request
from punica.engine.tenancy import DEFAULT_SHARE, TenantLimitError, TenantShare, TenantStats, tenant_key


def key_of(request: Request) -> str | None:
    return tenant_key(request.tenant, request.adapter)


@dataclass
class TenantAccount:
    share: TenantShare
    num_waiting: int = 0
    num_running: int = 0
    num_computed_tokens: int = 0
    service: float = 0.0

    @property
    def active(self) -> bool:
        return self.num_waiting + self.num_running > 0


class WaitingQueue:
    """What both orders share: the tenants' accounts, caps and service. A subclass stores the
    requests (`_push`, `_remove`, iteration, `in`, len) and picks the next one to admit."""

    def __init__(self):
        self.tenants: dict[str | None, TenantAccount] = {}
        self._shares: dict[str, TenantShare] = {}
        self._num_active = 0
        self._idle_service = 0.0  # the service of the last tenant to go idle

    # shares and accounts -------------------------------------------------------------------
    @property
    def shares(self) -> dict[str, TenantShare]:
        """The shares given by name (set_shares); other tenants have the default one."""
        return dict(self._shares)

    def set_shares(self, shares: dict[str, TenantShare]) -> None:
        """Replace every tenant's share; a tenant not named gets the default one."""
        self._shares = dict(shares)
        for key, account in self.tenants.items():
            account.share = self._shares.get(key, DEFAULT_SHARE)

    def _account(self, key: str | None) -> TenantAccount:
        account = self.tenants.get(key)
        if account is None:
            account = self.tenants[key] = TenantAccount(self._shares.get(key, DEFAULT_SHARE))
        return account

    def check_room(self, key: str | None) -> None:
        """TenantLimitError if tenant `key` cannot queue one more request."""
        account = self.tenants.get(key)
        limit = self._shares.get(key, DEFAULT_SHARE).max_concurrent_requests
        if limit is not None and account is not None and account.num_waiting + account.num_running >= limit:
            raise TenantLimitError(key, limit)

    def charge(self, request: Request, num_tokens: int) -> None:
        account = self.tenants[key_of(request)]
        account.num_computed_tokens += num_tokens
        account.service += num_tokens / account.share.weight

    def max_kv_pages(self, key: str | None, page_size: int) -> int | None:
        """The pages the running requests of tenant `key` may hold together (None: no cap)."""
        limit = self.tenants[key].share.max_kv_tokens
        return None if limit is None else limit // page_size

    # where requests are ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new request, queued behind its tenant's."""
        account = self._account(key_of(request))
        if not account.active:
            self._returns(account)
        account.num_waiting += 1
        self._push(request, front=False)

    def admit(self, request: Request) -> None:
        """It leaves the queue for the batch."""
        self._remove(request)
        account = self.tenants[key_of(request)]
        account.num_waiting -= 1
        account.num_running += 1

    def preempted(self, request: Request) -> None:
        """It leaves the batch for the head of the queue."""
        account = self.tenants[key_of(request)]
        account.num_running -= 1
        account.num_waiting += 1
        self._push(request, front=True)

    def remove(self, request: Request) -> None:
        """It leaves the queue for good (finished or aborted while waiting)."""
        self._remove(request)
        account = self.tenants[key_of(request)]
        account.num_waiting -= 1
        self._left(account)

    def left_batch(self, request: Request) -> None:
        """It leaves the batch for good."""
        account = self.tenants[key_of(request)]
        account.num_running -= 1
        self._left(account)

    def _returns(self, account: TenantAccount) -> None:
        active = [a.service for a in self.tenants.values() if a.active]
        account.service = max(account.service, min(active) if active else self._idle_service)
        self._num_active += 1

    def _left(self, account: TenantAccount) -> None:
        if not account.active:
            self._num_active -= 1
            if not self._num_active:
                self._idle_service = account.service

    # order ---------------------------------------------------------------------------------
    def rank(self, running: list[Request], held_pages: dict[str | None, int], page_size: int) -> list[Request]:
        """The running requests in the order they keep their place (the last is preempted first):
        those of tenants holding more than their max_kv_tokens last, then by `_rank_key`, then in
        admission order. `held_pages`: the pages each tenant's running requests hold."""
        over = set()
        for key, pages in held_pages.items():
            limit = self.tenants[key].share.max_kv_tokens
            if limit is not None and pages * page_size > limit:
                over.add(key)
        return sorted(running, key=lambda r: (key_of(r) in over, *self._rank_key(r)))

    def _rank_key(self, request: Request) -> tuple:
        return ()

    def displaced(self, candidate: Request, ranked: list[Request], max_batch_size: int) -> Request | None:
        """The running request that waiting `candidate` takes the place of in a full batch (`ranked`:
        the running requests in rank order), or None: it waits for a request to leave."""
        return None

    def next_candidate(self, passed: set[Request], blocked: set[str | None]) -> Request | None:
        """The waiting request to admit next, but none of `passed` nor of the tenants in `blocked`."""
        raise NotImplementedError

    def _push(self, request: Request, front: bool) -> None:
        raise NotImplementedError

    def _remove(self, request: Request) -> None:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in arrival order (a preempted request at the head)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, request: Request) -> bool:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Request:
        """The index-th waiting request in arrival order."""
        return list(self)[index]

    # reports -------------------------------------------------------------------------------
    def stats(self, running: list[Request], page_size: int) -> dict[str | None, TenantStats]:
        """Each tenant's, from copies of the lists (a server reads them off the engine's thread)."""
        held: dict[str | None, int] = {}
        for request in list(running):
            held[key_of(request)] = held.get(key_of(request), 0) + len(request.pages)
        return {key: TenantStats(a.num_waiting, a.num_running, held.get(key, 0) * page_size, a.num_computed_tokens,
                                 a.service) for key, a in list(self.tenants.items())}


class FcfsQueue(WaitingQueue):
    """First come, first served, whoever the tenant: admission in arrival order, the newest running
    request preempted first."""

    def __init__(self):
        super().__init__()
        self._queue: deque[Request] = deque()

    def next_candidate(self, passed: set[Request], blocked: set[str | None]) -> Request | None:
        return next((r for r in self._queue if r not in passed and key_of(r) not in blocked), None)

    def _push(self, request: Request, front: bool) -> None:
        if front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def _remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request: Request) -> bool:
        return request in self._queue
