"""Weights kept packed in memory and multiplied in float32.

Contract: a checkpoint folder may carry ``packed.safetensors`` beside its
``model.safetensors``: for some ``[n, k]`` linear weights, the same values in
a smaller exact encoding (GGUF Q4_1 or Q8_0 blocks, or bfloat16). Decoding a
packed weight gives, bit for bit, the float32 tensor ``model.safetensors``
holds under the same name, so the dense and packed runtimes load one model.
The embedded default model is written with one (its GGUF is Q4_1/Q8_0).
A checkpoint stored in bfloat16 needs no such file: ``Bf16Source`` runs its
bfloat16 linear weights packed as they are (widening to float32 is exact),
half the bytes of the float32 copy the dense path would make.

``packed.safetensors`` holds ``{name}.data`` (uint8 ``[n, row_bytes]``) and
``{name}.scales`` (float32 ``[n, row_scales]``) per weight, and the header
metadata maps each name to its format. In memory a ``PackedWeight`` keeps
the same bytes rearranged for the kernel (``from_rows``).

``PackedWeight.matmul`` runs ``x @ w.T`` in the C kernel for any number of
rows. Decode and verify steps are bound by reading weights (a quarter to a
sixth of float32's bytes); prefill chunks by arithmetic, where the kernel
still beats decoding the weight and handing it to BLAS, because the decoded
tile stays in the core's cache (docs/benchmarks.md, make bench-kernel).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from metrale.engine.kernels.binding import PackedKernel
from metrale.engine.runtime.weights import WeightStore

PACKED_FILE = "packed.safetensors"

# Per format: the element a block is stored in, the elements one row's
# block of 32 values takes, and the scales it has (kernels/packed_columns.h
# states each format's bytes and arithmetic).
BLOCK = 32
LAYOUT = {
    "q4_1": (torch.uint8, BLOCK // 2, 2),
    "q8_0": (torch.uint8, BLOCK, 1),
    "bf16": (torch.int16, BLOCK, 0),
    "q4_0": (torch.uint8, BLOCK // 2, 1),
    "q5_0": (torch.uint8, BLOCK // 2 + BLOCK // 8, 1),
    "q5_1": (torch.uint8, BLOCK // 2 + BLOCK // 8, 2),
    "q6_k": (torch.uint8, BLOCK // 2 + BLOCK // 4, 2),
}
STRIP = 8  # rows of a strip: the kernel decodes one column of 8 rows per load
GROUP = 8  # strips of a group: 64 rows, stored block by block
# Rows PackedWeight.rows gathers and tiles at a time: 16 groups of 64.
ROW_CHUNK = 16 * GROUP * STRIP


@dataclass(frozen=True)
class PackedWeight:
    """A ``[n, k]`` linear weight in ``fmt`` (a ``LAYOUT`` format), held in
    the kernel's layout (``kernels/packed_linear.c``): groups of 64 rows,
    block by block, each block's 8 strips of 8 rows column-major. Build one
    from row-major blocks with ``from_rows``; ``row_blocks`` gives them back.
    ``stack`` of weights in several formats gives one of format ``parts``,
    which the kernel multiplies part by part into one output."""

    fmt: str
    tiles: torch.Tensor  # [ceil(n / 64), k / 32 * 64 * block bytes per row] uint8
    tile_scales: torch.Tensor  # [ceil(n / 64), k / 32 * 64 * block scales per row] float32
    shape: tuple[int, int]  # [n, k] of the weight it stands for
    kernel: PackedKernel
    # Format "parts": the weights stacked, each in its own format; ``tiles``
    # is then their table for the kernel (format, data, scales, rows each,
    # int64 as bytes) and ``tile_scales`` empty.
    parts: tuple[PackedWeight, ...] = ()

    @staticmethod
    def from_rows(
        fmt: str, data: torch.Tensor, scales: torch.Tensor, kernel: PackedKernel
    ) -> PackedWeight:
        """From ``data`` ``[n, row_bytes]`` uint8 and ``scales`` ``[n, row_scales]``
        float32, the GGUF block order of each row (Q4_1: 16 bytes a block, low
        nibbles the block's first 16 values; scales ``(d, m)`` per block)."""
        if fmt not in LAYOUT:
            raise ValueError(f"unknown packed format {fmt!r}; known: {', '.join(LAYOUT)}")
        if data.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise ValueError("packed data must be uint8 and scales float32")
        element, per_block, num_scales = LAYOUT[fmt]
        rows, row_bytes = data.shape
        k = row_bytes // element.itemsize * BLOCK // per_block
        if row_bytes % element.itemsize or row_bytes // element.itemsize % per_block:
            raise ValueError(f"packed weight {fmt} with {k} columns: not a multiple of {BLOCK}")
        if scales.shape != (rows, k // BLOCK * num_scales):
            raise ValueError(
                f"packed weight {fmt} [{rows}, {k}]: scales {tuple(scales.shape)}, "
                f"expected {(rows, k // BLOCK * num_scales)}"
            )
        values = data.contiguous().view(element)  # [n, k / 32 * per_block]
        tiles = _to_tiles(values.reshape(rows, k // BLOCK, per_block))
        tile_scales = _to_tiles(scales.reshape(rows, k // BLOCK, num_scales))
        return PackedWeight(fmt, tiles.view(torch.uint8), tile_scales, (rows, k), kernel)

    @staticmethod
    def from_row_chunks(
        fmt: str,
        num_rows: int,
        chunks: Iterable[tuple[torch.Tensor, torch.Tensor]],
        kernel: PackedKernel,
    ) -> PackedWeight:
        """``from_rows`` of the rows the ``(data, scales)`` chunks give in turn
        (each but the last a multiple of 64 rows), tiled as they come: only one
        chunk is ever held row-major beside the tiles, never all the rows.
        The tiles are ``from_rows``' own, since a group's tiles depend on its
        64 rows alone."""
        groups = -(-num_rows // (GROUP * STRIP))
        tiles = tile_scales = None
        at = rows = cols = 0
        for data, scales in chunks:
            part = PackedWeight.from_rows(fmt, data, scales, kernel)
            if tiles is None or tile_scales is None:
                tiles = part.tiles.new_empty(groups, part.tiles.shape[1])
                tile_scales = part.tile_scales.new_empty(groups, part.tile_scales.shape[1])
            if rows % (GROUP * STRIP):
                raise ValueError("only the last chunk may end inside a group of 64 rows")
            span = part.tiles.shape[0]
            tiles[at : at + span].copy_(part.tiles)
            tile_scales[at : at + span].copy_(part.tile_scales)
            at, rows, cols = at + span, rows + part.shape[0], part.shape[1]
        if tiles is None or tile_scales is None or rows != num_rows:
            raise ValueError(f"the chunks held {rows} rows, not {num_rows}")
        return PackedWeight(fmt, tiles, tile_scales, (num_rows, cols), kernel)

    def row_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(data, scales)`` in the row-major layout ``from_rows`` takes."""
        _one_format(self)
        element, per_block, num_scales = LAYOUT[self.fmt]
        n, k = self.shape
        values = _from_tiles(self.tiles.view(element), n, k // BLOCK, per_block)
        scales = _from_tiles(self.tile_scales, n, k // BLOCK, num_scales)
        return values.view(torch.uint8).reshape(n, -1), scales

    def dense(self) -> torch.Tensor:
        """The float32 weight ``[n, k]``."""
        n, k = self.shape
        return self.kernel.decode(self.fmt, self.tiles, self.tile_scales, n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, k]`` float32 -> ``[rows, n]``. Each row's
        result is bit for bit what it is alone (batch invariance)."""
        n, k = self.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
            raise ValueError(
                f"a packed [{n}, {k}] weight takes float32 CPU rows of {k}, "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        return self.kernel.linear(self.fmt, x.contiguous(), self.tiles, self.tile_scales, n)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The weight's rows ``index`` (int64), in that order, gathered from
        the tiles and tiled again ``ROW_CHUNK`` at a time: neither an untiled
        copy of the whole weight nor all the gathered rows beside their tiles
        are ever held (a one-line job's peak memory)."""
        ids = index.cpu()
        chunks = (
            tiled_rows(self, ids[start : start + ROW_CHUNK])
            for start in range(0, len(ids), ROW_CHUNK)
        )
        return PackedWeight.from_row_chunks(self.fmt, len(ids), chunks, self.kernel)

    @staticmethod
    def stack(parts: list[PackedWeight]) -> PackedWeight:
        """Rows of several weights of one width, as one (q/k/v, gate/up).
        Neighbours of one format are joined into one; if several formats
        remain (a GGUF's v in another type than its q and k), the result is
        of format ``parts``, each part multiplied in its own format, so every
        row keeps its blocks and its bits."""
        flat = [p for weight in parts for p in (weight.parts or (weight,))]
        first = flat[0]
        if any(p.shape[1] != first.shape[1] for p in flat):
            raise ValueError("only packed weights of one width can be stacked")
        runs: list[list[PackedWeight]] = []
        for p in flat:
            if runs and runs[-1][0].fmt == p.fmt:
                runs[-1].append(p)
            else:
                runs.append([p])
        joined = [_stack_one_format(run) for run in runs]
        if len(joined) == 1:
            return joined[0]
        kernel = first.kernel
        table = torch.tensor(
            [[*kernel.weight_fields(p.fmt, p.tiles, p.tile_scales), p.shape[0]] for p in joined],
            dtype=torch.int64,
        )  # [parts, 4]: format, data, scales, rows
        rows = sum(p.shape[0] for p in joined)
        return PackedWeight(
            "parts", table.view(torch.uint8), torch.zeros(0), (rows, first.shape[1]), kernel,
            tuple(joined),
        )  # fmt: skip


def _stack_one_format(parts: list[PackedWeight]) -> PackedWeight:
    """``PackedWeight.stack`` of weights of one format."""
    first = parts[0]
    if len(parts) == 1:
        return first
    rows = sum(p.shape[0] for p in parts)
    if all(p.shape[0] % (GROUP * STRIP) == 0 for p in parts):
        # Whole groups of rows, none padded: the stacked tiles are the parts' tiles in turn.
        tiles = torch.cat([p.tiles for p in parts])
        scales = torch.cat([p.tile_scales for p in parts])
        return PackedWeight(first.fmt, tiles, scales, (rows, first.shape[1]), first.kernel)
    blocks = [p.row_blocks() for p in parts]
    data = torch.cat([d for d, _ in blocks])
    scales = torch.cat([s for _, s in blocks])
    return PackedWeight.from_rows(first.fmt, data, scales, first.kernel)


def _one_format(weight: PackedWeight) -> None:
    if weight.parts:
        raise ValueError("a packed weight of parts in several formats has no one block layout")


def _to_tiles(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, blocks, e]`` -> ``[groups, blocks * 8 * e * 8]``: rows padded with
    zeros to whole groups of 64, stored ``[group][block][strip][e][row]``."""
    n, num_blocks, e = blocks.shape
    pad = -n % (GROUP * STRIP)
    if pad:
        blocks = torch.cat([blocks, blocks.new_zeros(pad, num_blocks, e)])
    groups = (n + pad) // (GROUP * STRIP)
    tiles = blocks.reshape(groups, GROUP, STRIP, num_blocks, e).permute(0, 3, 1, 4, 2)
    return tiles.contiguous().reshape(groups, num_blocks * GROUP * e * STRIP)


def _from_tiles(tiles: torch.Tensor, n: int, num_blocks: int, e: int) -> torch.Tensor:
    """The inverse of ``_to_tiles``: ``[n, blocks * e]``."""
    groups = tiles.shape[0]
    blocks = tiles.reshape(groups, num_blocks, GROUP, e, STRIP).permute(0, 2, 4, 1, 3)
    return blocks.reshape(groups * GROUP * STRIP, num_blocks * e)[:n].contiguous()


# The byte size of the dense model.safetensors the packed file was written
# beside; a mismatch means the dense weights changed and the file is stale.
DENSE_SIZE_KEY = "metrale.dense_size"


def packed_is_current(folder: Path) -> bool:
    """Whether ``folder`` has a packed file written for its dense weights."""
    file = folder / PACKED_FILE
    if not file.exists():
        return False
    with safe_open(str(file), framework="pt") as handle:
        return (handle.metadata() or {}).get(DENSE_SIZE_KEY) == _dense_size(folder)


def _dense_size(folder: Path) -> str:
    dense = folder / "model.safetensors"
    return str(dense.stat().st_size) if dense.exists() else "none"


class PackedSource(Protocol):
    """Where the runtime asks for a linear weight in packed form first."""

    def get(self, name: str) -> PackedWeight | None: ...


class PackedStore:
    """The packed weights of a folder, read on demand."""

    def __init__(self, file: Path, formats: dict[str, str], kernel: PackedKernel) -> None:
        self.file = file
        self.formats = formats
        self.kernel = kernel

    @classmethod
    def open(cls, folder: Path, kernel: PackedKernel) -> PackedStore | None:
        """The folder's packed weights; ``None`` when it has none, or when they
        were written for another ``model.safetensors`` (a folder whose dense
        weights changed since: its packed copy would be a different model)."""
        if not packed_is_current(folder):
            return None
        file = folder / PACKED_FILE
        with safe_open(str(file), framework="pt") as handle:
            formats = dict(handle.metadata() or {})
        for key in ("format", DENSE_SIZE_KEY):
            formats.pop(key, None)
        return cls(file, formats, kernel)

    def get(self, name: str) -> PackedWeight | None:
        if name not in self.formats:
            return None
        with safe_open(str(self.file), framework="pt") as handle:
            data = handle.get_tensor(f"{name}.data")
            scales = handle.get_tensor(f"{name}.scales")
        return PackedWeight.from_rows(self.formats[name], data, scales, self.kernel)


class Bf16Source:
    """The bfloat16 ``[n, k]`` weights of a store, packed as they are."""

    def __init__(self, store: WeightStore, kernel: PackedKernel) -> None:
        self.store = store
        self.kernel = kernel

    def get(self, name: str) -> PackedWeight | None:
        # The header first: a weight stored otherwise (FP8, float32) is not read twice.
        if name not in self.store or self.store.dtype(name) != "BF16":
            return None
        value = self.store.get(name)
        if value.dtype != torch.bfloat16 or value.dim() != 2 or value.shape[1] % 32:
            return None
        rows = value.shape[0]
        data = value.contiguous().view(torch.uint8).reshape(rows, -1)  # [n, 2 * k]
        no_scales = torch.zeros(rows, 0, dtype=torch.float32)
        return PackedWeight.from_rows("bf16", data, no_scales, self.kernel)


def save_packed(weights: dict[str, tuple[str, torch.Tensor, torch.Tensor]], file: Path) -> None:
    """Writes ``{name: (fmt, data, scales)}`` in the layout ``PackedStore`` reads,
    tied to the ``model.safetensors`` beside ``file`` (written first)."""
    tensors: dict[str, torch.Tensor] = {}
    formats = {"format": "pt", DENSE_SIZE_KEY: _dense_size(file.parent)}
    for name, (fmt, data, scales) in weights.items():
        tensors[f"{name}.data"] = data.contiguous()
        tensors[f"{name}.scales"] = scales.contiguous()
        formats[name] = fmt
    save_file(tensors, str(file), metadata=formats)


def tiled_rows(weight: PackedWeight, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``ids`` of ``weight`` in the row-major block layout (``row_blocks``),
    gathered straight from its tiles: row ``r`` is lane ``r % 8`` of strip
    ``r // 8 % 8`` of group ``r // 64`` in every block, so no untiled copy of
    the whole weight is made."""
    _one_format(weight)
    element, per_block, num_scales = LAYOUT[weight.fmt]
    k = weight.shape[1]
    blocks = k // BLOCK
    group, strip, lane = ids // (GROUP * STRIP), ids // STRIP % GROUP, ids % STRIP

    def gather(tiles: torch.Tensor, per_row: int) -> torch.Tensor:
        # tiles: [groups, blocks * GROUP * per_row * STRIP] -> [len(ids), blocks * per_row]
        grid = tiles.view(tiles.shape[0], blocks, GROUP, per_row, STRIP)
        return grid[group, :, strip, :, lane].reshape(len(ids), blocks * per_row)

    data = gather(weight.tiles.view(element), per_block).view(torch.uint8)
    scales = (
        gather(weight.tile_scales, num_scales)
        if num_scales
        else weight.tile_scales.new_zeros(len(ids), 0)
    )
    return data.reshape(len(ids), -1), scales
