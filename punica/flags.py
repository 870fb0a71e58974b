"""A configuration dataclass's fields as command-line flags: each field's default, help text and bounds
defined once (`described`), the flags made from them (`add_arguments`) and the instance read back
(`from_arguments`), with argparse types that name a bad value (`bounded`, `byte_count`)."""

from __future__ import annotations

import argparse
import math
import re
import typing
from collections.abc import Callable
from dataclasses import field, fields


def described(default, help: str, **metadata):
    """A dataclass field with a default and the help text of its command-line flag (`add_arguments`).
    `minimum` (and `exclusive`) bound its value: its flag refuses a value out of bounds by name, and
    `check_bounds` in its class's __post_init__ any value."""
    return field(default=default, metadata={"help": help, **metadata})


def field_of(cls: type, name: str):
    """The field `name` of the dataclass `cls`, for another dataclass: the same default, help and
    bounds, so that a setting two sets of flags share is defined once."""
    f = next(f for f in fields(cls) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


def bounded(kind: type, minimum: float, exclusive: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a finite `kind` (int or float) of at least `minimum` (over it, if `exclusive`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if exclusive else '>='} {minimum}, got {text}")
        return value
    return parse


BYTE_SIZE = re.compile(r"(\d+(?:\.\d*)?)(?:([kmgt])(i?)(b?))?", re.IGNORECASE)


def byte_count(text: str) -> int:
    """An argparse type for a size in bytes, at least 1: an integer, or a number with a unit, in
    either case: K, M, G, T, or KiB, MiB, GiB, TiB (powers of 1024); KB, MB, GB, TB (of 1000)."""
    match = BYTE_SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: bytes as an integer, or a number with a unit "
                                         "(512M, 4G or 4GiB: powers of 1024; 4GB: of 1000)")
    number, unit, binary, b = match.groups()
    scale = (1000 if b and not binary else 1024) ** ("kmgt".index(unit.lower()) + 1) if unit else 1
    value = int(number) * scale if number.isdigit() else int(float(number) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text}")
    return value


def check_bounds(config) -> None:
    """ValueError naming the first field of the dataclass instance `config` whose value is out of the
    bounds its `minimum` metadata sets (None passes: the setting is off)."""
    for f in fields(config):
        minimum, value = f.metadata.get("minimum"), getattr(config, f.name)
        if minimum is None or value is None:
            continue
        exclusive = f.metadata.get("exclusive", False)
        if not math.isfinite(value) or value < minimum or (exclusive and value == minimum):
            raise ValueError(f"{f.name} must be {'>' if exclusive else '>='} {minimum}, got {value}")


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None, **defaults) -> None:
    """One flag per field of the dataclass `cls` (--max-batch-size for max_batch_size; all of them, or
    `only` those, less `skip`), with the field's help text and default (or the one given here);
    booleans get a --no- form, bounded fields (`described`'s minimum) refuse values out of bounds, and
    sizes in bytes (fields named *_bytes) take units (`byte_count`: 4G, 512MiB, 8GB)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only) or "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        kind = hints[f.name]
        if kind is bool or kind == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        if typing.get_origin(kind) is tuple:  # a repeatable flag
            parser.add_argument(flag, type=typing.get_args(kind)[0], action="append", default=list(default),
                                help=f.metadata["help"])
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        if f.name.endswith("_bytes") and base is int:
            base = byte_count
        elif "minimum" in f.metadata:
            base = bounded(base, f.metadata["minimum"], f.metadata.get("exclusive", False))
        parser.add_argument(flag, type=base, default=default, choices=f.metadata.get("choices"),
                            help=f.metadata["help"] + (f" (default: {default})" if default is not None else ""))


def from_arguments(cls: type, namespace: argparse.Namespace, **values):
    """An instance of the dataclass `cls` from the flags `add_arguments` made (and `values`)."""
    given = {f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)}
    return cls(**(given | values))
