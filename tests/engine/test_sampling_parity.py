"""Speculation preserves the sampled distribution (and seeds reproduce samples).

On a three-token vocabulary the exact distribution of every 4-token
continuation is enumerable from the fake model's rule. Thousands of seeded
requests are sampled with plain decoding and with MTP drafts from a *different*
distribution plus prompt-lookup copies; both histograms must pass a chi-square
goodness-of-fit test against the exact distribution at significance 0.001.
The seeds are fixed, so the test is deterministic; an exact sampler fails it
with probability 0.001 over the choice of seeds, and the test shows it can
tell a sampler that is off by a temperature change.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, MtpLadder
from metrale.engine.engine import Engine
from metrale.engine.spec.cost import CostModel
from metrale.engine.stats import EngineStats
from metrale.lookup import PromptLookupConfig
from tests.support.exact_distribution import (
    LENGTH,
    PARAMS,
    PROMPT,
    TRIALS,
    VOCAB,
    chi_square,
    critical_value,
    exact_distribution,
    model,
)
from tests.support.fake_model import CostedModel, FakeClock, FakeMtp, nearly_free_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def sample(
    speculate: bool,
    mtp_min_prob: float = 0.0,
    draft_vocab: tuple[int, ...] | None = None,
    policy: str = "auto",
) -> tuple[Counter[tuple[int, ...]], EngineStats]:
    # On a fake clock where rows are nearly free, so that the budget verifies
    # chains whatever this machine's timings: on the wall clock this fake's
    # rows cost as much as its steps, and the budget rightly verified no MTP
    # draft at all.
    clock = FakeClock()
    fake = CostedModel(
        vocab=VOCAB, num_slots=16, scale=1.5, seed=3, clock=clock, cost=nearly_free_rows
    )
    config = EngineConfig(
        max_batch=16,
        draft_policy=policy,
        mtp_min_prob=mtp_min_prob,
        mtp_ladder=MtpLadder(steps=((16, 2),), beyond=2),
        prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=16, miss_backoff=0)
        if speculate
        else None,
    )
    mtp = [FakeMtp(fake, "noisy", draft_vocab=draft_vocab)] if speculate else []
    engine = Engine(fake, None, config, mtp=mtp, costs=CostModel(clock))
    params = [SamplingParams(**{**PARAMS.__dict__, "seed": seed}) for seed in range(TRIALS)]
    stream = (Request(str(i), PROMPT, p) for i, p in enumerate(params))
    counts = Counter(tuple(r.output_ids) for r in engine.generate(stream))
    return counts, engine.stats()


@pytest.mark.parametrize(("mtp_min_prob", "draft_vocab"), [(0.0, None), (0.6, None), (0.0, (0, 2))])
def test_speculation_preserves_the_sampled_distribution(
    mtp_min_prob: float, draft_vocab: tuple[int, ...] | None
) -> None:
    # At 0.6 the drafter holds back the chains whose distribution is flat
    # (three tokens: a peak of 1/3 to 1), a choice made before any draw. With
    # a draft vocabulary, token 1 is never drafted: the drafts' distribution
    # is zero there, and the verify must still give it its full probability.
    exact = exact_distribution()
    assert abs(sum(exact.values()) - 1) < 1e-5
    bound = critical_value(exact)
    plain, _ = sample(speculate=False)
    assert sum(plain.values()) == TRIALS
    assert chi_square(plain, exact) < bound
    for policy in ("auto", "fixed"):
        speculative, stats = sample(True, mtp_min_prob, draft_vocab, policy)
        assert sum(speculative.values()) == TRIALS
        assert chi_square(speculative, exact) < bound
        # The chains were used, and were rejected often enough to matter.
        assert 0 < stats.mtp_accepted < stats.mtp_proposed
        if policy == "fixed":
            # Copies too: the fixed rule takes one wherever it beats the
            # chain's length, where the budget, which learns a sampled
            # source only from the drafts it verifies, kept to the chain.
            lookup = stats.prompt_lookup.total
            assert 0 < lookup.accepted < lookup.proposed
    # The test has power: samples drawn exactly from the same model at
    # temperature 1.0 instead of 0.8 fail it.
    warmer = exact_distribution(SamplingParams(max_tokens=LENGTH, temperature=1.0, top_p=0.95))
    outcomes = list(warmer)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(list(warmer.values())), TRIALS, True, generator=gen)
    assert chi_square(Counter(outcomes[i] for i in draws.tolist()), exact) > bound


def test_the_same_seed_gives_the_same_sampled_output() -> None:
    def once() -> list[tuple[int, ...]]:
        fake = model()
        # A seed gives the same sample under the fixed policy; under the
        # budget the drafts verified follow timings, and with them the draws.
        config = EngineConfig(max_batch=4, draft_policy="fixed")
        engine = Engine(fake, None, config, mtp=[FakeMtp(fake, "noisy")])
        stream = [
            Request(str(i), PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
            for i in range(6)
        ]
        results = sorted(engine.generate(stream), key=lambda r: int(r.request_id))
        return [r.output_ids for r in results]

    first = once()
    assert once() == first
    assert len(set(first)) > 1  # different seeds, different samples
    torch.manual_seed(0)  # the global generator plays no part
    assert once() == first
