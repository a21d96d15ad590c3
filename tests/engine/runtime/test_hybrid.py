"""The hybrid family (Qwen3.5/3.6, Qwen3-Next) against transformers, forward by forward.

Tiny random checkpoints written by transformers' own classes
(``tests.support.hybrid_checkpoints``) in every released layout: logits of a
prefill (the chunked form), of decode rows and of ragged verify rows of
several sequences equal transformers'; after a verify that accepts ``m`` of
``k`` drafts, for every ``m``, the linear layers' state and the next logits
equal a fresh run's on the accepted tokens; the static forward the device
step runs equals the ragged one; FP8 equals its dequantized twin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.runtime.linear_state import LinearStates
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.rope import RopeTable
from tests.support.checkpoints import build_runtime, random_ids
from tests.support.hybrid_checkpoints import FAMILIES, write_hybrid_checkpoint
from tests.support.hybrid_fp8 import dequantized_twin, write_fp8_twin
from tests.support.hybrid_references import load_reference, reference_logits

ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> torch.Tensor:
    """transformers' logits ``[3, 100, vocab]`` for ``random_ids(3, 100)``."""
    return reference_logits(checkpoint, random_ids(3, 100, seed=3))


def _states(model: LlamaModel) -> LinearStates:
    states = model.stack.linear_states
    assert states is not None, "a hybrid model keeps linear states"
    return states


def test_the_config_is_read_as_the_family_defines_it(checkpoint: Path) -> None:
    spec = read_checkpoint(checkpoint).spec
    assert spec.linear is not None and spec.attn_gate and spec.norm_offset == 1.0
    assert sorted(spec.linear.layers) == [0, 1, 2, 4, 5, 6]
    assert spec.attention_layers == [3, 7]
    assert spec.rope_dim == spec.head_dim // 4  # partial rotary 0.25
    assert spec.linear.fused_projections == (spec.model_type == "qwen3_next")


