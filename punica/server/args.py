"""ServerArgs: how `punica serve` serves (the engine's own settings are punica.config.EngineArgs);
the command's flags are made from its fields (punica.config.add_arguments)."""

from __future__ import annotations

from dataclasses import dataclass

from punica.config import described

# 8 MiB holds the longest context punica serves (131,072 tokens) as text at 64 bytes a token
# (English averages about 4, JSON-escaped non-ASCII text up to about 24) or as token ids
# (at most 8 bytes each with the separator); a body over it cannot be a prompt that fits.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
CLUSTER_POLICIES = ("punica", "adapter-aware", "round-robin", "least-loaded")  # punica.cluster.placement's


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
    max_packed_kv_tokens: int | None = described(None, "with --workers: KV-aware packing, a busy worker takes a "
                                                       "request only while its KV in use stays within this many "
                                                       "tokens (bounds a packed worker's KV read per step; an idle "
                                                       "worker takes any request; default: no bound)")
    shutdown_timeout: float = described(DEFAULT_SHUTDOWN_TIMEOUT_S, "on SIGTERM, seconds in-flight requests may "
                                                                    "still run before they end with finish_reason "
                                                                    "'abort'")

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
        if self.max_packed_kv_tokens is not None and self.max_packed_kv_tokens < 1:
            raise ValueError(f"max_packed_kv_tokens must be >= 1 tokens, got {self.max_packed_kv_tokens}")
        if self.tenants is not None and (self.api_key is not None or self.admin_api_key is not None):
            raise ValueError("--tenants holds the API keys: give no --api-key or --admin-api-key (nor "
                             "$PUNICA_API_KEY or $PUNICA_ADMIN_API_KEY) with it")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
