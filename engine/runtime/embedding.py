"""Token ids to embedding rows, from a dense table or from packed rows.

Contract: ``Embedding(ids)`` gives ``[len(ids), hidden]`` in the model's
dtype. A dense embedding indexes its table. A packed one (the embedded
model's Q8_0 embedding, which is also its tied LM head) keeps the weight's
tiles and decodes only the rows asked for, gathered from them, with the kernel's own
arithmetic (Q8_0: ``q * d``; Q4_1: ``q * d + m``, two roundings; bfloat16:
widened; the other GGUF block types by the kernel's decode), so each row is bit for bit the dense table's and no float32 copy of
the whole table is held, nor a second layout of it: a tied LM head's packed
weight is the embedding too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.engine.runtime.packed import ROW_CHUNK, PackedWeight, tiled_rows

# Rows ``packed_rows`` gathers at a time (``PackedWeight.rows``).
_CHUNK_ROWS = ROW_CHUNK
# Formats ``decode_rows`` decodes in torch; the others go through the kernel.
_DECODED_HERE = ("q8_0", "q4_1", "bf16")


class Embedding:
    """``table`` ``[vocab, hidden]`` when dense; ``packed`` when the rows are."""

    def __init__(
        self, table: torch.Tensor | None = None, packed: PackedWeight | None = None
    ) -> None:
        assert (table is None) != (packed is None), "a dense table or packed rows"
        self.table, self.packed = table, packed

    @property
    def shape(self) -> tuple[int, int]:
        if self.table is not None:
            rows, cols = self.table.shape
            return int(rows), int(cols)
        assert self.packed is not None
        return self.packed.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [n] int64
        if self.table is not None:
            return F.embedding(ids, self.table)  # [n, hidden]
        assert self.packed is not None
        fmt, (data, scales) = self.packed.fmt, tiled_rows(self.packed, ids.cpu())
        if fmt not in _DECODED_HERE:  # the GGUF block types: the kernel's own decode
            rows = PackedWeight.from_rows(fmt, data, scales, self.packed.kernel)
            return rows.dense().to(ids.device)
        return decode_rows(fmt, data, scales).to(ids.device)

    def packed_rows(self, index: torch.Tensor) -> PackedWeight:
        """Rows ``index`` of a packed table as a packed weight (an MTP head's
        draft vocabulary of a tied LM head): ``PackedWeight.rows``."""
        packed = self.packed
        assert packed is not None
        return packed.rows(index)

    def matrix(self) -> torch.Tensor:
        """The whole table ``[vocab, hidden]`` (training reads it; decoding never does)."""
        if self.table is not None:
            return self.table
        assert self.packed is not None
        return self.packed.dense()


def decode_rows(fmt: str, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Row-major packed blocks (``PackedWeight.row_blocks``' layout) of ``rows``
    rows -> float32 ``[rows, k]``."""
    rows = data.shape[0]
    if fmt == "q8_0":
        q = data.view(torch.int8).float().view(rows, -1, 32)  # [rows, blocks, 32]
        return (q * scales.view(rows, -1, 1)).view(rows, -1)
    if fmt == "q4_1":
        packed = data.view(rows, -1, 16)  # [rows, blocks, 16]: low nibbles first
        q = torch.cat([(packed & 0x0F).float(), (packed >> 4).float()], dim=-1)
        d_m = scales.view(rows, -1, 2)  # [rows, blocks, (d, m)]
        return (q * d_m[..., :1] + d_m[..., 1:]).view(rows, -1)
    if fmt == "bf16":
        return data.contiguous().view(torch.bfloat16).float()
    raise ValueError(f"unknown packed format {fmt!r}")
