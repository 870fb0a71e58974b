"""Fair share across tenants (torch-free): the waiting queue of `--scheduling fair`.

Virtual Token Counter scheduling (Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24): the next request admitted is the oldest waiting one of the tenant with the least service
(the tokens computed for it over its weight, punica.engine.waiting), so over time each backlogged
tenant is served in proportion to its weight, whatever rate it sends at; within a tenant, first come
first served (a preempted request at the head). Under KV pressure the newest running request of the
tenant with the most service is preempted first. A tenant's service is charged as its tokens are
scheduled, so a tenant does not take the whole batch in one step by being least served at its start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from punica.engine.request import Request
from punica.engine.waiting import WaitingQueue, key_of


class FairQueue(WaitingQueue):
    def __init__(self):
        super().__init__()
        self._queues: dict[str | None, deque[Request]] = {}  # per tenant with waiting requests, in order
        self._order: dict[Request, int] = {}  # arrival order (a preempted request's is below all others')
        self._num_pushed, self._num_pushed_front = 0, 0

    def next_candidate(self, passed: set[Request], blocked: set[str | None]) -> Request | None:
        best, best_rank = None, None
        for key, queue in self._queues.items():
            if key in blocked:
                continue
            request = next((r for r in queue if r not in passed), None)
            if request is None:
                continue
            rank = (self.tenants[key].service, self._order[request])  # ties: the one that came first
            if best_rank is None or rank < best_rank:
                best, best_rank = request, rank
        return best

    def _rank_key(self, request: Request) -> tuple:
        return (self.tenants[key_of(request)].service,)

    def _push(self, request: Request, front: bool) -> None:
        queue = self._queues.setdefault(key_of(request), deque())
        if front:
            self._num_pushed_front += 1
            self._order[request] = -self._num_pushed_front
            queue.appendleft(request)
        else:
            self._num_pushed += 1
            self._order[request] = self._num_pushed
            queue.append(request)

    def _remove(self, request: Request) -> None:
        key = key_of(request)
        queue = self._queues[key]
        queue.remove(request)
        if not queue:
            del self._queues[key]
        del self._order[request]

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._order, key=self._order.__getitem__))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, request: Request) -> bool:
        return request in self._order
