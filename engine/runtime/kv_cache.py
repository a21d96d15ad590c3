"""KV cache in fixed slots, and the row plan that addresses it.

Memory layout: per layer one key and one value tensor
``[num_slots, num_kv_heads, max_len, head_dim]``, allocated once. Slot ``s``
position ``p`` holds the key/value of the token at position ``p`` of the
sequence that owns slot ``s``. Nothing records a length: the caller owns
``seq_len`` and a rollback is the caller moving it back; the next forward on
that slot overwrites the stale positions.

A ``RowPlan`` is built once per forward from its segments and shared by every
layer (and by an MTP module run on the same segments): which slot and position
each packed token writes, and which cache window each segment reads. Packed
rows are tokens in segment order; attention runs on a padded
``[num_segments, max_segment_len]`` view of them.

Unwritten positions are read (and masked) when segments of different lengths
share one attention call, so they must hold finite numbers: small caches are
zero-filled, large CPU caches come from fresh (zero) pages of ``torch.empty``
so that memory is only committed as positions are written.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from metrale.engine.runtime.model import Segment

# Above this a CPU cache is left to the kernel's zero pages (see module doc).
_LAZY_ZERO_BYTES = 64 << 20


@dataclass
class RowPlan:
    """Addressing of one forward's packed rows (see module doc)."""

    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    token_slots: torch.Tensor  # [num_tokens] int64
    slot_ids: torch.Tensor  # [num_segments] int64
    slot_range: tuple[int, int] | None  # (first, end) when slots are ascending and contiguous
    num_segments: int
    max_rows: int  # longest segment
    ctx_len: int  # cache positions read: max over segments of start + len
    pad_index: torch.Tensor | None  # [num_tokens] into [num_segments * max_rows]; None: no padding
    mask: torch.Tensor | None  # [num_segments, 1, max_rows, ctx_len] bool; None: plain causal
    last_rows: torch.Tensor  # [num_segments] packed row of each segment's last token
    lone: tuple[int, int] | None = None  # (slot, start) when there is one segment
    # [num_segments, 4] int64 on the CPU: (slot, start, rows, first packed row),
    # the segment table of the C attention kernel (kernels/attention.c)
    segment_table: torch.Tensor | None = None
    sliding_window: int | None = None

    _grouped: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def grouped_mask(self, group: int) -> torch.Tensor:
        """The mask repeated for ``group`` query heads stacked along the row axis:
        ``[num_segments, 1, group * max_rows, ctx_len]``, built once per plan."""
        assert self.mask is not None, "a lone prefill from position 0 uses no mask"
        if group not in self._grouped:
            segs, _, rows, ctx = self.mask.shape
            expanded = self.mask.unsqueeze(2).expand(segs, 1, group, rows, ctx)
            self._grouped[group] = expanded.reshape(segs, 1, group * rows, ctx)
        return self._grouped[group]


