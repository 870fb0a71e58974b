"""Shared benchmark helpers: result files and tables."""

from __future__ import annotations

import json
import random
from pathlib import Path

from punica.config import ModelConfig, preset_config
from punica.engine.engine import Engine
from punica.engine.sampling_params import SamplingParams

WARM_UP_PROMPT = list(range(3, 67))  # 64 tokens: long enough that prefills run SGMV's tiled path


# the formats of --quantizations (textgen, roofline): a base-weight format (punica.config.QUANTIZATIONS),
# "+fp8kv" added for an fp8 KV cache
FORMATS = ("none", "fp8", "none+fp8kv", "fp8+fp8kv")


def format_fields(label: str) -> dict[str, str]:
    """The EngineArgs fields of a FORMATS label: quantization and kv_cache_dtype."""
    weights, _, kv = label.partition("+")
    return {"quantization": weights, "kv_cache_dtype": "fp8" if kv == "fp8kv" else "auto"}


def format_label(quantization: str, kv_cache_dtype: str) -> str:
    return quantization + ("+fp8kv" if kv_cache_dtype == "fp8" else "")


def random_prompt(length: int, vocab: int, rng: random.Random) -> list[int]:
    """`length` token ids drawn from 100 .. vocab - 1 (past the special tokens)."""
    return [rng.randrange(100, vocab) for _ in range(length)]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of values, nearest rank at or above q (p99: q = 0.99)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written per second (median of do_bench)."""
    import torch
    import triton

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / (triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50,
                                                      return_mode="median") * 1e-3)


def warm_up(engine: Engine, adapters: list[str | None]) -> None:
    """Run one short request per adapter, all in one batch where they fit: compiles every
    kernel the timed run will use (prefill and decode, SGMV and BGMV) and, as a side effect,
    makes these adapters resident."""
    for adapter in adapters:
        engine.add_request(WARM_UP_PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), adapter)
    for _ in engine.steps():
        pass


def write_results(out_dir: Path, name: str, rows: list[dict], meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return path


def save_figure(fig, path: Path, title: str) -> None:
    """Title, tight layout, and the PNG every benchmark writes."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)


def style_axes(ax, title: str, xlabel: str, ylabel: str | None = None, log_y: bool = False) -> None:
    """The look every benchmark plot shares: log2 x axis (batch sizes, token counts), small labels, grid."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    if ylabel is not None:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Rows as a text table; a row without a column shows "-" there."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def graph_us(calls) -> float:
    """Microseconds per call (CUDA): every call captured in one graph, median replay / calls."""
    import torch
    import triton

    calls[0]()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    us = triton.testing.do_bench(graph.replay, warmup=10, rep=30, return_mode="median") * 1e3 / len(calls)
    del graph
    return us


def layer_gemm_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each of a layer's four GEMMs in a preset's shape (`gemm_shapes`)."""
    return gemm_shapes(preset_config(preset))


def gemm_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of each of a layer's four GEMMs, the projections fused as the engine runs them."""
    return {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
