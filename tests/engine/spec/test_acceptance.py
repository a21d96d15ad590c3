"""One acceptance rule, greedy or sampled: drafts are kept while they equal
the tokens the verify chooses, so the output is plain decoding's."""

from __future__ import annotations

import pytest
import torch

from metrale.engine.noise import request_key, row_keys
from metrale.engine.sampling import sample_rows
from metrale.engine.spec.acceptance import accept_drafts

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_longest_prefix_equal_to_the_chosen_tokens_is_kept_with_the_next() -> None:
    assert accept_drafts([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_drafts([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_drafts([5, 6, 7], [4, 6, 7, 1]) == (0, 4)
    assert accept_drafts([], [3]) == (0, 3)


def test_acceptance_stops_at_the_first_mismatch_even_if_later_drafts_agree() -> None:
    assert accept_drafts([1, 2, 3], [1, 0, 3, 4]) == (1, 0)


def test_a_copy_is_accepted_as_often_as_the_target_gives_its_token() -> None:
    # A copy is accepted when the token drawn at its position is the copied
    # one: with probability p(d), as speculative sampling accepts a one-hot
    # draft. 3,000 seeds: the frequency is within 0.03 of p(d) (about four
    # standard deviations).
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    keys = torch.tensor([request_key(seed) for seed in range(3000)])
    chosen = sample_rows(p.expand(3000, -1), row_keys(keys, torch.full((3000,), 20)))
    for draft in (0, 3):  # the likeliest and the least likely token
        kept = sum(accept_drafts([draft], [c, 0])[0] for c in chosen.tolist())
        assert abs(kept / 3000 - float(p[draft])) < 0.03, (draft, kept)
