"""The MTP drafter's confidence rule, on a scripted module."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.runtime.model import ForwardOutput, MtpLogitRows, Segment
from metrale.engine.sampling import noise_key, sample_at, target_probs
from metrale.engine.sequence import SeqState
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter, declined

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
    request = Request("r", (1, 2, 3), params)
    return SeqState(
        request, 0, 64, frozenset(), None, noise_key(params), history=[1, 2, 3], seq_len=2
    )


@pytest.mark.parametrize(
    "params", [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0)]
)
def test_a_chain_is_cut_where_the_module_is_unsure_greedy_or_sampled(
    params: SamplingParams,
) -> None:
    # Sure at the first position, unsure at the second: a sampled draft's
    # confidence is the shaped probability of the drawn token (1/8 there).
    seq = sequence(params)
    drafter = MtpDrafter(ScriptedMtp(), min_prob=0.5)
    drafter.feed_and_draft([DraftFeed(seq, 0, [2, 3], num_drafts=3)], torch.zeros(2, 4))
    assert seq.pending_drafts == [0]
    assert not declined(seq)


def test_a_sampled_draft_is_drawn_with_the_noise_of_its_position() -> None:
    # The first draft is the token at position 3 (the feed ends at 2): the
    # token sample_at draws from the module's shaped distribution with the
    # request's key there, which the verify draws the target's token with.
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    seq = sequence(params)
    module = ScriptedMtp()
    module.calls = 1  # flat: every token is as likely, so the noise decides
    MtpDrafter(module).feed_and_draft([DraftFeed(seq, 0, [2, 3], num_drafts=1)], torch.zeros(2, 4))
    key = noise_key(params)
    assert key is not None
    flat = target_probs(FLAT[None, :], params)
    assert seq.pending_drafts == sample_at(flat, [key], [3])


def test_an_unsure_first_position_declines_the_whole_chain() -> None:
    for params in (SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0)):
        seq = sequence(params)
        module = ScriptedMtp()
        module.calls = 1  # unsure from the start
        MtpDrafter(module, min_prob=0.5).feed_and_draft(
            [DraftFeed(seq, 0, [2, 3], num_drafts=3)], torch.zeros(2, 4)
        )
        assert seq.pending_drafts == [] and declined(seq)
