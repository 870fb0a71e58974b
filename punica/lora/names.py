"""Adapter names: what users call adapters, checked once where a name enters (registration)."""

from __future__ import annotations

import re

# adapter names: letters/digits first, then letters, digits, '.', '_', '-'; optionally an org
# prefix and one '/'; nothing that reads as a path ("..", leading '.') or needs quoting
ADAPTER_NAME = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_ADAPTER_NAME_LEN = 128


def check_adapter_name(name: str) -> str:
    """`name`, if it is a valid adapter name; else a ValueError naming the rule it breaks."""
    if len(name) > MAX_ADAPTER_NAME_LEN:
        raise ValueError(f"adapter name {name[:32]!r}... has {len(name)} characters, over the "
                         f"limit of {MAX_ADAPTER_NAME_LEN}")
    if not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter name {name!r} is invalid: it must start with an ASCII letter or digit and hold "
                         "only ASCII letters, digits, '.', '_' and '-', optionally after an org prefix of the same "
                         "form and one '/' (e.g. 'tenant-a', 'org/adapter_v1.2')")
    return name
