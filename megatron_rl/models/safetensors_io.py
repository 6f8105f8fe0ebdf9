"""The safetensors file format without intermediate copies.

The `safetensors` package copies every tensor it reads into new memory and refuses to write
tensors that share memory; conversion would pay one extra pass over the model each way. Here a
file is memory-mapped and each tensor is a view of the mapping (copied once, into its parameter),
and a write streams each tensor's bytes from where they are (views of parameters included).

Format: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded with
spaces to a multiple of 8, then the data; offsets are relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch

from megatron_rl.models.chunked_io import write_chunked

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsFormatError(ValueError):
    """A file that is not valid safetensors, or cannot be read (a dangling link, no permission)."""


def read_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor entries of a safetensors file (without `__metadata__`) and where its data starts;
    SafetensorsFormatError when an entry does not describe its bytes or the file is too short for them."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise SafetensorsFormatError(_unreadable(Path(path), err)) from None
    with f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsFormatError(f"{path}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > _MAX_HEADER:
            raise SafetensorsFormatError(f"{path}: header of {size} bytes; not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SafetensorsFormatError(f"{path}: header is not JSON ({err})") from None
        data_bytes = os.fstat(f.fileno()).st_size - 8 - size
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: header is {type(header).__name__}, not an object of tensors")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        _check_entry(path, name, entry)
    cut = [(entry["data_offsets"][1], name) for name, entry in header.items() if entry["data_offsets"][1] > data_bytes]
    if cut:
        end, name = min(cut)
        begin = header[name]["data_offsets"][0]
        needed = 8 + size + max(entry["data_offsets"][1] for entry in header.values())
        raise SafetensorsFormatError(
            f"{path} is truncated: {8 + size + data_bytes} bytes, expected {needed}; tensor {name!r} needs data "
            f"bytes [{begin}, {end})"
        )
    return header, 8 + size


def _unreadable(path: Path, err: OSError) -> str:
    if path.is_symlink() and not path.exists():
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return f"{path} cannot be read: {err.strerror or err}"


def _check_entry(path: str | Path, name: str, entry: Any) -> None:
    """A header entry whose byte range matches its dtype and shape."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    valid = (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
        and isinstance(shape, list)
        and all(isinstance(d, int) and d >= 0 for d in shape)
        and isinstance(entry.get("dtype"), str)
    )
    if not valid:
        raise SafetensorsFormatError(f"{path}: tensor {name!r}: malformed header entry {str(entry)[:120]}")
    begin, end = offsets
    dtype = DTYPES.get(entry["dtype"])
    if dtype is not None and math.prod(shape) * dtype.itemsize != end - begin:
        raise SafetensorsFormatError(
            f"{path}: tensor {name!r}: {entry['dtype']} {shape} is {math.prod(shape) * dtype.itemsize} bytes, "
            f"its data_offsets span {end - begin}"
        )


class MappedSafetensors:
    """One memory-mapped safetensors file; `get(name)` is a view of the mapping (no copy)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries, self._start = read_header(self.path)
        with open(self.path, "rb") as f:
            # private copy-on-write mapping: writable for torch.frombuffer, nothing is ever written
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self._file_size() else None

    def _file_size(self) -> int:
        return self.path.stat().st_size

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise SafetensorsFormatError(f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = (end - begin) // itemsize
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        offset = self._start + begin
        if offset % itemsize:  # unaligned data (not written by safetensors): copy the bytes
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=offset)
            return raw.clone().view(dtype).view(shape)
        return torch.frombuffer(self._map, dtype=dtype, count=numel, offset=offset).view(shape)


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None, in_place: bool = False
) -> int:
    """Write `tensors` (any device; views allowed) as one safetensors file; returns the data bytes.
    `in_place`: a file of exactly this size already at `path` is overwritten without truncating it
    (its page-cache pages are written again instead of new ones allocated; about half the cost)."""
    ordered = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())  # keeps every tensor aligned
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    cpu: list[torch.Tensor] = []
    for name, tensor in ordered:
        if tensor.dtype not in _NAMES:
            raise SafetensorsFormatError(f"tensor {name!r}: dtype {tensor.dtype} cannot be written")
        data = tensor.detach().to("cpu").contiguous()
        nbytes = data.numel() * data.element_size()
        header[name] = {
            "dtype": _NAMES[data.dtype],
            "shape": list(data.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        cpu.append(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    size = 8 + len(encoded) + offset
    reuse = in_place and os.path.isfile(path) and os.path.getsize(path) == size
    with open(path, "r+b" if reuse else "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for data in cpu:
            if data.numel():
                write_chunked(f, data.reshape(-1).view(torch.uint8).numpy())
    return offset
