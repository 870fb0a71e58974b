"""ServerArgs: how `punica serve` serves (the engine's own settings are punica.config.EngineArgs);
the command's flags are made from its fields (punica.flags.add_arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from punica.cluster.policy_config import PolicyConfig
from punica.flags import check_bounds, described, field_of

# 8 MiB holds the longest context punica serves (131,072 tokens) as text at 64 bytes a token
# (English averages about 4, JSON-escaped non-ASCII text up to about 24) or as token ids
# (at most 8 bytes each with the separator); a body over it cannot be a prompt that fits.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
CLUSTER_POLICIES = ("punica", "adapter-aware", "round-robin", "least-loaded")  # punica.cluster.placement's


@dataclass(frozen=True)
class ConnectionLimits:
    """What connections may hold (punica.server.connections enforces it)."""
    max_connections: int = 4096             # several clients' pools (the OpenAI SDK's holds up to 1,000)
    max_connections_per_client: int = 1024  # one such pool; a quarter of the cap, so no address takes it all
    header_timeout_s: float = 10.0          # API clients send a head in one packet
    body_timeout_s: float = 60.0            # the largest body (--max-request-bytes, 8 MiB) at 140 kB/s

    def __post_init__(self):
        if not 1 <= self.max_connections_per_client <= self.max_connections:
            raise ValueError(f"need 1 <= max_connections_per_client <= max_connections, got "
                             f"{self.max_connections_per_client} and {self.max_connections}")
        if not (0 < self.header_timeout_s < math.inf and 0 < self.body_timeout_s < math.inf):
            raise ValueError(f"header_timeout and body_timeout must be finite and > 0 seconds, got "
                             f"{self.header_timeout_s} and {self.body_timeout_s}")


CONNECTION_DEFAULTS = ConnectionLimits()
# open files besides the connections: bursts of accepts (each turn of the event loop asyncio
# accepts up to uvicorn's listen backlog, 2048, and a connection's protocol, which closes an idle
# one for it at a cap, starts two turns later: three bursts are open before the first is counted),
# and the model's and adapters' files, the engine's threads and pipes, Ray's sockets, the logs
NUM_RESERVED_FDS = 3 * 2048 + 1024


@dataclass(frozen=True)
class ServerArgs:
    """How `punica serve` serves (the engine's own settings are EngineArgs); its flags are made from these fields."""
    host: str = described("127.0.0.1", "address to listen on")
    port: int = described(8000, "port to listen on")
    api_key: str | None = described(None, "require 'Authorization: Bearer KEY' (default: $PUNICA_API_KEY, if set)")
    admin_api_key: str | None = described(None, "without --tenants: only this key may load and unload adapters and "
                                                "read /metrics and /v1/adapters, and only it sees adapter paths in "
                                                "/v1/models (default: $PUNICA_ADMIN_API_KEY, if set)")
    tenants: str | None = described(None, "a TOML file of the tenants: their API keys (SHA-256 hashes), the "
                                          "adapters each may use, load and unload, their fair-share weights and "
                                          "caps, and the admin's keys; read again on SIGHUP")
    metrics_public: bool = described(False, "with --tenants or --admin-api-key: serve /metrics without a key (for "
                                            "a Prometheus scraper on a private network)")
    served_model_name: str | None = described(None, "the base model's name in the API (default: its directory's)")
    adapter_dir: tuple[str, ...] = described((), "serve every adapter in this directory (repeatable); "
                                                 "/v1/load_lora_adapter loads only from these")
    max_queue: int = described(1024, "requests waiting to run before new ones get 429")
    max_request_bytes: int = described(DEFAULT_MAX_REQUEST_BYTES, "a request body over this many bytes is refused "
                                                                  "with 413 as it arrives")
    cluster_policy: str = described("punica", "with --workers: how requests are placed (punica: the busiest worker "
                                              "with room; adapter-aware: workers holding the request's adapter "
                                              "first; round-robin; least-loaded)",
                                    choices=CLUSTER_POLICIES)
    max_packed_kv_tokens: int | None = field_of(PolicyConfig, "max_packed_kv_tokens")
    shutdown_timeout: float = described(DEFAULT_SHUTDOWN_TIMEOUT_S, "on SIGTERM, seconds in-flight requests may "
                                                                    "still run before they end with finish_reason "
                                                                    "'abort'")
    max_connections: int = described(CONNECTION_DEFAULTS.max_connections,
                                     "open connections at most: past it a new one closes the connection idle "
                                     "the longest (no request in progress, idle for 1 s at least), or gets 503 "
                                     f"(needs a limit on open files of it + {NUM_RESERVED_FDS}: ulimit -n is "
                                     "raised to that, up to the hard limit)")
    max_connections_per_client: int = described(CONNECTION_DEFAULTS.max_connections_per_client,
                                                "open connections from one client address at most (as "
                                                "--max-connections, among that address's connections)")
    header_timeout: float = described(CONNECTION_DEFAULTS.header_timeout_s,
                                      "seconds a request's head may take to arrive, from the connection's start "
                                      "or the end of the response before it; then the connection is closed")
    body_timeout: float = described(CONNECTION_DEFAULTS.body_timeout_s,
                                    "seconds a request's body may take to arrive in full after its head; then "
                                    "it is answered 408 and the connection closed")

    def __post_init__(self):
        object.__setattr__(self, "adapter_dir", tuple(self.adapter_dir))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0 or self.max_request_bytes < 1:
            raise ValueError(f"max_queue must be >= 0 and max_request_bytes >= 1, got {self.max_queue} and "
                             f"{self.max_request_bytes}")
        if self.cluster_policy not in CLUSTER_POLICIES:
            raise ValueError(f"cluster_policy must be one of {', '.join(CLUSTER_POLICIES)}, "
                             f"got {self.cluster_policy!r}")
        check_bounds(self)
        if self.tenants is not None and (self.api_key is not None or self.admin_api_key is not None):
            raise ValueError("--tenants holds the API keys: give no --api-key or --admin-api-key (nor "
                             "$PUNICA_API_KEY or $PUNICA_ADMIN_API_KEY) with it")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        self.connection_limits()  # raises for a bad value of its four fields

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.max_connections, self.max_connections_per_client, self.header_timeout,
                                self.body_timeout)
