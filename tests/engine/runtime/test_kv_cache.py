"""Slot KV cache addressing: what each row writes and may read."""

from __future__ import annotations

import pytest
import torch

from metrale.engine.runtime.kv_cache import SlotKVCache, plan_rows
from metrale.engine.runtime.model import Segment

CPU = torch.device("cpu")


def test_mask_lets_each_row_read_exactly_its_own_prefix() -> None:
    segments = [Segment(2, 5, [1, 2, 3]), Segment(0, 0, [4]), Segment(1, 9, [5, 6])]
    plan = plan_rows(segments, num_slots=4, max_len=16, device=CPU)
    assert plan.mask is not None and plan.ctx_len == 11 and plan.max_rows == 3
    for seg_index, seg in enumerate(segments):
        for row in range(len(seg.token_ids)):
            allowed = plan.mask[seg_index, 0, row].nonzero().flatten().tolist()
            assert allowed == list(range(seg.start + row + 1))
        for row in range(len(seg.token_ids), plan.max_rows):  # padding: finite, dropped
            assert plan.mask[seg_index, 0, row, 0]


def test_sliding_window_limits_the_readable_prefix() -> None:
    plan = plan_rows(
        [Segment(0, 10, [1, 2])], num_slots=1, max_len=32, device=CPU, sliding_window=4
    )
    assert plan.mask is not None
    assert plan.mask[0, 0, 0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert plan.mask[0, 0, 1].nonzero().flatten().tolist() == [8, 9, 10, 11]


def test_rows_pack_in_segment_order_with_their_slots_and_positions() -> None:
    plan = plan_rows(
        [Segment(3, 4, [7, 8]), Segment(1, 0, [9])], num_slots=4, max_len=8, device=CPU
    )
    assert plan.token_ids.tolist() == [7, 8, 9]
    assert plan.positions.tolist() == [4, 5, 0]
    assert plan.token_slots.tolist() == [3, 3, 1]
    assert plan.last_rows.tolist() == [1, 2]
    assert plan.pad_index is not None and plan.pad_index.tolist() == [0, 1, 2]
    assert plan.slot_range is None


def test_lone_prefill_from_zero_needs_no_mask() -> None:
    plan = plan_rows([Segment(0, 0, [1, 2, 3])], num_slots=2, max_len=8, device=CPU)
    assert plan.mask is None and plan.pad_index is None and plan.slot_range == (0, 1)


def test_write_lands_at_slot_and_position_and_reads_back() -> None:
    cache = SlotKVCache(2, 4, 2, 8, 3, torch.float32, CPU)
    segments = [Segment(1, 2, [0, 0]), Segment(2, 0, [0])]
    plan = plan_rows(segments, 4, 8, CPU)
    k = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3)
    cache.write(1, plan, k, -k)
    keys = cache.keys[1]
    assert torch.equal(keys[1, :, 2], k[0]) and torch.equal(keys[1, :, 3], k[1])
    assert torch.equal(keys[2, :, 0], k[2])
    assert keys.abs().sum() == k.abs().sum()  # nothing else was touched
    assert cache.keys[0].abs().sum() == 0
    read_keys, read_values = cache.read(1, plan)
    assert plan.slot_range == (1, 3)  # a view, no gather
    assert read_keys.data_ptr() == keys[1].data_ptr()
    assert read_keys.shape == (2, 2, 4, 3) and torch.equal(read_values, -read_keys)


def test_gathered_read_equals_the_slots_it_names() -> None:
    cache = SlotKVCache(1, 4, 1, 6, 2, torch.float32, CPU)
    cache.keys[0].copy_(torch.randn(4, 1, 6, 2))
    plan = plan_rows([Segment(3, 1, [0]), Segment(0, 4, [0])], 4, 6, CPU)
    keys, _ = cache.read(0, plan)
    assert plan.slot_range is None
    assert torch.equal(keys, cache.keys[0][[3, 0], :, :5])


def test_bytes_per_token_counts_keys_and_values_of_every_layer() -> None:
    cache = SlotKVCache(3, 2, 4, 8, 16, torch.bfloat16, CPU)
    assert cache.bytes_per_token == 2 * 3 * 4 * 16 * 2


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([Segment(0, 0, [1]), Segment(0, 1, [2])], "at most once"),
        ([Segment(4, 0, [1])], "out of range"),
        ([Segment(0, 7, [1, 2])], "max_len"),
    ],
)
def test_plan_refuses_segments_that_break_the_contract(
    segments: list[Segment], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_rows(segments, num_slots=4, max_len=8, device=CPU)
