"""A seed reproduces its sample whatever the drafts, and the sample is exact.

A sampled token is a function of the request's key, its position and the
target distribution, and a draft is kept when it equals that token: so a
seeded request's output is the same with and without drafts, under either
draft policy and at any batch size, which the first tests check directly.
The distribution itself: on a three-token vocabulary the exact distribution
of every 4-token continuation is enumerable from the fake model's rule.
Thousands of seeded requests are sampled with plain decoding and with MTP
drafts from a *different* distribution plus prompt-lookup copies; both
histograms must pass a chi-square goodness-of-fit test against the exact
distribution at significance 0.001. The seeds are fixed, so the test is
deterministic; an exact sampler fails it with probability 0.001 over the
choice of seeds, and the test shows it can tell a sampler that is off by a
temperature change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

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


def seeded_outputs(
    policy: str | None, max_batch: int, mode: str = "noisy", copies: bool = True
) -> dict[str, tuple[int, ...]]:
    """Outputs by request id of 24 seeded requests (two prompts, top-k and
    top-p among them); ``policy`` None decodes without drafts."""
    clock = FakeClock()
    fake = CostedModel(vocab=8, num_slots=16, scale=1.5, seed=3, clock=clock, cost=nearly_free_rows)
    speculate = policy is not None
    config = EngineConfig(
        max_batch=max_batch,
        draft_policy=policy or "fixed",
        mtp_min_prob=0.0,
        mtp_ladder=MtpLadder(steps=((16, 3),), beyond=2),
        prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=16, miss_backoff=0)
        if speculate and copies
        else None,
    )
    mtp = [FakeMtp(fake, mode)] if speculate else []  # type: ignore[arg-type]
    engine = Engine(fake, None, config, mtp=mtp, costs=CostModel(clock))
    shapes = [
        SamplingParams(max_tokens=16, temperature=1.0),
        SamplingParams(max_tokens=16, temperature=0.7, top_k=4, top_p=0.9),
    ]
    prompts = [(0, 1, 2, 3, 0, 1, 2, 3, 0, 1), (5, 6, 7)]  # the first repeats: copies
    stream = [
        Request(f"r{i}", prompts[i % 2], replace(shapes[i % 2], seed=1000 + i)) for i in range(24)
    ]
    outputs = {r.request_id: r.output_ids for r in engine.generate(stream)}
    if speculate:
        stats = engine.stats()
        assert stats.mtp_proposed + stats.prompt_lookup.total.proposed > 0, "drafts were verified"
    return outputs


def test_a_seeded_sample_is_the_same_with_and_without_drafts() -> None:
    plain = seeded_outputs(None, max_batch=16)
    assert len(set(plain.values())) > 12, "the seeds give different samples"
    for policy in ("fixed", "auto"):
        for mode in ("noisy", "right", "wrong"):
            assert seeded_outputs(policy, 16, mode) == plain, (policy, mode)
    assert seeded_outputs("fixed", 16, copies=False) == plain


def test_a_seeded_sample_is_the_same_at_any_batch_size() -> None:
    alone = seeded_outputs(None, max_batch=1)
    assert seeded_outputs(None, max_batch=16) == alone
    assert seeded_outputs("fixed", max_batch=1) == alone
    assert seeded_outputs("auto", max_batch=5) == alone


def test_the_same_seed_gives_the_same_sampled_output() -> None:
    def once() -> list[tuple[int, ...]]:
        fake = model()
        config = EngineConfig(max_batch=4)  # the default policy: auto
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
