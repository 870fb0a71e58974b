"""A PEFT adapter directory's adapter_config.json: read (inside the adapter dirs it is confined to),
and checked for what the canonical layout of punica.lora.adapter can express; the rank and scale
it declares. The errors every reading of an adapter raises (AdapterError) are defined here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from punica.lora.adapter_files import confining_dirs, read_json

# config options that change the math in ways the canonical layout cannot express
UNSUPPORTED_OPTIONS = {
    "lora_bias": "a bias on lora_B (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "modules_to_save": "modules_to_save (fully trained copies of base modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module lora_alpha)",
}


# |lora_alpha / r| (or / sqrt(r)): float32 (the pool's scales) holds it with room to spare; real
# adapters use ~0.1-100, so a larger scale means a broken config (e.g. lora_alpha 1e300).
MAX_LORA_SCALE = 1e6
MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: PEFT writes about 1 kB


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the path and the problem."""


Fail = Callable[[str], AdapterError]  # builds the error for one adapter from a problem description


def adapter_fail(path: Path) -> Fail:
    """The Fail of the adapter at `path`: its errors name it."""
    def fail(problem: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {path}: {problem}")

    return fail


def adapter_rank(path: str | Path, adapter_dirs: Iterable[str | Path] = ()) -> int:
    """The rank an adapter directory declares, from its config alone (no weights read; as
    `read_adapter` reads it, inside `adapter_dirs`)."""
    return check_config(*_config_of(path, adapter_dirs))[0]


def adapter_uses_dora(path: str | Path, adapter_dirs: Iterable[str | Path] = ()) -> bool:
    """Whether an adapter directory's config sets use_dora (after `adapter_rank` has checked it)."""
    return bool(_config_of(path, adapter_dirs)[0].get("use_dora"))


def _config_of(path: str | Path, adapter_dirs: Iterable[str | Path]) -> tuple[dict[str, Any], Fail]:
    path = Path(path)
    fail = adapter_fail(path)
    return read_config(path, fail, confining_dirs(path, adapter_dirs)), fail


def read_config(path: Path, fail: Fail, dirs: tuple[Path, ...]) -> dict[str, Any]:
    """adapter_config.json of the directory `path` as a JSON object, read inside `dirs`
    (punica.lora.adapter_files)."""
    if not path.is_dir():
        raise fail("directory not found")
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise fail("no adapter_config.json")
    try:
        cfg = read_json(config_file, dirs, MAX_CONFIG_BYTES, fail)
    except OSError as e:
        raise fail(f"adapter_config.json is unreadable: {e}") from e
    if not isinstance(cfg, dict):
        raise fail("adapter_config.json is not a JSON object")
    return cfg


def check_config(cfg: dict[str, Any], fail: Fail) -> tuple[int, float]:
    """Reject what the canonical layout cannot express; return (rank, scale)."""
    if cfg.get("peft_type") != "LORA":
        raise fail(f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for option, what in UNSUPPORTED_OPTIONS.items():
        if cfg.get(option):
            raise fail(f"{what} is not supported (adapter_config.json: {option}={cfg[option]!r})")
    if cfg.get("bias", "none") != "none":
        raise fail(f"bias={cfg['bias']!r} is not supported (only 'none')")
    targets = cfg.get("target_modules") or []
    for module in ("embed_tokens", "lm_head"):
        if module in (targets if isinstance(targets, str) else " ".join(targets)):
            raise fail(f"LoRA on {module} is not supported (target_modules={targets!r})")
    rank, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise fail(f"r={rank!r} must be a positive integer")
    # json reads NaN and Infinity, and integers of any size (which float() cannot always convert)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _is_finite(alpha):
        raise fail(f"lora_alpha={alpha!r:.40} must be a finite number")
    rslora = bool(cfg.get("use_rslora"))
    scale = float(alpha) / (math.sqrt(rank) if rslora else rank)
    if not abs(scale) <= MAX_LORA_SCALE:
        divisor = ("sqrt(r)", f"sqrt({rank})") if rslora else ("r", rank)
        raise fail(f"the scale lora_alpha / {divisor[0]} = {alpha:g} / {divisor[1]} = {scale:.3g} is over the "
                   f"limit of {MAX_LORA_SCALE:g}")
    return rank, scale


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False
