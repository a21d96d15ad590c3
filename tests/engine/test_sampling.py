"""The keyed draw is an exact draw from the target, a function of key,
position and distribution alone."""

from __future__ import annotations

import pytest
import torch

from metrale.engine.api import SamplingParams
from metrale.engine.noise import row_keys
from metrale.engine.sampling import (
    BLOCK,
    noise_key,
    sample_at,
    sample_rows,
    target_probs,
)
from tests.support.exact_distribution import critical_value_for

pytestmark = pytest.mark.usefixtures("one_thread")

DRAWS = 20_000


def keys_at(key: int, first: int, count: int) -> torch.Tensor:  # [count] row keys
    """The row keys of ``count`` consecutive positions of one request."""
    return row_keys(torch.full((count,), key), torch.arange(first, first + count))


def consecutive(probs: torch.Tensor, key: int, first: int) -> list[int]:
    """One request's rows drawn at consecutive positions from ``first``."""
    rows = probs.shape[0]
    return sample_at(probs, [key] * rows, range(first, first + rows))


def spread_distribution(vocab: int) -> torch.Tensor:  # [vocab]
    """Mass in every block, with zeros (a nucleus cut), a few large tokens
    and a long tail, over a vocabulary that ends in a partial block."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(vocab, generator=gen) ** 6
    p[torch.rand(vocab, generator=gen) < 0.3] = 0.0
    p[[3, BLOCK + 7, 2 * BLOCK + 1]] = torch.tensor([4.0, 2.0, 1.0])
    return p / p.sum()


def test_sample_rows_draws_exactly_from_the_distribution() -> None:
    # 20,000 rows, each its own key (a request at a position), against the
    # distribution: Pearson's chi-square at significance 0.001, pooling
    # tokens expected fewer than 5 times.
    vocab = 2 * BLOCK + 100
    p = spread_distribution(vocab)
    drawn = sample_rows(p.expand(DRAWS, -1), keys_at(noise_key_of(1), 0, DRAWS))
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert float(counts[p == 0].sum()) == 0, "a token of probability 0 was drawn"
    expected = p.double() * DRAWS
    big = expected >= 5
    stat = float((((counts - expected) ** 2 / expected)[big]).sum())
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    stat += (rest_obs - rest_exp) ** 2 / rest_exp
    bound = critical_value_for(int(big.sum()))  # the bins and the pooled one, less one
    assert stat < bound, (stat, bound)
    # The test has power: the same draws judged against a slightly warmer
    # distribution fail it.
    warmer = p**0.9 / (p**0.9).sum()
    expected = warmer.double() * DRAWS
    assert float((((counts - expected) ** 2 / expected)[big]).sum()) > bound


def noise_key_of(seed: int) -> int:
    key = noise_key(SamplingParams(temperature=1.0, seed=seed))
    assert key is not None
    return key


def test_a_token_depends_on_key_position_and_distribution_alone() -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(6, 1000, generator=gen), dim=-1)  # [6, V]
    key = noise_key_of(4)
    together = consecutive(probs, key, 10)  # positions 10..15 in one batch
    alone = [consecutive(probs[i : i + 1], key, 10 + i)[0] for i in range(6)]
    assert together == alone
    # A scale of the row changes nothing: the draw reads a distribution.
    assert consecutive(probs * 3.0, key, 10) == together
    # Another key or another position draws afresh.
    flat = torch.full((64, 1000), 1e-3)
    assert consecutive(flat, key, 0) != consecutive(flat, noise_key_of(5), 0)
    assert consecutive(flat, key, 0) != consecutive(flat, key, 1)


def test_distributions_that_agree_draw_the_same_token_mostly() -> None:
    # Why a sampled MTP draft is accepted: drawn from q with the key the
    # verify draws p with, it is p's token wherever q is close to p.
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(DRAWS // 10, 600, generator=gen) * 2.5  # [N, V]
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(logits + 0.3 * torch.randn(logits.shape, generator=gen), dim=-1)
    keys = keys_at(noise_key_of(6), 0, p.shape[0])
    agree = float((sample_rows(p, keys) == sample_rows(q, keys)).double().mean())
    overlap = float(torch.minimum(p, q).sum(dim=-1).mean())  # 1 - TV
    assert agree > 0.75 * overlap, (agree, overlap)
    independent = float((sample_rows(p, keys) == sample_rows(q, keys.flip(0))).double().mean())
    assert agree > 3 * independent


def test_one_hot_rows_return_their_token_and_an_empty_row_token_0() -> None:
    probs = torch.zeros(3, 3 * BLOCK)
    probs[0, 2 * BLOCK + 5] = 1.0
    probs[1, 17] = 0.25
    keys = keys_at(noise_key_of(7), 0, 3)
    assert sample_rows(probs, keys).tolist() == [2 * BLOCK + 5, 17, 0]


def test_noise_keys_follow_the_seed_and_the_stream() -> None:
    assert noise_key(SamplingParams()) is None, "greedy draws nothing"
    seeded = SamplingParams(temperature=0.7, seed=3)
    assert noise_key(seeded) == noise_key(seeded)
    assert noise_key(seeded) != noise_key(seeded, stream=1)
    unseeded = SamplingParams(temperature=0.7)
    assert noise_key(unseeded) != noise_key(unseeded)


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
