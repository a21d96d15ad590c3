"""The Llama-family runtime against transformers' own classes, and against itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.llama import KERNEL_ATTENTION_ROWS, LlamaModel
from metrale.engine.runtime.model import Segment
from tests.support.checkpoints import (
    build_runtime,
    random_ids,
    reference_logits,
    write_tiny_checkpoint,
)
from tests.support.rope_scalings import LLAMA3_ROPE, YARN_ROPE

TOL = 1e-4
# (family, writer options): every family, tied and untied heads, sharded
# weights, and the RoPE scalings configs declare.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied-llama3-rope-sharded": (
        "llama",
        {"tie_embeddings": True, "rope_parameters": LLAMA3_ROPE, "num_shards": 3},
    ),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {"rope_parameters": YARN_ROPE}),
    "qwen3": ("qwen3", {"tie_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family, options = CASES[request.param]
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family, **options)


def test_prefill_logits_equal_transformers(checkpoint: Path) -> None:
    ids = random_ids(1, 80)
    expected = reference_logits(checkpoint, ids)[0]
    out = build_runtime(checkpoint).forward([Segment(0, 0, ids[0].tolist())])
    assert out.logits.shape == expected.shape
    assert (out.logits - expected).abs().max().item() <= TOL


def ragged_rows_match_transformers(checkpoint: Path, chunk_end: int) -> LlamaModel:
    """Prefill three sequences in different slots, then one forward of a
    prefill chunk of sequence 2 from position 10 to ``chunk_end``, a verify row
    of 4 and a decode token, each at its own position, checked against
    transformers. Returns the model."""
    ids = random_ids(3, 60)
    expected = reference_logits(checkpoint, ids)
    model = build_runtime(checkpoint)
    model.forward([Segment(2, 0, ids[0, :40].tolist()), Segment(0, 0, ids[1, :25].tolist())])
    model.forward([Segment(3, 0, ids[2, :10].tolist())])
    rows = [
        (3, 10, 2, chunk_end),  # slot, start, sequence, end: a prefill chunk
        (2, 40, 0, 44),  # a verify row of 4
        (0, 25, 1, 26),  # one decode token
    ]
    out = model.forward([Segment(s, a, ids[q, a:e].tolist()) for s, a, q, e in rows])
    got = out.logits.split([e - a for _, a, _, e in rows])
    for (_, start, seq, end), logits in zip(rows, got, strict=True):
        assert (logits - expected[seq, start:end]).abs().max().item() <= TOL
    return model


def test_ragged_multi_slot_rows_equal_transformers(checkpoint: Path) -> None:
    # A 50-token chunk: longer than the C kernel takes, so torch attends.
    ragged_rows_match_transformers(checkpoint, 60)


def test_decode_and_verify_rows_in_the_kernels_equal_transformers(checkpoint: Path) -> None:
    """Every segment within KERNEL_ATTENTION_ROWS: the C attention and layer ops
    run (CPU float32), for every family and rope scaling in CASES."""
    model = ragged_rows_match_transformers(checkpoint, 10 + KERNEL_ATTENTION_ROWS)
    assert model.stack.kernel is not None


def test_ragged_batch_equals_each_sequence_alone(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "qwen2")
    ids = random_ids(3, 30, seed=7)
    starts = (12, 5, 20)
    alone = []
    for seq in range(3):
        model = build_runtime(path)
        model.forward([Segment(1, 0, ids[seq, : starts[seq]].tolist())])
        alone.append(model.forward([Segment(1, starts[seq], ids[seq, starts[seq] :].tolist())]))
    together = build_runtime(path)
    slots = (3, 0, 2)  # neither ascending nor contiguous: the gathered read path
    together.forward([Segment(slots[q], 0, ids[q, : starts[q]].tolist()) for q in range(3)])
    out = together.forward(
        [Segment(slots[q], starts[q], ids[q, starts[q] :].tolist()) for q in range(3)]
    )
    lengths = [30 - s for s in starts]
    for seq, (logits, hidden) in enumerate(
        zip(out.logits.split(lengths), out.hidden.split(lengths), strict=True)
    ):
        assert torch.allclose(logits, alone[seq].logits, atol=1e-5)
        assert torch.allclose(hidden, alone[seq].hidden, atol=1e-5)


def test_rollback_then_reverify_gives_identical_logits(tmp_path: Path) -> None:
    """A rejected verify leaves stale keys beyond seq_len; moving seq_len back and
    verifying other drafts must not see them."""
    path = write_tiny_checkpoint(tmp_path, "llama")
    ids = random_ids(1, 20, seed=3)[0].tolist()
    drafts_a, drafts_b = [5, 6, 7, 8], [ids[16], 9, 10]
    model = build_runtime(path)
    model.forward([Segment(0, 0, ids[:16])])
    first = model.forward([Segment(0, 16, drafts_b)]).logits
    model.forward([Segment(0, 16, drafts_a)])  # rejected: seq_len stays 16
    again = model.forward([Segment(0, 16, drafts_b)]).logits
    assert torch.equal(first, again)
    fresh = build_runtime(path)
    fresh.forward([Segment(0, 0, ids[:16])])
    assert torch.allclose(fresh.forward([Segment(0, 16, drafts_b)]).logits, first, atol=1e-6)


def test_last_logits_are_the_last_rows_of_all(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "qwen3")
    ids = random_ids(2, 12, seed=5)
    model = build_runtime(path)
    segments = [Segment(0, 0, ids[0, :7].tolist()), Segment(1, 0, ids[1].tolist())]
    everything = model.forward(segments, logits="all")
    last = model.forward(segments, logits="last")
    assert last.logits.shape == (2, everything.logits.shape[1])
    assert torch.allclose(last.logits, everything.logits[[6, 18]], atol=1e-6)
    assert torch.equal(last.hidden, everything.hidden)


def test_sliding_window_matches_transformers(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "mistral")
    config = path / "config.json"
    config.write_text(config.read_text().replace('"sliding_window": null', '"sliding_window": 8'))
    ids = random_ids(1, 40, seed=9)
    expected = reference_logits(path, ids)[0]
    model = build_runtime(path)
    model.forward([Segment(0, 0, ids[0, :30].tolist())])
    out = model.forward([Segment(0, 30, ids[0, 30:].tolist())])
    assert (out.logits - expected[30:]).abs().max().item() <= TOL


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, "llama")
    config = path / "config.json"
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "gpt2"'))
    with pytest.raises(CheckpointError, match=r"unsupported architecture gpt2.*Llama.*Qwen3"):
        read_checkpoint(path)


def test_segment_beyond_max_len_is_refused(tmp_path: Path) -> None:
    model = build_runtime(write_tiny_checkpoint(tmp_path, "llama"), max_len=16)
    with pytest.raises(ValueError, match="max_len"):
        model.forward([Segment(0, 10, list(range(7)))])
