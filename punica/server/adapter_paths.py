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
