"""The device step's static-shape forward against the ragged forward (float32, CPU).

A static forward runs slots ``0..B-1`` at one width, padded; its real rows
must equal what the ragged forward gives for the same tokens, and its padded
rows must leave every real position of the cache as the ragged run left it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.runtime.kv_cache import SlotKVCache
from metrale.engine.runtime.latent_cache import LatentCache
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.mtp import detect_mtp, load_checkpoint_mtp
from metrale.engine.runtime.static_step import (
    GraphCache,
    batch_buckets,
    bucket,
    ctx_bucket,
    static_plan,
)
from tests.support.checkpoints import build_runtime, random_ids, write_tiny_checkpoint
from tests.support.moe_checkpoints import write_moe_checkpoint

MOE = ("deepseek_v3", "glm4_moe", "glm4_moe_lite", "qwen2_moe", "qwen3_moe")

HEADROOM = 8
MAX_LEN = 48


def _prefill(model: LlamaModel, prompts: list[list[int]]) -> None:
    model.forward([Segment(slot, 0, ids) for slot, ids in enumerate(prompts)], logits="last")


def _written(cache: object, layer: int, slot: int, end: int) -> torch.Tensor:
    """Positions ``0..end-1`` of one slot in one layer of either cache kind."""
    if isinstance(cache, SlotKVCache):
        return cache.keys[layer][slot, :, :end]
    assert isinstance(cache, LatentCache)
    return cache.entries[layer][slot, :end]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", *MOE])
def test_static_rows_equal_the_ragged_forward_padded_rows_and_all(
    family: str, tmp_path: Path
) -> None:
    if family in MOE:
        path = write_moe_checkpoint(tmp_path / family, family)
    else:
        path = write_tiny_checkpoint(tmp_path / family, family)
    ragged = build_runtime(path, num_slots=4, max_len=MAX_LEN)
    static = build_runtime(path, num_slots=4, max_len=MAX_LEN, headroom=HEADROOM)
    ids = random_ids(4, 20, seed=3).tolist()
    prompts = [ids[0][:9], ids[1][:5], ids[2][:14], ids[3][:7]]
    for model in (ragged, static):
        _prefill(model, prompts)
    # Verify rows of 3, 1 and 4 tokens for slots 0..2; slot 3 is not decoding.
    feeds = {0: ids[0][9:12], 1: ids[1][5:6], 2: ids[2][14:18]}
    out = ragged.forward([Segment(s, len(prompts[s]), t) for s, t in feeds.items()])
    width, batch = 4, 4
    tokens = torch.zeros(batch, width, dtype=torch.int64)
    starts = torch.full((batch,), MAX_LEN + HEADROOM - width, dtype=torch.int64)
    for slot, fed in feeds.items():
        tokens[slot, : len(fed)] = torch.tensor(fed)
        starts[slot] = len(prompts[slot])
    ctx = ctx_bucket(int(starts.max()) + width, MAX_LEN + HEADROOM)
    logits, hidden = static.forward_static(tokens, starts, ctx)
    assert logits.shape == (batch * width, ragged.vocab_size)
    row = 0
    for slot, fed in feeds.items():
        for r in range(len(fed)):
            torch.testing.assert_close(logits[slot * width + r], out.logits[row], atol=2e-5, rtol=0)
            torch.testing.assert_close(hidden[slot * width + r], out.hidden[row], atol=2e-5, rtol=0)
            row += 1
    # Every real position of every cache (slot 3's prompt included) is untouched
    # by the padded rows (MLA: the latent and rope key).
    for layer in range(ragged.spec.num_layers):
        for slot, prompt in enumerate(prompts):
            end = len(prompt) + len(feeds.get(slot, []))
            torch.testing.assert_close(
                _written(static.stack.cache, layer, slot, end),
                _written(ragged.stack.cache, layer, slot, end),
                atol=2e-5,
                rtol=0,
            )


def test_static_mtp_rows_equal_the_ragged_module_forward(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "mimo", "qwen2", mtp_layout="mimo")
    ckpt = read_checkpoint(path)
    found = detect_mtp(ckpt.raw_config, ckpt.weights.names(), ckpt.spec.num_layers)
    assert found is not None
    model = build_runtime(path, num_slots=2, max_len=MAX_LEN, headroom=HEADROOM)
    (module,) = load_checkpoint_mtp(model, ckpt.weights, found)
    ids = random_ids(2, 12, seed=5).tolist()
    hidden = torch.randn(2 * 4, ckpt.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    # Slot 0 fed rows 3..5 (3 tokens), slot 1 rows 6..9 (4 tokens), ragged then static.
    ragged = module.forward(
        [Segment(0, 3, ids[0][:3]), Segment(1, 6, ids[1][:4])],
        torch.cat([hidden[0:3], hidden[4:8]]),
    )
    tokens = torch.tensor([[*ids[0][:3], 0], ids[1][:4]])
    starts = torch.tensor([3, 6])
    ctx = ctx_bucket(10, MAX_LEN + HEADROOM)
    real = [0, 1, 2, 4, 5, 6, 7]
    for rows in ([2, 3], [0, 1]):  # each slot's last real row, then others
        logits, out = module.forward_static(tokens, hidden, starts, ctx, torch.tensor(rows))
        want = [rows[0], 3 + rows[1]]  # those rows among the ragged run's real ones
        torch.testing.assert_close(logits, ragged.logits[want], atol=2e-5, rtol=0)
        torch.testing.assert_close(out[real], ragged.hidden, atol=2e-5, rtol=0)


def test_a_row_with_nothing_to_read_reads_position_zero() -> None:
    plan = static_plan(torch.tensor([2, 0]), width=2, ctx=4, sliding_window=1)
    assert plan.mask is not None
    # Sliding window 1: each row reads only its own position, and never is empty.
    assert plan.mask[:, 0].sum(dim=-1).tolist() == [[1, 1], [1, 1]]
    assert plan.token_slots.tolist() == [0, 0, 1, 1]
    assert plan.positions.tolist() == [2, 3, 0, 1]


def test_buckets() -> None:
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert bucket(3, (1, 2, 4, 8)) == 4
    with pytest.raises(ValueError, match="exceeds the largest static size 8"):
        bucket(9, (1, 2, 4, 8))
    assert ctx_bucket(10, 4096) == 256
    assert ctx_bucket(257, 4096) == 512
    assert ctx_bucket(5000, 4096) == 4096


def test_graphs_are_off_on_the_cpu() -> None:
    graphs = GraphCache(torch.device("cpu"), enabled=True)
    assert not graphs.enabled
    x = torch.ones(3)
    (doubled,) = graphs.run("double", lambda t: (t * 2,), x)
    assert doubled.tolist() == [2.0, 2.0, 2.0]
    assert graphs.captured() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_on_cuda(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    eager = build_runtime(path, num_slots=4, max_len=MAX_LEN, headroom=HEADROOM, device="cuda")
    graphed = build_runtime(path, num_slots=4, max_len=MAX_LEN, headroom=HEADROOM, device="cuda")
    graphs = GraphCache(torch.device("cuda"), enabled=True, max_graphs=2)
    ids = random_ids(4, 16, seed=9).cuda()
    for step in range(3):  # the same shape captured once, replayed after
        tokens = ids[:, step * 4 : step * 4 + 4].contiguous()
        starts = torch.full((4,), step * 4, dtype=torch.int64, device="cuda")
        want = eager.forward_static(tokens, starts, 256)
        got = graphs.run((4, 4, 256), graphed.forward_static, tokens, starts, 256)
        torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
    assert graphs.captured() == [(4, 4, 256)]


@pytest.mark.parametrize("family", MOE)
def test_stacked_experts_give_the_per_expert_loops_forward(family: str, tmp_path: Path) -> None:
    path = write_moe_checkpoint(tmp_path / family, family)
    loop = build_runtime(path, num_slots=2, max_len=MAX_LEN)
    grouped = build_runtime(path, num_slots=2, max_len=MAX_LEN, headroom=HEADROOM)
    assert grouped.prepare_static(), "every MoE block stacked"
    blocks = [w.moe for w in grouped.stack.blocks if w.moe is not None]
    assert blocks and all(m.stacked is not None for m in blocks)
    assert blocks[0].stacked is not None
    gate_up, viewed = blocks[0].stacked[0], blocks[0].experts[1].gate_up
    assert isinstance(viewed, torch.Tensor) and viewed.data_ptr() == gate_up[1].data_ptr()
    ids = random_ids(2, 12, seed=4).tolist()
    segments = [Segment(0, 0, ids[0][:12]), Segment(1, 0, ids[1][:5])]
    want, got = loop.forward(segments), grouped.forward(segments)
    torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=0)
    assert (
        grouped.forward([Segment(0, 12, [7])]).logits.argmax()
        == loop.forward([Segment(0, 12, [7])]).logits.argmax()
    )