def plan_rows(
    segments: Sequence[Segment],
    num_slots: int,
    max_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> RowPlan:
    """Builds the plan; raises ``ValueError`` unless the Segment contract holds
    (one non-empty segment per slot, within ``num_slots`` and ``max_len``)."""
    if not segments:
        raise ValueError("a forward takes at least one segment")
    lens = [len(s.token_ids) for s in segments]
    slots = [s.slot for s in segments]
    if len(set(slots)) != len(slots):
        raise ValueError("a slot appears at most once per forward")
    # Raised, not asserted: the C kernels index the cache by these numbers.
    for seg, n in zip(segments, lens, strict=True):
        if not 0 <= seg.slot < num_slots:
            raise ValueError(f"slot {seg.slot} out of range (num_slots={num_slots})")
        if seg.start < 0 or n < 1 or seg.start + n > max_len:
            raise ValueError(f"segment [{seg.start}, {seg.start + n}) beyond max_len {max_len}")
    num_segments = len(segments)
    max_rows = max(lens)
    ctx_len = max(s.start + n for s, n in zip(segments, lens, strict=True))
    ids: list[int] = []
    positions: list[int] = []
    token_slots: list[int] = []
    for seg, n in zip(segments, lens, strict=True):
        ids.extend(seg.token_ids)
        positions.extend(range(seg.start, seg.start + n))
        token_slots.extend([seg.slot] * n)
    ends = list(itertools.accumulate(lens))  # host ints: no device read for the table
    ascending = slots == list(range(slots[0], slots[0] + num_segments))

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    pad_index = None
    if any(n != max_rows for n in lens):
        pad_index = as_tensor([i * max_rows + r for i, n in enumerate(lens) for r in range(n)])
    mask = None
    lone_prefill = num_segments == 1 and segments[0].start == 0 and sliding_window is None
    if not lone_prefill:
        mask = _attention_mask(segments, max_rows, ctx_len, device, sliding_window)
    return RowPlan(
        token_ids=as_tensor(ids),
        positions=as_tensor(positions),
        token_slots=as_tensor(token_slots),
        slot_ids=as_tensor(slots),
        slot_range=(slots[0], slots[0] + num_segments) if ascending else None,
        num_segments=num_segments,
        max_rows=max_rows,
        ctx_len=ctx_len,
        pad_index=pad_index,
        mask=mask,
        last_rows=as_tensor([end - 1 for end in ends]),
        lone=(slots[0], segments[0].start) if num_segments == 1 else None,
        segment_table=torch.tensor(
            [
                (seg.slot, seg.start, n, int(end) - n)
                for seg, n, end in zip(segments, lens, ends, strict=True)
            ],
            dtype=torch.int64,
        ),
        sliding_window=sliding_window,
    )


def _attention_mask(
    segments: Sequence[Segment],
    max_rows: int,
    ctx_len: int,
    device: torch.device,
    sliding_window: int | None,
) -> torch.Tensor:
    """True where a query row may read a cache position: ``key_pos <= query_pos``
    (and within the sliding window). Padding rows see position 0 so their
    softmax stays finite; their output is dropped."""
    starts = torch.tensor([s.start for s in segments], dtype=torch.int64, device=device)
    query_pos = starts[:, None] + torch.arange(max_rows, device=device)  # [S, max_rows]
    key_pos = torch.arange(ctx_len, device=device)  # [ctx_len]
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, max_rows, ctx_len]
    if sliding_window is not None:
        allowed &= (query_pos[:, :, None] - key_pos[None, None, :]) < sliding_window
    return allowed.unsqueeze(1)  # [S, 1, max_rows, ctx_len]


def zero_filled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's cache tensor, all zeros: written out when small, left to the
    kernel's fresh pages when large and on the CPU (see module doc)."""
    lazy = device.type == "cpu" and math.prod(shape) * dtype.itemsize >= _LAZY_ZERO_BYTES
    return (torch.empty if lazy else torch.zeros)(shape, dtype=dtype, device=device)


class SlotKVCache:
    """Per-layer key/value tensors ``[num_slots, num_kv_heads, max_len, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [zero_filled(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zero_filled(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, plan: RowPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` at each row's slot
        and position. One segment is a plain slice copy (a decode step at
        batch 1 writes 30 layers x 2 of them), several an indexed write."""
        if plan.lone is not None:
            slot, start = plan.lone
            end = start + k.shape[0]
            self.keys[layer][slot, :, start:end] = k.transpose(0, 1)
            self.values[layer][slot, :, start:end] = v.transpose(0, 1)
            return
        self.keys[layer][plan.token_slots, :, plan.positions] = k
        self.values[layer][plan.token_slots, :, plan.positions] = v

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Positions ``0..length-1`` of slot ``source`` into slot ``slot``, every layer."""
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[slot, :, :length] = keys[source, :, :length]
            values[slot, :, :length] = values[source, :, :length]

    def read(self, layer: int, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The segments' windows ``[num_segments, num_kv_heads, ctx_len, head_dim]``:
        a view when the slots are contiguous, a gathered copy otherwise."""
        keys, values = self.keys[layer], self.values[layer]
        if plan.slot_range is not None:
            first, end = plan.slot_range
            return keys[first:end, :, : plan.ctx_len], values[first:end, :, : plan.ctx_len]
        return (
            keys[:, :, : plan.ctx_len].index_select(0, plan.slot_ids),
            values[:, :, : plan.ctx_len].index_select(0, plan.slot_ids),
        )
