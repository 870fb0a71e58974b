"""The OpenAI-compatible HTTP server: FastAPI app, errors, auth, models, adapters, metrics, playground."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from punica.engine.tenancy import TenantLimitError
from punica.lora.adapter_config import AdapterError
from punica.server.adapter_paths import resolved_inside, top_folder
from punica.server.args import DEFAULT_MAX_REQUEST_BYTES
from punica.server.backend import Backend
from punica.server.interrupts import InFlight
from punica.server.limits import RequestBodyLimit
from punica.server.metrics import Metrics
from punica.server.openai_api import CLIENT_CLOSED_REQUEST, OpenAIHandlers
from punica.server.openai_objects import error_body
from punica.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    ProtocolError,
    UnloadLoraRequest,
)
from punica.server.residency import LISTING_KEYS
from punica.server.tenant_reload import TenantsReload
from punica.server.tenants import Caller, Tenants, keys_caller

log = logging.getLogger("punica.server")
PLAYGROUND = Path(__file__).parent / "playground.html"
RETRY_AFTER_S = 1
RESIDENCY_WAIT_S = 2.0  # /metrics waits this long for the adapters' residency


@dataclass
class ServerState:
    backend: Backend  # AsyncEngine, or punica.server.cluster_backend.ClusterBackend
    tokenizer: object
    base_model_name: str
    adapter_dirs: list[Path] = field(default_factory=list)
    api_key: str | None = None
    max_queue: int = 1024
    metrics: Metrics = field(default_factory=Metrics)
    in_flight: InFlight = field(default_factory=InFlight)
    admin_api_key: str | None = None
    tenants: Tenants | None = None  # with it, the keys are those of the tenants and the admin (no api_key then)
    metrics_public: bool = False    # /metrics needs no key even where an admin key exists

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def has_admin_key(self) -> bool:
        """Whether the admin is told apart by a key (a tenants file or --admin-api-key), rather than
        every caller with the API key being the admin."""
        return self.tenants is not None or self.admin_api_key is not None

    def caller(self, authorization: str | None) -> Caller:
        """Who sends a request with this Authorization header; a 401 for a missing or unknown key
        where a key is needed."""
        key = authorization.removeprefix("Bearer ") if authorization and authorization.startswith("Bearer ") else None
        if self.tenants is not None:
            caller = self.tenants.identify(key) if key is not None else None
        else:
            caller = keys_caller(key, self.api_key, self.admin_api_key)
        if caller is not None:
            return caller
        if authorization is None:  # OpenAI's code: null when no key is given, invalid_api_key for a wrong one
            raise ProtocolError("missing API key: send it in an Authorization: Bearer KEY header", status=401)
        raise ProtocolError("invalid API key (Authorization: Bearer KEY)", status=401, code="invalid_api_key")

    async def resolve_model(self, model: str, caller: Caller) -> str | None:
        """The adapter a `model` field names (None for the base model); 404 for anything else,
        including an adapter the caller may not use (the same answer as for a name no one serves)."""
        if model == self.base_model_name:
            return None
        if self.backend.has_adapter(model) and caller.may_use(model):
            return model
        raise ProtocolError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")

    def check_may_manage(self, caller: Caller, name: str, authorization: str | None) -> None:
        """A 403 (401 without a key) unless the caller may load and unload adapters named `name`."""
        if caller.may_manage(name):
            return
        if caller.manages_adapters:
            raise ProtocolError(f"tenant {caller.tenant!r} may not load or unload {name!r}: its adapters are "
                                f"named {', '.join(caller.adapters) or '(none)'}", status=403, param="lora_name")
        raise denied("loading and unloading adapters needs the admin API key", authorization)

    async def set_tenants(self, tenants: Tenants) -> None:
        """Serve these tenants from now on: their shares go to the engine first, then their keys
        and rights apply at the edge. Requests already accepted keep going."""
        await self.backend.set_tenants(tenants.shares)
        self.tenants = tenants

    def check_tenant_room(self, tenant: str | None, adapter: str | None) -> None:
        """A 429 when the tenant of a request of `tenant` on `adapter` has its max_concurrent_requests
        (Backend.check_room): asked before any work is done for the request (its prompt tokenized,
        its grammar read), so a tenant flooding past its cap costs the server little."""
        try:
            self.backend.check_room(tenant, adapter)
        except TenantLimitError as e:
            raise ProtocolError(str(e), status=429, kind="requests", code="rate_limit_exceeded") from e

    def check_queue(self, num_new: int) -> None:
        if self.backend.num_waiting() + num_new > self.max_queue:
            raise ProtocolError(f"the queue is full ({self.max_queue} requests wait); retry later",
                                status=429, kind="requests", code="rate_limit_exceeded")

    def allowed_adapter_path(self, path: str, caller: Caller) -> Path:
        """A path inside one of the configured adapter directories, or a 4xx. A tenant reads only
        below the folders, directly in an adapter directory, named like the adapters it may use:
        not another tenant's weights under a name of its own."""
        if not self.adapter_dirs:
            raise ProtocolError("loading adapters at run time is disabled: start the server with --adapter-dir",
                                status=400)
        real = resolved_inside(path, self.adapter_dirs)
        if real is None:
            raise ProtocolError(f"lora_path {path!r} is outside the configured adapter directories", status=403,
                                param="lora_path")
        folder = top_folder(real, self.adapter_dirs)
        if not caller.admin and (folder is None or not caller.may_use(folder)):
            raise ProtocolError(f"lora_path {path!r} is not in a folder of tenant {caller.tenant!r}: it loads from "
                                f"the folders, directly in an adapter directory, named "
                                f"{', '.join(caller.adapters) or '(none)'}", status=403, param="lora_path")
        return real


