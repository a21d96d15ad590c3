"""Greedy acceptance and speculative sampling keep plain decoding's output."""

from __future__ import annotations

import pytest
import torch

from metrale.engine.api import SamplingParams
from metrale.engine.sampling import make_generator, target_probs
from metrale.engine.spec.acceptance import accept_greedy, accept_sampled

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_keeps_longest_agreeing_prefix_and_adds_model_token() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == (0, 4)
    assert accept_greedy([], [3]) == (0, 3)


def test_greedy_stops_at_first_mismatch_even_if_later_drafts_agree() -> None:
    assert accept_greedy([1, 2, 3], [1, 0, 3, 4]) == (1, 0)


def _first_token_histogram(
    p: torch.Tensor, draft: int, q: torch.Tensor | None, trials: int
) -> torch.Tensor:
    counts = torch.zeros(p.shape[-1])
    target = torch.stack([p, p])  # [2, vocab]
    q_rows = None if q is None else q[None, :]
    for seed in range(trials):
        gen = make_generator(seed)
        accepted, bonus = accept_sampled([draft], q_rows, target, gen)
        counts[draft if accepted else bonus] += 1
    return counts / trials


def test_copy_draft_leaves_first_token_distributed_as_target() -> None:
    # A copy is a one-hot draft: accepted with probability p(d), else drawn
    # from p without d. Either way the first emitted token is ~ p. With 3000
    # trials the total-variation distance of an exact sampler stays below 0.045
    # (its expectation is about 0.017 here).
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    for draft in (0, 3):  # the likeliest and the least likely token
        tv = 0.5 * float((_first_token_histogram(p, draft, None, 3000) - p).abs().sum())
        assert tv < 0.045, (draft, tv)


def test_mtp_draft_with_its_own_distribution_leaves_first_token_as_target() -> None:
    p = torch.tensor([0.1, 0.6, 0.2, 0.1])
    q = torch.tensor([0.4, 0.1, 0.1, 0.4])
    # Drafts drawn from q, as the drafter does: the emitted token must be ~ p
    # (same bound as above).
    counts = torch.zeros(4)
    target = torch.stack([p, p])
    trials = 3000
    for seed in range(trials):
        gen = make_generator(seed)
        draft = int(torch.multinomial(q, 1, generator=gen))
        accepted, bonus = accept_sampled([draft], q[None, :], target, gen)
        counts[draft if accepted else bonus] += 1
    tv = 0.5 * float((counts / trials - p).abs().sum())
    assert tv < 0.045, tv
    # The test can tell: the draft distribution itself is far from p.
    assert 0.5 * float((q - p).abs().sum()) > 0.3


def test_a_draft_outside_the_target_support_is_always_rejected() -> None:
    p = torch.tensor([0.0, 1.0, 0.0])
    for seed in range(20):
        accepted, bonus = accept_sampled([2], None, torch.stack([p, p]), make_generator(seed))
        assert (accepted, bonus) == (0, 1)


def test_all_drafts_accepted_emits_a_bonus_from_the_last_row() -> None:
    certain = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # [3, vocab 2]
    assert accept_sampled([1, 0], None, certain, make_generator(0)) == (2, 1)


def test_same_seed_same_decision() -> None:
    p = torch.softmax(torch.randn(3, 10, generator=make_generator(5)), dim=-1)
    runs = {accept_sampled([3, 4], None, p, make_generator(42)) for _ in range(5)}
    assert len(runs) == 1


def test_target_probs_applies_top_k_and_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert top_k[2] == 0 and top_k[3] == 0 and abs(float(top_k.sum()) - 1) < 1e-6
    full = torch.softmax(logits[0], dim=-1)
    # The nucleus is the smallest prefix whose mass reaches top_p.
    nucleus = target_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 0.01))[0]
    assert nucleus[0] > 0 and nucleus[1] > 0 and nucleus[2] == 0 and nucleus[3] == 0
    cold = target_probs(logits, SamplingParams(temperature=0.01))[0]
    assert float(cold[0]) > 0.999
