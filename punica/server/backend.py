"""Backend: what the OpenAI server needs of whatever runs its requests. AsyncEngine (one engine in
this process) and ClusterBackend (engines on Ray workers) both implement it; the server uses
nothing else of them. Each also hands every request's end to an `on_finished` callback (the
metrics) exactly once, however the request ended."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from punica.engine.outputs import RequestOutput
from punica.engine.sampling_params import SamplingParams
from punica.engine.tenancy import TenantShare


@runtime_checkable
class Backend(Protocol):
    @property
    def max_model_len(self) -> int:
        """The longest prompt + output any request may have."""

    @property
    def vocab_size(self) -> int:
        """Token ids of prompts must be below this."""

    def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                 request_id: str, *, tenant: str | None = None,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; the last has finished=True. Raises ValueError for a
        request the engine rejects. Leaving the iteration early aborts the request. `tenant` and
        `cache_salt` as Engine.add_request's."""

    def check_room(self, tenant: str | None, adapter: str | None) -> None:
        """TenantLimitError (punica.engine.tenancy) when the tenant of a request of `tenant` on
        `adapter` has its max_concurrent_requests: cheap, for the server to ask before it does any
        work for a request; `generate` checks again."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds; nothing if it is unknown or finished."""

    def has_adapter(self, name: str) -> bool: ...

    async def adapter_residency(self) -> dict:
        """The body of GET /v1/adapters: where each adapter is and its load counters
        (punica.server.residency)."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve a new adapter; ValueError (a 400) for a broken adapter or a name in use."""

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter; ValueError (a 404) for one not served."""

    async def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """The tenants' fair-share settings (Engine.set_tenants), on every engine; running requests keep running."""

    def num_waiting(self) -> int:
        """Requests queued, not yet running (the server's --max-queue counts these)."""

    def update_gauges(self, metrics) -> None:
        """Set punica.server.metrics.Metrics' gauges from the backend's state."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...
