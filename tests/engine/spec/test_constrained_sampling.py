"""Speculation under a grammar keeps plain constrained sampling's distribution.

On a four-token vocabulary (EOS, ``a``, ``b``, ``c``) the exact distribution
of every continuation of up to 4 tokens is enumerable: at each step the fake
model's logits are masked to the tokens the grammar allows (a hand-written
automaton here, checked against the library the engine uses), then shaped by
temperature and top-p. Thousands of seeded requests are sampled with plain
constrained decoding and with speculation; both histograms must pass a
chi-square test against the exact distribution at significance 0.001.

Two grammars: ``(ab|c|b)+``, where ``b`` is forced after every ``a``, with
forced drafts, MTP drafts from a *different* distribution and prompt-lookup
copies, all cut by the grammar; and ``(a(b|c)|c)+``, with MTP drafts only,
where a drafted ``a`` or EOS after an ``a`` is forbidden. The test has power:
a temperature change fails it. And beyond the distribution, a seed's sample
is the same with drafts as without them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import pytest
import torch

from metrale.engine.api import Grammar, Request, SamplingParams
from metrale.engine.config import EngineConfig, MtpLadder
from metrale.engine.engine import Engine
from metrale.engine.sampling import target_probs
from metrale.engine.spec.cost import CostModel
from metrale.engine.stats import EngineStats
from metrale.lookup import PromptLookupConfig
from tests.support.exact_distribution import chi_square, critical_value
from tests.support.fake_model import CostedModel, FakeClock, FakeModel, FakeMtp, nearly_free_rows
from tests.support.grammar_fakes import Vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, A, B, C = 0, 1, 2, 3
VOCAB = Vocabulary(("", "a", "b", "c"))
FORCED_B = Grammar("regex", "(ab|c|b)+")
PAIRED_A = Grammar("regex", "(a(b|c)|c)+")
LENGTH = 4
TRIALS = 2000
PROMPT = (A, B, C, A, B, C, C, A, B)  # repeats itself: copies are on offer
PARAMS = SamplingParams(max_tokens=LENGTH, temperature=1.0, top_p=0.95)

Outcome = tuple[int, ...]


def allowed(grammar: Grammar, output: Outcome) -> set[int]:
    """The tokens ``grammar`` allows after ``output``. In both grammars an
    ``a`` always opens a pair, so the state is whether one waits for its
    second token, and whether anything came yet (EOS needs a sentence)."""
    waiting = bool(output) and output[-1] == A
    if grammar == FORCED_B:
        free = {A, B, C}
        return {B} if waiting else free | ({EOS} if output else set())
    return {B, C} if waiting else {A, C} | ({EOS} if output else set())


def model(clock: FakeClock | None = None) -> FakeModel:
    """The rule; on ``clock``, with verify rows nearly free beside the step."""
    if clock is None:
        return FakeModel(vocab=VOCAB.size, num_slots=16, scale=1.0, seed=3)
    return CostedModel(
        vocab=VOCAB.size,
        num_slots=16,
        scale=1.0,
        seed=3,
        clock=clock,
        cost=nearly_free_rows,
    )


def exact_distribution(grammar: Grammar, params: SamplingParams = PARAMS) -> dict[Outcome, float]:
    rule, exact = model(), {}

    def extend(output: Outcome, prob: float) -> None:
        if len(output) == LENGTH or (output and output[-1] == EOS):
            exact[output] = prob
            return
        logits = rule.next_logits([*PROMPT, *output]).clone()
        ok = allowed(grammar, output)
        mask = torch.tensor([t in ok for t in range(VOCAB.size)])
        probs = target_probs(logits.masked_fill(~mask, float("-inf"))[None, :], params)[0]
        for token in sorted(ok):
            if float(probs[token]) > 0:
                extend((*output, token), prob * float(probs[token]))

    extend((), 1.0)
    return exact


def sample(
    grammar: Grammar,
    speculate: bool,
    copies: bool = True,
    policy: str = "auto",
    mtp_on: bool = True,
) -> tuple[Counter[Outcome], EngineStats]:
    # Under auto, on a fake clock where rows are nearly free, so that the plan
    # verifies chains and copies whatever this machine's timings: on the wall
    # clock this fake's rows cost as much as its steps, and the budget rightly
    # verified no MTP draft at all.
    clock = FakeClock() if policy == "auto" else None
    fake = model(clock)
    config = EngineConfig(
        max_batch=16,
        draft_policy=policy,
        mtp_min_prob=0.0,
        mtp_ladder=MtpLadder(steps=((16, 3),), beyond=3),
        prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=16, miss_backoff=0)
        if speculate and copies
        else None,
        forced_drafts=speculate,
    )
    mtp = [FakeMtp(fake, "noisy")] if speculate and mtp_on else []
    costs = CostModel(clock) if clock is not None else None
    engine = Engine(
        fake, None, config, mtp=mtp, eos_token_ids=(EOS,), grammars=VOCAB.compiler(), costs=costs
    )
    params = [SamplingParams(**{**PARAMS.__dict__, "seed": seed}) for seed in range(TRIALS)]
    stream = (Request(str(i), PROMPT, p, grammar=grammar) for i, p in enumerate(params))
    counts = Counter(tuple(r.output_ids) for r in engine.generate(stream))
    return counts, engine.stats()


@pytest.mark.parametrize(
    ("grammar", "copies", "mtp_on"),
    [(FORCED_B, True, True), (FORCED_B, True, False), (PAIRED_A, False, True)],
)
def test_speculation_under_a_grammar_preserves_constrained_sampling(
    grammar: Grammar, copies: bool, mtp_on: bool
) -> None:
    exact = exact_distribution(grammar)
    assert abs(sum(exact.values()) - 1) < 1e-5
    bound = critical_value(exact)
    plain, _ = sample(grammar, speculate=False)
    speculative, stats = sample(grammar, speculate=True, copies=copies, mtp_on=mtp_on)
    assert sum(plain.values()) == sum(speculative.values()) == TRIALS
    assert set(plain) | set(speculative) <= set(exact)  # nothing outside the grammar
    assert chi_square(plain, exact) < bound
    assert chi_square(speculative, exact) < bound
    # The drafts were rejected often enough to matter; forced drafts never are.
    # Beside the chain (right about four times in five) the budget verifies
    # few copies (about one in five is right here): copies alone show theirs.
    if mtp_on:
        assert 0 < stats.mtp_accepted < stats.mtp_proposed
    if copies and not mtp_on:
        assert 0 < stats.prompt_lookup.total.accepted < stats.prompt_lookup.total.proposed
    if copies:
        assert stats.prompt_lookup.total.copies > 0
        assert 0 < stats.forced_accepted == stats.forced_proposed


def test_the_test_tells_a_warmer_sampler() -> None:
    exact = exact_distribution(FORCED_B)
    warmer = exact_distribution(FORCED_B, SamplingParams(max_tokens=LENGTH, temperature=1.4))
    outcomes = list(warmer)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(list(warmer.values())), TRIALS, True, generator=gen)
    assert chi_square(Counter(outcomes[i] for i in draws.tolist()), exact) > critical_value(exact)


@pytest.mark.parametrize("grammar", [FORCED_B, PAIRED_A], ids=lambda g: g.source)
def test_a_seeded_constrained_sample_is_the_same_with_and_without_drafts(
    grammar: Grammar,
) -> None:
    def outputs(speculate: bool, policy: str) -> dict[str, tuple[int, ...]]:
        clock = FakeClock() if policy == "auto" else None
        fake = model(clock)
        config = EngineConfig(
            max_batch=16,
            draft_policy=policy,
            mtp_min_prob=0.0,
            mtp_ladder=MtpLadder(steps=((16, 3),), beyond=3),
            prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=16, miss_backoff=0)
            if speculate
            else None,
            forced_drafts=speculate,
        )
        mtp = [FakeMtp(fake, "noisy")] if speculate else []
        costs = CostModel(clock) if clock is not None else None
        engine = Engine(
            fake,
            None,
            config,
            mtp=mtp,
            eos_token_ids=(EOS,),
            grammars=VOCAB.compiler(),
            costs=costs,
        )
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95)
        stream = [
            Request(str(i), PROMPT, replace(params, seed=i), grammar=grammar) for i in range(40)
        ]
        return {r.request_id: r.output_ids for r in engine.generate(stream)}

    plain = outputs(False, "fixed")
    assert len(set(plain.values())) > 20, "the seeds give different samples"
    assert outputs(True, "fixed") == plain
    assert outputs(True, "auto") == plain


@pytest.mark.parametrize("grammar", [FORCED_B, PAIRED_A], ids=lambda g: g.source)
def test_the_automaton_agrees_with_the_grammar_library(grammar: Grammar) -> None:
    for length in range(LENGTH):
        for output in itertools.product((A, B, C), repeat=length):
            if any(output[i] not in allowed(grammar, output[:i]) for i in range(length)):
                continue
            matcher = VOCAB.matcher(grammar)
            matcher.advance(list(output))
            masks, _ = matcher.row_masks([])
            assert {t for t in range(VOCAB.size) if masks.allowed(0, t)} == allowed(grammar, output)
