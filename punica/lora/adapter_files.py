"""Reading an adapter directory's files: only from where it was allowed, and no more than it can need.

An adapter that lies inside one of the `adapter_dirs` it is read with (punica serve
--adapter-dir) reads only files that resolve inside that directory: each file is opened and then
checked where the opened file really is (Linux: /proc/self/fd), so a symlink, or one swapped in
after a check, cannot lead a read outside. Adapters outside every such directory (an operator's
--adapter path, say into a Hugging Face cache whose files link to its blobs) are read as they are.

A safetensors file is 8 bytes of header length, a JSON header {name: {"dtype", "shape",
"data_offsets"}} and the tensors' bytes; its header is read and checked first, so a file whose
shapes are wrong is refused before its tensors are read. Its tensors are then read, from the file
as opened, straight into their own tensors (one copy, none through an intermediate buffer), at the
offsets of the header that was checked, after checking that the file still begins with that header.
A weights file larger than the adapter its config describes can need is refused before anything of
it is read.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

# safetensors' dtype names: of the floating-point types an adapter may hold, and of others, refused by name
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
OTHER_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}

Fail = Callable[[str], Exception]


def inside(real: Path, root: Path) -> bool:
    return real == root or root in real.parents


def confining_dirs(adapter: str | Path, adapter_dirs: Iterable[str | Path]) -> tuple[Path, ...]:
    """The `adapter_dirs` (resolved) that hold the adapter's directory (resolved): its files must
    resolve inside one of them; none when it lies outside all of them."""
    real = Path(os.path.realpath(adapter))
    roots = (Path(os.path.realpath(d)) for d in adapter_dirs)
    return tuple(root for root in roots if inside(real, root))


def open_confined(file: Path, dirs: tuple[Path, ...], fail: Fail) -> BinaryIO:
    """`file` opened for reading, if it is a regular file (opening a FIFO does not wait for a
    writer) and, with `dirs`, lies inside one of them as opened; refused naming the file, never
    what it links to."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    f = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise fail(f"{file.name} is not a regular file")
        if dirs:
            fd_link = Path(f"/proc/self/fd/{fd}")  # Linux: where the file opened is; else where its path leads now
            real = Path(os.readlink(fd_link) if fd_link.is_symlink() else os.path.realpath(file))
            if not any(inside(real, root) for root in dirs):
                raise fail(f"{file.name} resolves to a file outside {dirs[0]}: only files inside it are read")
    except BaseException:
        f.close()
        raise
    return f


