"""`punica serve`: bind the address, load the model and adapters, start the engine thread, run uvicorn."""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

from punica.config import EngineArgs
from punica.factory import build_engine, load_tokenizer, model_source, resolve_device, startup_adapters
from punica.lora.adapter_config import adapter_rank
from punica.lora.names import check_adapter_name
from punica.server.adapter_paths import resolved_inside
from punica.server.app import ServerState, build_app
from punica.server.args import ServerArgs
from punica.server.async_engine import AsyncEngine
from punica.server.metrics import Metrics
from punica.server.tenants import read_tenants

log = logging.getLogger("punica.server")


def adapters_in(directory: Path, max_rank: int) -> dict[str, str]:
    """Every PEFT adapter directly under `directory` that this server can serve, named by its
    folder. Skipped, each with a logged warning, so that one tenant's folder cannot keep the
    server from starting or size its adapter slots: a symlink to outside `directory` (as
    /v1/load_lora_adapter refuses it, 403), a folder name that is no adapter name, a config that
    cannot be served (a file of it linking outside `directory` too), and a rank over `max_rank` (the
    slots' rank, which scanned adapters never raise)."""
    if not directory.is_dir():
        raise FileNotFoundError(f"--adapter-dir {directory} is not a directory")
    adapters = {}
    for p in sorted(directory.iterdir()):
        if not (p / "adapter_config.json").is_file():
            continue
        if resolved_inside(p, [directory]) is None:
            log.warning("skipping adapter %s: it links to %s, outside --adapter-dir %s", p.name, p.resolve(), directory)
            continue
        try:
            check_adapter_name(p.name)
            rank = adapter_rank(p, [directory])
        except ValueError as e:
            log.warning("skipping adapter %s: %s", p.name, e)
            continue
        if rank > max_rank:
            log.warning("skipping adapter %s: its rank %d is over --max-lora-rank %d", p.name, rank, max_rank)
            continue
        adapters[p.name] = str(p)
    return adapters


def build_state(args: EngineArgs, adapters: dict[str, str] | None = None, server: ServerArgs = ServerArgs()
                ) -> ServerState:
    """The server's state: one engine in this process (over `args.tensor_parallel_size` devices), or
    `args.workers` Ray workers behind the Punica cluster scheduler."""
    if server.max_packed_kv_tokens is not None and not args.workers:
        raise ValueError("--max-packed-kv-tokens places requests over Ray workers: it needs --workers N")
    tenants = read_tenants(server.tenants) if server.tenants is not None else None  # before the slow part
    dirs = [Path(d) for d in server.adapter_dir]
    args = dataclasses.replace(args, adapter_dirs=server.adapter_dir)  # the engine reads only inside them
    max_rank = max([args.max_lora_rank, *map(adapter_rank, (adapters or {}).values())])
    scanned = {}
    for d in dirs:
        scanned.update(adapters_in(d, max_rank))
    all_adapters = startup_adapters(args, None if adapters is None and not dirs else {**scanned, **(adapters or {})})
    _, model_dir = model_source(args)
    name = server.served_model_name or (model_dir.name if model_dir is not None else str(args.model))
    if name in all_adapters:
        raise ValueError(f"an adapter is named like the base model ({name!r}); rename it")
    for adapter, path in all_adapters.items():
        log.info("adapter %s <- %s", adapter, path)

    def state_of(backend, tokenizer) -> ServerState:
        return ServerState(backend, tokenizer, name, dirs, server.api_key, server.max_queue,
                           Metrics(per_tenant=tenants is not None), admin_api_key=server.admin_api_key,
                           tenants=tenants, metrics_public=server.metrics_public)

    if tenants is not None:
        log.info("tenants: %s (%d tenants)", server.tenants, len(tenants.shares))
    if args.workers:
        from punica.cluster.ray_backend import build_cluster_engine
        from punica.server.cluster_backend import ClusterBackend, start_ray

        start_ray()
        cluster = build_cluster_engine(args, all_adapters, policy=server.cluster_policy,
                                       max_packed_kv_tokens=server.max_packed_kv_tokens)
        log.info("model %s on %d workers (%s placement, migration)", name, args.workers, server.cluster_policy)
        state = state_of(ClusterBackend(cluster), load_tokenizer(model_dir))
        state.backend.on_finished = state.metrics.finished
        return state
    backend = AsyncEngine(lambda: build_engine(args, all_adapters))
    engine = backend.engine
    state = state_of(backend, engine.tokenizer)
    state.backend.on_step, state.backend.on_finished = state.metrics.on_step, state.metrics.finished
    stats = engine.stats()
    log.info("model %s on %s x%d (%s), context %d tokens, KV cache %d pages of %d tokens", name,
             resolve_device(args.device), args.tensor_parallel_size, args.dtype, engine.max_model_len,
             stats.num_kv_pages, engine.config.page_size)
    return state


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of `host` at `port` (as asyncio's create_server binds them),
    for uvicorn to listen on; ValueError naming the address if one cannot be bound (a port in use)."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from e
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: the IPv4 addresses get sockets of their own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                where = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
                raise ValueError(f"cannot listen on {where}: {e.strerror} (choose another --port or --host)") from e
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def serve(args: EngineArgs, server: ServerArgs, adapters: dict[str, str] | None = None) -> None:
    """Serve until SIGTERM or SIGINT. The address is bound first, so that a port in use is a
    ValueError before anything loads; it is held while the model loads (connections are refused
    until the server listens)."""
    import uvicorn

    from punica.server.shutdown import GracefulServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = server.host
    sockets = bind(host, server.port)
    port = sockets[0].getsockname()[1]  # --port 0: the one the system chose
    try:
        state = build_state(args, adapters, server)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    app = build_app(state, server.max_request_bytes, tenants_file=server.tenants)
    log.info("serving the OpenAI API at http://%s:%d/v1 and the playground at http://%s:%d/", host, port, host, port)
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    GracefulServer(config, state.in_flight, server.shutdown_timeout, server.connection_limits()).run(sockets)