def denied(message: str, authorization: str | None) -> ProtocolError:
    """A 403 for a caller whose key does not allow what it asks; a 401 for one who sent no key."""
    if authorization is None:
        return ProtocolError(f"missing API key: {message}", status=401)
    return ProtocolError(message, status=403)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": error_body(message, kind, param, code)}, status_code=status, headers=headers)


def _dotted(loc) -> str:
    return ".".join(str(x) for x in loc)


def validation_problem(errors: list[dict]) -> tuple[str, str | None]:
    """The message and `param` of a 400 for pydantic's errors: every unknown field named, as
    OpenAI does ("Unrecognized request argument supplied: foo"), then each other problem; param
    is the field of the first problem (pydantic's loc, "messages.0.role"), None for the body."""
    params, unknown, problems = [], [], []
    for err in errors:
        ctx = err.get("ctx") or {}
        if err["type"] == "json_invalid":
            params.append(None)
            problems.append(f"the body is not valid JSON ({ctx.get('error', err['msg'])})")
            continue
        loc = err["loc"][1:] if err["loc"][:1] == ("body",) else err["loc"]
        where = ctx.get("param") or (_dotted(loc) if loc else None)
        params.append(where)
        if err["type"] == "extra_forbidden":
            unknown.append(where)
        elif err["msg"].startswith(f"{where} "):  # a message of ours, which names the field itself
            problems.append(err["msg"])
        else:
            problems.append(f"{where or 'body'}: {err['msg']}")
    parts = [f"Unrecognized request argument supplied: {', '.join(unknown)}"] if unknown else []
    parts += [f"invalid request: {'; '.join(problems)}"] if problems else []
    return "; ".join(parts), next((p for p in params if p), None)


