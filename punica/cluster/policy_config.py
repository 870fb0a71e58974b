"""The cluster policy's settings (torch-free): the flags of `punica simulate`, and of `punica serve
--workers` for KV-aware packing."""

from __future__ import annotations

from dataclasses import dataclass, field

from punica.config import EngineConfig
from punica.flags import check_bounds, described


@dataclass(frozen=True)
class PolicyConfig:
    """The cluster scheduler's settings; `punica simulate` makes its flags from these fields, and
    `punica serve` its --max-packed-kv-tokens (punica.flags.add_arguments)."""
    max_batch_size: int = described(EngineConfig.max_batch_size, "requests a GPU runs at once at most", minimum=1)
    light_load_batch: int = described(EngineConfig.max_batch_size // 2, "ask for a GPU when every batch is this "
                                                                        "large (at most --max-batch-size)", minimum=1)
    idle_release_s: float = described(60.0, "release a GPU idle for this many seconds", minimum=0)
    min_gpus: int = field(default=1, metadata={"minimum": 0})  # never release below this many GPUs
    max_loras: int = described(EngineConfig.max_loras, "adapter slots per GPU", minimum=1)
    models_loads: bool = False      # placing a request whose adapter the GPU lacks starts a load it waits for
    max_gpus_per_adapter: int | None = described(None, "adapter-aware: spread one adapter over at most this many "
                                                       "GPUs", minimum=1)
    max_packed_kv_tokens: int | None = described(
        None, "KV-aware packing (with --workers, for punica serve): a busy GPU takes a request only while its KV in "
              "use stays within this many tokens (bounds a packed GPU's KV read per step; an idle GPU takes any "
              "request; default: no bound)", minimum=1)
    scale_ahead: bool = described(False, "ask for a GPU once none is lightly loaded, before requests wait")

    def __post_init__(self):
        check_bounds(self)
        if not self.light_load_batch <= self.max_batch_size:
            raise ValueError(f"light_load_batch must be in [1, {self.max_batch_size}], got {self.light_load_batch}")
