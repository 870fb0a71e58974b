"""Shared benchmark helpers: result files and tables."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out_dir: Path, name: str, rows: list[dict], meta: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return path


def format_table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(_fmt(r[c]).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.1f}" if isinstance(value, float) else str(value)
