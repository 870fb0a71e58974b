"""Fair share across tenants (torch-free): the waiting queue of `--scheduling fair`.

Virtual Token Counter scheduling (Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24): the next request admitted is the oldest waiting one of the tenant with the least service
(the tokens computed for it over its weight, punica.engine.waiting), so over time each backlogged
tenant is served in proportion to its weight, whatever rate it sends at; within a tenant, first come
first served (a preempted request at the head). Under KV pressure the newest running request of the
tenant with the most service is preempted first. When the batch is full, a waiting request takes
the place of the newest running request of the most served tenant that either has had more service
than the waiting one's by over a margin, or (while the waiting one's tenant is under its share of
the batch's places) holds more than its own share (`displaced`): a flood holding the whole batch
does not make the other tenants wait for its requests to end, and a steady tenant whose requests
come in a burst is not held to its share of the places while it is served less than the flood. A
tenant's service is charged as its tokens are
scheduled, so a tenant does not take the whole batch in one step by being least served at its start.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from punica.engine.request import Request
from punica.engine.waiting import WaitingQueue, key_of


class FairQueue(WaitingQueue):
    def __init__(self, margin: float = 512.0):
        super().__init__()
        self.margin = margin  # service (tokens / weight) by which a tenant must trail another to take its place
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

    def displaced(self, candidate: Request, ranked: list[Request], max_batch_size: int) -> Request | None:
        """The newest running request of the most served of the tenants that `candidate` may take a
        place from, None if there is none. It may take one from a tenant
        - whose service is more than its own tenant's by over `margin` (one step's charges do not
          reverse the order, so two tenants do not trade places step after step), or
        - that holds more than its share of the places and stays at or over it with one fewer, while
          `candidate`'s tenant stays within its own with one more (no pair of tenants trades places
          back and forth); this lets a tenant back from idle, whose service was lifted to the least
          of the active tenants', in at once.
        A tenant's share of the places: max_batch_size * its weight / the active tenants' weights."""
        active = {key: a for key, a in self.tenants.items() if a.active}
        total = sum(a.share.weight for a in active.values())

        def share(key: str | None) -> float:
            return max_batch_size * active[key].share.weight / total

        mine = key_of(candidate)
        under = active[mine].num_running + 1 <= share(mine)
        eligible = [key for key in {key_of(r) for r in ranked} - {mine}
                    if active[key].service > active[mine].service + self.margin
                    or (under and active[key].num_running - 1 >= share(key))]
        if not eligible:
            return None
        victim = max(eligible, key=lambda key: active[key].service)
        return next(r for r in reversed(ranked) if key_of(r) == victim)

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
