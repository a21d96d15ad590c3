"""The MTP drafter's confidence rule, on a scripted module."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.runtime.model import ForwardOutput, MtpLogitRows, Segment
from metrale.engine.sequence import SeqState
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter

VOCAB = 8
PEAKED = torch.tensor([8.0] + [0.0] * (VOCAB - 1))  # top probability ~0.99
FLAT = torch.zeros(VOCAB)  # top probability 1/8


class ScriptedMtp:
    """Sure at the first chain position, unsure at every later one."""

    num_slots = 4
    max_len = 64
    kv_bytes_per_token = 0

    def __init__(self) -> None:
        self.calls = 0

    def forward(
        self, segments: Sequence[Segment], hidden: torch.Tensor, logits: MtpLogitRows = "all"
    ) -> ForwardOutput:
        row = PEAKED if self.calls == 0 else FLAT
        self.calls += 1
        rows = len(segments)  # logits="last": one row a segment
        return ForwardOutput(logits=row.repeat(rows, 1), hidden=torch.zeros(hidden.shape[0], 4))


def sequence(params: SamplingParams) -> SeqState:
    generator = None if params.greedy else torch.Generator().manual_seed(0)
    request = Request("r", (1, 2, 3), params)
    seq = SeqState(request, 0, 64, frozenset(), None, generator, history=[1, 2, 3], seq_len=2)
    return seq


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # Greedy: the chain stops where the module is unsure (the second position).
        (SamplingParams(max_tokens=10), 1),
        # Sampled: only the first position is judged; a later one's distribution
        # depends on the drafts drawn before it, so judging it would bias them.
        (SamplingParams(max_tokens=10, temperature=1.0), 3),
    ],
)
def test_only_a_greedy_chain_is_cut_after_its_first_position(
    params: SamplingParams, expected: int
) -> None:
    seq = sequence(params)
    drafter = MtpDrafter(ScriptedMtp(), min_prob=0.5)
    drafter.feed_and_draft([DraftFeed(seq, 0, [2, 3], num_drafts=3)], torch.zeros(2, 4))
    assert len(seq.pending_drafts) == expected
    assert not seq.drafts_declined


def test_an_unsure_first_position_declines_the_whole_chain() -> None:
    for params in (SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0)):
        seq = sequence(params)
        module = ScriptedMtp()
        module.calls = 1  # unsure from the start
        MtpDrafter(module, min_prob=0.5).feed_and_draft(
            [DraftFeed(seq, 0, [2, 3], num_drafts=3)], torch.zeros(2, 4)
        )
        assert seq.pending_drafts == [] and seq.drafts_declined
