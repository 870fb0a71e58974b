"""The one rule for which adapter folders the server may read: those inside an --adapter-dir."""

from __future__ import annotations

import os
from pathlib import Path


def resolved_inside(path: str | Path, roots: list[Path]) -> Path | None:
    """`path` with every symlink resolved, if that lies inside one of `roots` (resolved too), else None."""
    real = Path(os.path.realpath(path))
    for root in roots:
        root = Path(os.path.realpath(root))
        if real == root or root in real.parents:
            return real
    return None


def top_folder(real: Path, roots: list[Path]) -> str | None:
    """The name of the folder, directly in one of `roots`, that holds the resolved path `real`
    (itself, or one of its parents); None when `real` is a root or lies in none."""
    for root in roots:
        root = Path(os.path.realpath(root))
        if root in real.parents:
            return real.relative_to(root).parts[0]
    return None
