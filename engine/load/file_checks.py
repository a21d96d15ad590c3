"""Damaged model files, described in words a person can act on.

Contract: each function reads one file's framing (never a tensor) and
returns what is wrong with it, or None when its framing is sound: a file
shorter than its header says (truncated: a download or copy that stopped),
a header that is not what the format puts there (corrupt, or not that kind
of file), a safetensors index naming shards that are absent or leaving out
shards of its own series. The loader calls them to replace a library's
error (``incomplete metadata``, ``cannot reshape array``) with the file and
the fault; each message ends with what to do about it.

Formats: safetensors is an 8-byte little-endian header length N, N bytes of
JSON (each tensor's ``data_offsets`` counted from the end of the header),
then the data. GGUF (v2, v3) is ``GGUF``, a version, the tensor and
key-value counts, the key-values, the tensor infos (name, dims, type,
offset), then the data, aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import json
import mmap
import re
import struct
from pathlib import Path
from typing import Any

AGAIN = "download or copy it again"
# A sharded checkpoint's files: model-00001-of-00003.safetensors
_SHARD = re.compile(r"(?P<stem>.+)-(?P<index>\d+)-of-(?P<count>\d+)\.safetensors")
# GGUF value types: fixed sizes; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_DIMS = 4
_U64 = struct.Struct("<Q")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file's framing (module doc), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{path} is truncated: {size} bytes, too short for a safetensors header; {AGAIN}"
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if 8 + length > size:
            return (
                f"{path} is truncated or not a safetensors file: its header would take "
                f"{length:,} bytes, the file has {size:,}; {AGAIN}"
            )
        raw = f.read(length)
    try:
        header: Any = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path} is corrupt: its header is not a safetensors JSON header; {AGAIN}"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return (
            f"{path} is truncated: its tensors need {expected:,} bytes, the file has "
            f"{size:,}; {AGAIN}"
        )
    if size > expected:
        return f"{path} is corrupt: {size - expected:,} bytes follow its last tensor; {AGAIN}"
    return None


def index_problem(index: Path, files: set[str]) -> str | None:
    """What is wrong with the shards a safetensors index names (``files``):
    one absent from its folder, or a numbered series (``-of-00003``) the
    index does not name whole. None when all are there."""
    folder = index.parent
    missing = sorted(f for f in files if not (folder / f).is_file())
    if missing:
        return (
            f"{index} names {missing[0]}, which is missing from {folder}"
            + (f" ({len(missing)} shards missing)" if len(missing) > 1 else "")
            + f"; {AGAIN}"
        )
    series: dict[tuple[str, str], set[int]] = {}
    for name in files:
        match = _SHARD.fullmatch(name)
        if match is not None:
            key = (match["stem"], match["count"])
            series.setdefault(key, set()).add(int(match["index"]))
    for (stem, total), seen in sorted(series.items()):
        count = int(total)
        absent = sorted(set(range(1, count + 1)) - seen)
        if absent:
            first = f"{stem}-{absent[0]:0{len(total)}d}-of-{total}.safetensors"
            return (
                f"{index} leaves out {len(absent)} of the {count} shards of {stem} "
                f"(first: {first}): its weight_map names no tensor in them; {AGAIN}"
            )
    return None


def gguf_problem(path: Path) -> str | None:
    """What is wrong with a GGUF file's framing (module doc), or None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            if size == 0:
                raise _Cut(0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                end = _GgufWalk(data).data_end()
    except _Cut as cut:
        return f"{path} is truncated: its header stops at byte {cut.at:,} of {size:,}; {AGAIN}"
    except _Corrupt as bad:
        return f"{path} is corrupt: {bad}; {AGAIN}"
    if size < end:
        return (
            f"{path} is truncated: its tensors need {end:,} bytes, the file has {size:,}; {AGAIN}"
        )
    return None


class _Cut(Exception):
    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


class _Corrupt(Exception):
    pass


class _GgufWalk:
    """Reads a GGUF header field by field, only as far as the file goes."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.size, self.pos = data, len(data), 0

    def data_end(self) -> int:
        """Where the last tensor's data ends (module doc)."""
        if self.take(4) != b"GGUF":
            raise _Corrupt("it does not start with GGUF: not a GGUF file")
        version = self.uint(4)
        if version not in (2, 3):
            raise _Corrupt(f"GGUF version {version} (metrale reads 2 and 3)")
        num_tensors, num_fields = self.uint(8), self.uint(8)
        if num_tensors > self.size or num_fields > self.size:
            raise _Corrupt(f"implausible counts: {num_tensors} tensors, {num_fields} fields")
        alignment = 32
        for _ in range(num_fields):
            key = self.string()
            kind = self.uint(4)
            if key == "general.alignment" and kind == _GGUF_UINT32:
                alignment = self.uint(4)
                if alignment == 0 or alignment & (alignment - 1):
                    raise _Corrupt(f"general.alignment {alignment} is not a power of two")
            else:
                self.skip_value(kind)
        extents = [self.tensor_extent() for _ in range(num_tensors)]
        start = -(-self.pos // alignment) * alignment
        return start + max(extents, default=0)

    def tensor_extent(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.string()
        num_dims = self.uint(4)
        if num_dims > _GGUF_MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {num_dims} dimensions")
        count = 1
        for _ in range(num_dims):
            count *= self.uint(8)
        kind, offset = self.uint(4), self.uint(8)
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name!r} has unknown type {kind}") from None
        return offset + count // block * nbytes

    def skip_value(self, kind: int) -> None:
        if kind in _GGUF_SIZES:
            self.skip(_GGUF_SIZES[kind])
        elif kind == _GGUF_STRING:
            self.skip(self.uint(8))
        elif kind == _GGUF_ARRAY:
            item, count = self.uint(4), self.uint(8)
            if item in _GGUF_SIZES:
                self.skip(count * _GGUF_SIZES[item])
            elif item == _GGUF_STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise _Corrupt(f"unknown value type {kind} at byte {self.pos - 4:,}")

    def skip_strings(self, count: int) -> None:
        """``count`` strings (a vocabulary's tokens: the bulk of a header)."""
        data, size, pos = self.data, self.size, self.pos
        for _ in range(count):
            if pos + 8 > size:
                raise _Cut(pos)
            pos += 8 + _U64.unpack_from(data, pos)[0]
        self.check(pos - self.pos)
        self.pos = pos

    def string(self) -> str:
        return self.take(self.uint(8)).decode("utf-8", errors="replace")

    def uint(self, width: int) -> int:
        value: int = int.from_bytes(self.take(width), "little")
        return value

    def take(self, n: int) -> bytes:
        self.check(n)
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def skip(self, n: int) -> None:
        self.check(n)
        self.pos += n

    def check(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _Cut(self.pos)