def test_prefill_decode_and_ragged_verify_logits_equal_transformers(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    ids = random_ids(3, 100, seed=3)
    model = build_runtime(checkpoint, num_slots=3, max_len=128)
    # Prefill: slot 0 long (the chunked form, across a block boundary), the
    # others short (token by token), in one forward.
    out = model.forward(
        [Segment(0, 0, ids[0, :70].tolist()), Segment(1, 0, ids[1, :9].tolist())], logits="all"
    )
    torch.testing.assert_close(out.logits[:70], reference[0, :70], rtol=0, atol=ATOL)
    torch.testing.assert_close(out.logits[70:], reference[1, :9], rtol=0, atol=ATOL)
    # Decode rows and verify rows of different widths, ragged, in one forward.
    out = model.forward(
        [
            Segment(0, 70, ids[0, 70:71].tolist()),
            Segment(1, 9, ids[1, 9:14].tolist()),
            Segment(2, 0, ids[2, :3].tolist()),
        ]
    )
    rows = out.logits.split([1, 5, 3])
    torch.testing.assert_close(rows[0], reference[0, 70:71], rtol=0, atol=ATOL)
    torch.testing.assert_close(rows[1], reference[1, 9:14], rtol=0, atol=ATOL)
    torch.testing.assert_close(rows[2], reference[2, :3], rtol=0, atol=ATOL)


@pytest.mark.parametrize("accepted", range(5))
def test_a_verify_accepting_m_of_k_drafts_leaves_a_fresh_runs_state(
    checkpoint: Path, reference: torch.Tensor, accepted: int
) -> None:
    """Verify rows ``[last] + 4 drafts`` at 40..44 in slot 0 beside another
    sequence's verify; the model accepts ``accepted`` drafts, so the next
    forward starts at ``41 + accepted``: it commits the accepted prefix, so
    every linear layer's state and conv window then equal a fresh prefill's
    of the accepted tokens, and its logits equal transformers'."""
    ids = random_ids(3, 100, seed=3)
    model = build_runtime(checkpoint, num_slots=2, max_len=128)
    model.forward([Segment(0, 0, ids[0, :40].tolist()), Segment(1, 0, ids[1, :20].tolist())])
    model.forward([Segment(0, 40, ids[0, 40:45].tolist()), Segment(1, 20, ids[1, 20:23].tolist())])
    resume = 41 + accepted
    out = model.forward([Segment(0, resume, ids[0, resume : resume + 3].tolist())])
    torch.testing.assert_close(out.logits, reference[0, resume : resume + 3], rtol=0, atol=ATOL)

    fresh = build_runtime(checkpoint, num_slots=2, max_len=128)
    fresh.forward([Segment(0, 0, ids[0, :resume].tolist())])  # a prefill commits its end
    ours, theirs = _states(model), _states(fresh)
    assert int(ours.base[0]) == int(theirs.base[0]) == resume
    torch.testing.assert_close(ours.state[:, 0], theirs.state[:, 0], rtol=0, atol=1e-4)
    torch.testing.assert_close(ours.conv[:, 0], theirs.conv[:, 0], rtol=0, atol=1e-5)


def test_a_rewind_past_the_kept_rows_is_refused(checkpoint: Path) -> None:
    ids = random_ids(1, 60, seed=4)[0].tolist()
    model = build_runtime(checkpoint, num_slots=1, max_len=128)
    model.forward([Segment(0, 0, ids[:40])])  # long: its end is committed at 40
    with pytest.raises(AssertionError, match=r"kept only for positions 40\.\.40"):
        model.forward([Segment(0, 38, ids[38:40])])


def test_a_new_sequence_in_a_used_slot_starts_from_an_empty_state(
    checkpoint: Path, reference: torch.Tensor
) -> None:
    ids = random_ids(3, 100, seed=3)
    model = build_runtime(checkpoint, num_slots=1, max_len=128)
    model.forward([Segment(0, 0, ids[1, :30].tolist())])
    out = model.forward([Segment(0, 0, ids[0, :12].tolist())])
    torch.testing.assert_close(out.logits, reference[0, :12], rtol=0, atol=ATOL)


def test_static_rows_equal_the_ragged_forward_and_slots_not_fed_keep_their_state(
    checkpoint: Path,
) -> None:
    """The device step's forward: slots 0..2 at width 4, slot 1 not fed
    (pointed into the headroom). Real rows equal the ragged forward's; slot
    1's state, window and pending rows are untouched; then a partial
    acceptance commits the same state on both paths."""
    ids = random_ids(3, 40, seed=5)
    ragged = build_runtime(checkpoint, num_slots=3, max_len=64, headroom=8)
    static = build_runtime(checkpoint, num_slots=3, max_len=64, headroom=8)
    prompts = [ids[0, :20].tolist(), ids[1, :7].tolist(), ids[2, :11].tolist()]
    for model in (ragged, static):
        model.forward([Segment(s, 0, p) for s, p in enumerate(prompts)])
    rows = [ids[0, 20:24].tolist(), ids[2, 11:15].tolist()]
    want = ragged.forward([Segment(0, 20, rows[0]), Segment(2, 11, rows[1])]).logits
    kept = {name: getattr(_states(static), name)[:, 1].clone() for name in ("state", "conv")}
    tokens = torch.tensor([rows[0], [0, 0, 0, 0], rows[1]])
    starts = torch.tensor([20, 64, 11])  # slot 1 points past max_len: not fed
    logits, _ = static.forward_static(tokens, starts, ctx=72)
    got = logits.view(3, 4, -1)
    torch.testing.assert_close(got[0], want[:4], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[2], want[4:], rtol=0, atol=1e-5)
    for name, before in kept.items():
        assert torch.equal(getattr(_states(static), name)[:, 1], before), name
    assert int(_states(static).base[1]) == 0 and int(_states(static).pending[1]) == 7
    # Slot 0 accepts 2 of its 3 drafts, slot 2 none; slot 1 goes on from 7.
    nxt = [
        Segment(0, 23, ids[0, 23:25].tolist()),
        Segment(1, 7, ids[1, 7:9].tolist()),
        Segment(2, 12, ids[2, 12:14].tolist()),
    ]
    torch.testing.assert_close(
        static.forward(nxt).logits, ragged.forward(nxt).logits, rtol=0, atol=1e-5
    )


def test_mrope_sections_reduce_to_plain_partial_rotary_for_text(checkpoint: Path) -> None:
    """Text feeds the same position to every mRoPE axis, so the interleaved
    sections pick the same angles: the table equals transformers' rotary
    embedding at text positions."""
    ckpt = read_checkpoint(checkpoint)
    reference = load_reference(checkpoint)
    text_model = getattr(reference.model, "language_model", reference.model)
    positions = torch.arange(50)[None]
    x = torch.zeros(1, 50, ckpt.spec.hidden_size)
    cos, sin = text_model.rotary_emb(x, positions)
    table = RopeTable(ckpt.hf_config, ckpt.spec.rope_dim, 50, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(table.cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin, sin[0], rtol=0, atol=1e-6)


def test_fp8_runs_as_its_dequantized_twin(tmp_path: Path) -> None:
    src = write_hybrid_checkpoint(tmp_path / "src", "qwen3_5_moe")
    fp8 = write_fp8_twin(src, tmp_path / "fp8")
    twin = dequantized_twin(fp8)
    ids = random_ids(2, 30, seed=6)
    segments = [Segment(s, 0, ids[s].tolist()) for s in range(2)]
    got = build_runtime(fp8, num_slots=2, max_len=64).forward(segments).logits
    want = build_runtime(twin, num_slots=2, max_len=64).forward(segments).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    store = read_checkpoint(fp8).weights
    stored = {store.dtype(n) for n in store.names() if "linear_attn.in_proj_qkv" in n}
    assert stored == {"F8_E4M3"}, "the linear layers' projections are stored in FP8"


def test_info_shows_the_linear_layers_and_the_state_each_slot_holds(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from metrale.cli.main import app

    path = write_hybrid_checkpoint(tmp_path, "qwen3_5_moe")
    result = CliRunner().invoke(
        app, ["info", str(path), "--max-batch", "2", "--kv-cache-gb", "0.01"]
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the table may fold long values
    assert "architecture qwen3_5_moe" in text
    assert "gated GQA, 4 query / 2 kv heads of 16, 25% rotary, in 2 of 8 layers" in text
    assert "the other 6 are gated DeltaNet, 2 key / 4 value heads of 8 / 16, conv 4" in text
    spec = read_checkpoint(path).spec
    assert spec.linear is not None
    state = LinearStates.bytes_per_slot(spec.linear, 6, 17, torch.float32)
    assert f"with {state / 2**20:,.2f} MiB of linear-layer state per slot" in text
    # 2 attention layers + 1 MTP layer, keys and values of 2 heads of 16, float32
    assert f"KV bytes per token {3 * 2 * 2 * 16 * 4:,}" in text
    assert "prefix cache off: the gated DeltaNet layers keep their recurrent state" in text


def test_a_line_with_an_image_is_refused_as_text_only() -> None:
    from metrale.engine.prompts import content_text

    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {}}]
    with pytest.raises(ValueError, match="has image_url parts: metrale runs models on text only"):
        content_text(parts)


def test_the_gpus_masked_replay_commits_what_the_cpus_exact_one_does(checkpoint: Path) -> None:
    """Off the CPU nothing is read back: every slot replays, under a mask, the
    most rows any may hold. Run so on the CPU, a ragged batch of partial
    acceptances and a static forward leave the same states and logits."""
    ids = random_ids(3, 60, seed=7)
    runs = []
    for reads_back in (True, False):
        model = build_runtime(checkpoint, num_slots=3, max_len=64, headroom=8)
        _states(model).reads_back = reads_back
        model.forward([Segment(s, 0, ids[s, : 20 + s].tolist()) for s in range(3)])
        model.forward([Segment(s, 20 + s, ids[s, 20 + s : 25 + s].tolist()) for s in range(3)])
        # Accepted 0, 2 and 4 of 4 drafts; slot 2 then runs a static forward.
        out = model.forward(
            [Segment(0, 21, ids[0, 21:23].tolist()), Segment(1, 24, ids[1, 24:27].tolist())]
        )
        tokens = torch.tensor([[0] * 4, [0] * 4, ids[2, 27:31].tolist()])
        logits, _ = model.forward_static(tokens, torch.tensor([64, 64, 27]), ctx=72)
        states = _states(model)
        runs.append((out.logits, logits.view(3, 4, -1)[2], states.state.clone(), states.conv))
    for ours, theirs in zip(*runs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
