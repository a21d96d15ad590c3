"""Several MTP modules drafting in order, on the fake model.

``FakeMtp`` records what each row of each slot was last fed, so a module's
cache can be read back: module ``k`` at row ``p`` must hold module ``k-1``'s
output there (the context up to token ``p+k``) and token ``p+1+k``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, MtpLadder
from metrale.engine.engine import Engine
from metrale.engine.stats import EngineStats
from metrale.lookup import PromptLookupConfig
from tests.support.engine_runs import LOOKUP
from tests.support.engine_runs import PROMPTS as ENGINE_PROMPTS
from tests.support.exact_distribution import (
    PARAMS,
    PROMPT,
    TRIALS,
    chi_square,
    critical_value,
    exact_distribution,
)
from tests.support.exact_distribution import model as parity_model
from tests.support.fake_model import FakeModel, FakeMtp, MtpMode, reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

# Mixed lengths (one token, one shorter than the stack), some repeating
# themselves so that copies are accepted and feeds of several rows follow.
PROMPTS = [ENGINE_PROMPTS[i] for i in (0, 1, 4, 2, 7)]


def run(
    num_modules: int,
    mode: MtpMode,
    lookup: PromptLookupConfig | None = LOOKUP,
    max_tokens: int = 30,
    prefill_chunk: int = 512,
) -> tuple[dict[str, list[int]], EngineStats, FakeModel, list[FakeMtp]]:
    model = FakeModel(num_slots=8)
    modules = [FakeMtp(model, mode) for _ in range(num_modules)]
    # The fixed ladder: these tests check the stack's trace at every depth.
    config = EngineConfig(
        mtp_min_prob=0.0,
        prompt_lookup=lookup,
        prefill_chunk=prefill_chunk,
        draft_policy="fixed",
    )
    engine = Engine(model, None, config, mtp=modules, eos_token_ids=(0,))
    params = SamplingParams(max_tokens=max_tokens)
    results = engine.generate(Request(str(i), tuple(p), params) for i, p in enumerate(PROMPTS))
    outputs = {r.request_id: list(r.output_ids) for r in results}
    return outputs, engine.stats(), model, modules


@pytest.mark.parametrize("num_modules", [2, 3])
@pytest.mark.parametrize("mode", ["right", "mixed", "wrong"])
def test_greedy_output_is_plain_decoding_with_stacked_modules(
    num_modules: int, mode: MtpMode
) -> None:
    outputs, stats, _, _ = run(num_modules, mode)
    for rid, output in outputs.items():
        assert output == reference_greedy(FakeModel(), PROMPTS[int(rid)], 30, eos=(0,))
    # One draft per module at most (the ladder asks for 3 here), every depth used.
    assert len(stats.mtp_proposed_by_position) == min(num_modules, 3)
    assert all(n > 0 for n in stats.mtp_proposed_by_position)
    if mode == "right":
        assert stats.mtp_accepted == stats.mtp_proposed
    if mode == "wrong":
        assert stats.mtp_accepted == 0


@pytest.mark.parametrize("prefill_chunk", [512, 3])
def test_each_module_holds_exactly_its_final_rows_fed_from_the_module_before(
    prefill_chunk: int,
) -> None:
    outputs, _, model, modules = run(3, "mixed", prefill_chunk=prefill_chunk)
    first_rows = {s.slot: s for f in model.forwards for s in f if s.start == 0}
    assert len(first_rows) == len(PROMPTS)  # a slot each: no slot was reused
    for slot, seg in first_rows.items():
        rid = str(
            next(i for i, p in enumerate(PROMPTS) if p[: len(seg.token_ids)] == seg.token_ids)
        )
        history = PROMPTS[int(rid)] + outputs[rid]
        # The last feed came after the verify that started here: rows below
        # it are final in module 0, one fewer in each module after.
        last_start = max(s.start for f in model.forwards for s in f if s.slot == slot)
        for depth, module in enumerate(modules):
            for row in range(last_start - depth):
                context, token = module.fed[(slot, row)]
                assert context == tuple(history[max(0, row + depth - 1) : row + depth + 1])
                assert token == history[row + 1 + depth]


def test_a_verify_of_several_rows_feeds_every_module_those_rows() -> None:
    _, stats, _, modules = run(2, "right", max_tokens=20)
    assert stats.mean_tokens_per_verify > 2.0  # drafts and copies accepted together
    widths = {len(s.token_ids) for segments, _ in modules[1].forwards[1:] for s in segments}
    assert max(widths) > 2  # several final rows and the draft row in one forward


def sample_with(modules: int) -> tuple[Counter[tuple[int, ...]], EngineStats]:
    fake = parity_model()
    config = EngineConfig(
        max_batch=16,
        mtp_min_prob=0.0,
        draft_policy="fixed",
        mtp_ladder=MtpLadder(steps=((16, 3),), beyond=3),
        prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=16, miss_backoff=0),
    )
    mtp: Sequence[FakeMtp] = [FakeMtp(fake, "noisy") for _ in range(modules)]
    engine = Engine(fake, None, config, mtp=mtp)
    params = [SamplingParams(**{**PARAMS.__dict__, "seed": seed}) for seed in range(TRIALS)]
    stream = (Request(str(i), PROMPT, p) for i, p in enumerate(params))
    return Counter(tuple(r.output_ids) for r in engine.generate(stream)), engine.stats()


def test_stacked_modules_preserve_the_sampled_distribution() -> None:
    exact = exact_distribution()
    counts, stats = sample_with(2)
    assert sum(counts.values()) == TRIALS
    assert chi_square(counts, exact) < critical_value(exact)
    proposed, accepted = stats.mtp_proposed_by_position, stats.mtp_accepted_by_position
    assert len(proposed) == 2 and 0 < accepted[1] < proposed[1]