class CountRejections:
    """ASGI middleware: every HTTP answer with a 4xx or 5xx status goes to punica_rejected_requests_total
    (an exception no handler answered counts as the 500 Starlette sends), except the 499 of a client
    that went away (counted as an aborted request)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                if status >= 400 and status != CLIENT_CLOSED_REQUEST:
                    self.metrics.rejected.labels(str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.rejected.labels("500").inc()
            raise


async def request_caller(request: Request) -> Caller:
    """Who sends the request (a FastAPI dependency): ServerState.caller, with a 401 for a missing or
    unknown key. Async, so that it runs on the event loop: a sync dependency would take a trip
    through a thread pool for every request."""
    return request.app.state.server.caller(request.headers.get("authorization"))


Authorized = Annotated[Caller, Depends(request_caller)]


def build_app(state: ServerState, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              tenants_file: str | None = None) -> FastAPI:
    """The app of `state`. `tenants_file`: read it again on SIGHUP (the app must run in the main thread)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.backend.start()
        if state.tenants is not None:
            await state.backend.set_tenants(state.tenants.shares)
        reload = TenantsReload(state, tenants_file) if tenants_file is not None else None
        if reload is not None:
            reload.install()
        yield
        if reload is not None:
            reload.uninstall()
        await state.backend.shutdown()

    # no /docs or /redoc (their pages load scripts from a CDN); /openapi.json is served below, behind the API key
    app = FastAPI(title="punica", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestBodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(CountRejections, metrics=state.metrics)  # outermost: counts the 413s too
    handlers = OpenAIHandlers(state)

    @app.exception_handler(ProtocolError)
    async def protocol_error(request: Request, e: ProtocolError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return error_response(e.status, str(e), e.kind, e.param, headers, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        message, param = validation_problem(e.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, message, kind)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error_response(500, f"internal error: {e}", "server_error")

    async def admin_only(request: Request, caller: Authorized) -> None:
        if not caller.admin:
            raise denied(f"{request.url.path} needs the admin API key", request.headers.get("authorization"))

    async def metrics_access(request: Request) -> None:
        if state.has_admin_key and not state.metrics_public:
            await admin_only(request, await request_caller(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, caller: Authorized):
        return await handlers.completions(body, request, caller)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, caller: Authorized):
        return await handlers.chat(body, request, caller)

    @app.get("/v1/models")
    async def models(caller: Authorized):
        """The base model and the adapters the caller may use; their directories for the admin only."""
        adapters = [a for a in (await state.backend.adapter_residency())["data"] if caller.may_use(a["id"])]
        created = int(time.time())
        data = [{"id": state.base_model_name, "object": "model", "created": created, "owned_by": "punica",
                 "root": state.base_model_name, "parent": None}]
        data += [{"id": a["id"], "object": "model", "created": created, "owned_by": "punica",
                  **({"root": a["path"]} if caller.admin else {}), "parent": state.base_model_name,
                  **{k: v for k, v in a.items() if k not in LISTING_KEYS}}
                 for a in adapters]
        return {"object": "list", "data": data}

    @app.get("/v1/adapters", dependencies=[Depends(admin_only)])
    async def adapters():
        return await state.backend.adapter_residency()

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoraRequest, request: Request, caller: Authorized):
        try:
            await load_adapter(body, caller, request.headers.get("authorization"))
        except Exception:
            state.metrics.adapter_load_failures.inc()
            raise
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    async def load_adapter(body: LoadLoraRequest, caller: Caller, authorization: str | None) -> None:
        state.check_may_manage(caller, body.lora_name, authorization)
        path = state.allowed_adapter_path(body.lora_path, caller)
        if body.lora_name == state.base_model_name or state.backend.has_adapter(body.lora_name):
            raise ProtocolError(f"an adapter or model named {body.lora_name!r} is already loaded", param="lora_name")
        try:
            await state.backend.load_adapter(body.lora_name, str(path))
        except AdapterError as e:  # the adapter at the path cannot be read or served
            raise ProtocolError(str(e), param="lora_path") from e
        except ValueError as e:  # the engine refused the name
            raise ProtocolError(str(e), param="lora_name") from e

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoraRequest, request: Request, caller: Authorized):
        state.check_may_manage(caller, body.lora_name, request.headers.get("authorization"))
        try:
            await state.backend.unload_adapter(body.lora_name)
        except ValueError as e:
            raise ProtocolError(f"the adapter {body.lora_name!r} is not loaded", status=404,
                                param="lora_name") from e
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.get("/openapi.json", dependencies=[Depends(request_caller)], include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(metrics_access)])
    async def metrics():
        state.backend.update_gauges(state.metrics)
        try:  # the engine answers between steps; one that does not (a hung step) leaves the last listing
            listing = await asyncio.wait_for(state.backend.adapter_residency(), RESIDENCY_WAIT_S)
            state.metrics.adapter_residency.update(listing)
        except TimeoutError:
            log.warning("/metrics: the engine did not report its adapters within %g s", RESIDENCY_WAIT_S)
        # off the event loop: a scrape of many adapters' series takes a while
        text = await asyncio.to_thread(generate_latest, state.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return PLAYGROUND.read_text()

    return app
