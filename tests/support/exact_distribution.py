"""The three-token fake model whose every 4-token continuation's probability
is enumerable, its exact distribution, and Pearson's chi-square statistic and
bound (significance 0.001) that sampled histograms are held to against it:
shared by the sampling-parity tests of the engine and of speculation."""

from __future__ import annotations

import itertools
import math
from collections import Counter

from metrale.engine.api import SamplingParams
from metrale.engine.sampling import target_probs
from tests.support.fake_model import FakeModel

VOCAB = 3
LENGTH = 4
TRIALS = 2000
PROMPT = (0, 1, 2, 0, 1, 2, 0, 1)  # repeats itself: copies are on offer
PARAMS = SamplingParams(max_tokens=LENGTH, temperature=0.8, top_p=0.95)


def model() -> FakeModel:
    return FakeModel(vocab=VOCAB, num_slots=16, scale=1.5, seed=3)


def exact_distribution(params: SamplingParams = PARAMS) -> dict[tuple[int, ...], float]:
    rule, exact = model(), {}
    for tail in itertools.product(range(VOCAB), repeat=LENGTH):
        history, prob = list(PROMPT), 1.0
        for token in tail:
            prob *= float(target_probs(rule.next_logits(history)[None, :], params)[0, token])
            history.append(token)
        exact[tail] = prob
    return exact


def chi_square(counts: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson's statistic, pooling outcomes expected fewer than 5 times into one bin."""
    stat, pooled_obs, pooled_exp = 0.0, 0, 0.0
    for outcome, prob in exact.items():
        expected = prob * TRIALS
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + counts[outcome], pooled_exp + expected
        else:
            stat += (counts[outcome] - expected) ** 2 / expected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
    return stat


def critical_value(exact: dict[tuple[int, ...], float]) -> float:
    """The chi-square quantile at 0.999 for the bins ``chi_square`` uses."""
    bins = sum(1 for p in exact.values() if p * TRIALS >= 5)
    return critical_value_for(bins + (1 if any(p * TRIALS < 5 for p in exact.values()) else 0) - 1)


def critical_value_for(df: int) -> float:
    """The chi-square quantile at 0.999 with ``df`` degrees of freedom
    (Wilson-Hilferty)."""
    z = 3.090  # standard normal quantile at 0.999
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