def read_json(file: Path, dirs: tuple[Path, ...], max_bytes: int, fail: Fail):
    """The JSON value in `file` (at most `max_bytes`), read as `open_confined` allows."""
    with open_confined(file, dirs, fail) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise fail(f"{file.name} is over {max_bytes} bytes")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{file.name} is unreadable: {e}") from e


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors file's header as read and checked: name -> (shape, dtype) of every tensor (the
    dtype's safetensors name where torch has none here), and where each one's bytes lie."""
    raw: bytes                                                  # the file's first `data_start` bytes
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype | str]]
    offsets: dict[str, tuple[int, int]]                         # name -> [begin, end) after data_start

    @property
    def data_start(self) -> int:
        return len(self.raw)


def safetensors_header(f: BinaryIO, name: str, max_header_bytes: int, fail: Fail) -> SafetensorsHeader:
    """The header of the safetensors file `f`, from its header alone."""
    def unreadable(problem: str) -> Exception:
        return fail(f"{name} is unreadable: {problem}")

    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise unreadable("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > max_header_bytes or 8 + length > size:
        raise unreadable(f"its header claims {length} bytes (at most {min(max_header_bytes, size - 8)} here)")
    text = f.read(length)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise unreadable(f"its header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise unreadable("its header is not a JSON object")
    shapes, offsets = {}, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            shape, dtype_name, (begin, end) = tuple(entry["shape"]), entry["dtype"], entry["data_offsets"]
            if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)) or begin > end:
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise unreadable(f"its header's entry for {key[:200]!r} is not a tensor's") from None
        dtype = FLOAT_DTYPES.get(dtype_name) or OTHER_DTYPES.get(dtype_name) or str(dtype_name)[:20]
        shapes[key], offsets[key] = (shape, dtype), (begin, end)
    return SafetensorsHeader(prefix + text, shapes, offsets)


def read_safetensors(f: BinaryIO, name: str, header: SafetensorsHeader, fail: Fail) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `f` whose `header` was read and checked, each read
    straight into its own tensor at that header's offsets. Refused as safetensors refuses: unless
    each tensor's byte range holds its shape of its dtype and the ranges tile the rest of the file;
    and if the file no longer begins with that header or ends before its data."""
    def unreadable(problem: str) -> Exception:
        return fail(f"{name} is unreadable: {problem}")

    fd = f.fileno()  # read unbuffered: what `f` buffered while the header was read may be stale
    if os.pread(fd, header.data_start, 0) != header.raw:
        raise unreadable("its header changed while it was read")
    ranges = sorted(header.offsets.items(), key=lambda item: item[1])
    position = 0
    for key, (begin, end) in ranges:
        shape, dtype = header.shapes[key]
        if not isinstance(dtype, torch.dtype):
            raise unreadable(f"tensor {key[:200]!r} has dtype {dtype}, which torch cannot hold here")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise unreadable(f"tensor {key[:200]!r} of shape {shape} and dtype {dtype} has {end - begin} bytes")
        if begin != position:
            raise unreadable(f"tensor {key[:200]!r} begins at byte {begin} of the data, not {position}")
        position = end
    data_bytes = os.fstat(fd).st_size - header.data_start
    if position != data_bytes:
        raise unreadable(f"its tensors hold {position} bytes, but {data_bytes} follow its header")
    tensors = {}
    for key, (begin, end) in ranges:
        shape, dtype = header.shapes[key]
        tensor = torch.empty(shape, dtype=dtype)
        view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        filled = 0
        while filled < end - begin:
            count = os.preadv(fd, [view[filled:]], header.data_start + begin + filled)
            if not count:
                raise unreadable(f"it ends before the data of tensor {key[:200]!r}")
            filled += count
        tensors[key] = tensor
    return tensors


class WeightsFile:
    """An adapter directory's adapter_model.safetensors (or, without one, adapter_model.bin), opened
    as `open_confined` allows and refused over `max_bytes`: `shapes` first (for safetensors from its
    header, nothing else read), then `tensors`. A context manager that closes the file."""

    def __init__(self, directory: Path, dirs: tuple[Path, ...], max_bytes: int, max_header_bytes: int, fail: Fail):
        for file in (directory / "adapter_model.safetensors", directory / "adapter_model.bin"):
            if file.is_file():
                break
        else:
            raise fail("no weights file (adapter_model.safetensors or adapter_model.bin)")
        self.name, self.fail, self.max_header_bytes = file.name, fail, max_header_bytes
        self.safetensors = file.suffix == ".safetensors"
        self.file = open_confined(file, dirs, fail)
        size = os.fstat(self.file.fileno()).st_size
        if size > max_bytes:
            self.file.close()
            raise fail(f"{file.name} is {size} bytes, more than such an adapter of this model can hold ({max_bytes})")
        self._loaded: dict[str, torch.Tensor] | None = None
        self._header: SafetensorsHeader | None = None

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype | str]]:
        """name -> (shape, dtype) of every tensor (the dtype's safetensors name where torch has none here)."""
        if self.safetensors:
            self._header = safetensors_header(self.file, self.name, self.max_header_bytes, self.fail)
            return self._header.shapes
        return {key: (tuple(t.shape), t.dtype) for key, t in self.tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, from the file as opened, never from its path again (for safetensors at the
        offsets of the header `shapes` checked)."""
        if self._loaded is not None:
            return self._loaded
        if self.safetensors:
            if self._header is None:
                self.shapes()
            try:
                self._loaded = read_safetensors(self.file, self.name, self._header, self.fail)
            except OSError as e:
                raise self.fail(f"{self.name} is unreadable: {e}") from e
            return self._loaded
        self.file.seek(0)
        try:
            loaded = torch.load(self.file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises many types for corrupt files
            raise self.fail(f"{self.name} is unreadable: {e}") from e
        if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and torch.is_tensor(v) for k, v in loaded.items()):
            raise self.fail(f"{self.name} does not hold a dict of named tensors")
        self._loaded = loaded
        return loaded
