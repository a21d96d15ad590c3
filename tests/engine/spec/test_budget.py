"""The draft budget (``--draft-policy auto``, ``spec/budget.py``): what a
chain adds to a step and what one not valued yet is expected to, as pure
functions, and the engine on fakes whose step cost is injected on a fake
clock (no wall clock anywhere here). ``AutoPolicy``'s own methods are driven
in ``test_auto.py``; the head's schedule's pure functions are in
``test_rest.py``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model
from metrale.engine.prompts import user_prompt_ids
from metrale.engine.sequence import SeqState
from metrale.engine.spec.budget import (
    MECHANISMS,
    Candidates,
    DraftBudget,
    chain_worth,
    marginal_row_s,
)
from metrale.engine.spec.copies import BATCHED_COPY_MAX
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.plan import Plan
from metrale.lookup import PromptLookupConfig
from tests.support.engine_runs import check_figures_add_up
from tests.support.fake_model import (
    CostedModel,
    CostedMtp,
    FakeClock,
    FakeModel,
    FakeMtp,
    nearly_free_rows,
    reference_greedy,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3],
    [3, 3, 7, 0, 12, 4, 9, 2, 2, 8, 11, 6],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3, 2],
    [2, 13, 0, 7, 7, 1, 2, 13, 0, 7, 7, 1, 2, 13],
]
REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0] * 2 + [1, 2, 3, 4, 5, 6, 7, 8]
LOOKUP = PromptLookupConfig(ngram=2, min_match=3, max_drafts=8, miss_backoff=0)
COSTS: dict[str, Callable[[int], float]] = {
    # A verify row costs almost nothing beside the step (a GPU at small batch).
    "free": nearly_free_rows,
    # Every row costs as much as a whole one-row step.
    "dear": lambda rows: 0.010 * rows,
    # Somewhere between: a CPU, where a row adds a third of a step.
    "cpu": lambda rows: 0.010 + 0.003 * rows,
    # A row costs 0.94 of a token's share of a 4-row step: a sure draft
    # leaves 0.06 token for the head's share.
    "tight": lambda rows: 0.002 + 0.008 * rows,
}


# -- a chain's worth ----------------------------------------------------------


def test_a_chain_is_worth_its_gain_less_its_rows_time_over_the_best_other_choice() -> None:
    # Rows cost 3 ms each over a 10 ms step; the chain offers 0.9 then 0.7
    # more accepted drafts, a copy 0.5. Two chain drafts: 3 rows in 16 ms.
    def step_s(rows: int) -> float:
        return 0.010 + 0.003 * (rows - 1)

    chain, copy = [0.9, 1.6], [0.5]
    plan = Plan(((0, 2),), rows=3, tokens=2.6, seconds=0.016)
    rate = 2.6 / 0.016
    own = 1.6 - rate * 0.006  # its 2 rows took 6 ms of the step
    other = 0.5 - rate * 0.003  # the copy's 1 row would have taken 3
    assert chain_worth([chain, copy], (0, 2), plan, step_s) == pytest.approx(own - other)
    assert chain_worth([chain, copy], (0, 2), plan, step_s) == pytest.approx(0.6125)
    assert chain_worth([chain], (0, 2), plan, step_s) == pytest.approx(own)
    took_copy = Plan(((1, 1),), rows=2, tokens=1.5, seconds=0.013)
    assert chain_worth([chain, copy], (1, 1), took_copy, step_s) == 0.0
    assert chain_worth([chain, copy], (-1, 0), took_copy, step_s) == 0.0


def test_a_chain_not_valued_yet_is_priced_by_the_runs_first_drafts() -> None:
    # At 4 sequences, a 20 ms step (200 tokens/s) and 1.25 ms a row: a first
    # draft's row costs 0.25 token.
    costs = CostModel(FakeClock())
    for rows, seconds in ((4, 0.020), (8, 0.025)):
        costs.verify.observe(rows, seconds)
    assert 200.0 * marginal_row_s(costs.verify, 4, 4) == pytest.approx(0.25)
    budget = DraftBudget(costs)
    assert budget.predicted_value(4) == pytest.approx(0.5 - 0.25)  # the prior
    # The run's first drafts are right 9 times in 10: worth 0.9 less the row.
    for i in range(200):
        budget.rates.observe(("mtp", 0), i % 10 != 0)
    assert budget.predicted_value(4) == pytest.approx(0.9 - 0.25, abs=0.02)


def test_a_chain_is_priced_at_the_batch_to_come_not_at_a_smaller_last_plan() -> None:
    # The first sequence of a batch plans alone (one row at 10 ms, a second
    # nearly free); fifteen more complete their prompts before the next
    # step, where a row costs 1.25 ms of a 20 ms step of sixteen. Priced at
    # the lone plan's rate and row, their chains would look worth starting.
    costs = CostModel(FakeClock())
    for rows, seconds in ((1, 0.010), (2, 0.0101), (16, 0.020), (32, 0.040)):
        costs.verify.observe(rows, seconds)
    budget = DraftBudget(costs)
    unplanned = budget.predicted_value(16)
    budget.plan_sure(1, 1)  # the first sequence's step
    assert budget.predicted_value(1) > 0.45  # the lone step's row is nearly free
    assert budget.predicted_value(16) == pytest.approx(unplanned)
    assert unplanned < 0.0  # at sixteen a first draft at the prior does not pay its row
    budget.plan_sure(16, 16)  # a plan of sixteen prices sixteen
    assert budget.predicted_value(16) == pytest.approx(0.5 - budget.rate_s * budget.marginal_s)


def test_a_step_with_nothing_to_offer_moves_the_prices_as_its_plan_would() -> None:
    # ``plan_sure`` stands for a plan of candidates with neither a chain nor
    # a copy: three sequences, one with two forced drafts (5 sure rows).
    costs = CostModel(FakeClock())
    for rows, seconds in ((4, 0.020), (8, 0.025)):
        costs.verify.observe(rows, seconds)
    planned, sure = DraftBudget(costs), DraftBudget(costs)
    seqs = [
        SeqState(Request(str(i), (1, 2), SamplingParams()), i, 64, frozenset(), None, None)
        for i in range(3)
    ]
    sure_rows = [3, 1, 1]
    assert (
        planned.plan([Candidates(s, r, [], []) for s, r in zip(seqs, sure_rows, strict=True)])
        == [("none", 0)] * 3
    )
    sure.plan_sure(5, 3)
    assert sure.rate_s == pytest.approx(5 / costs.step_s(5))
    for budget in (planned, sure):
        budget.end_step(0.030, 0.020)
    assert (sure.rate_s, sure.marginal_s, sure.planned) == (
        planned.rate_s,
        planned.marginal_s,
        planned.planned,
    )
    assert sure.snapshot() == planned.snapshot()
    assert sure.snapshot().no_drafts == 3 and sure.snapshot().steps == 1


# -- the engine on costed fakes ---------------------------------------------------


def costed_engine(
    cost: str,
    mtp_mode: str | None = "mixed",
    lookup: PromptLookupConfig | None = None,
    max_batch: int = 4,
    counting: bool = False,
    head_cost: float = 0.0005,
    without: tuple[str, ...] = (),
) -> tuple[Engine, CostedModel]:
    engine, model, _ = costed_parts(cost, mtp_mode, lookup, max_batch, counting, head_cost, without)
    return engine, model


def costed_head(cost: str, head_cost: float = 0.0005) -> tuple[Engine, CostedModel, CostedMtp]:
    """A costed engine whose MTP head is always wrong, and that head."""
    engine, model, heads = costed_parts(cost, "wrong", None, 4, False, head_cost, ())
    return engine, model, heads[0]


def costed_parts(
    cost: str,
    mtp_mode: str | None,
    lookup: PromptLookupConfig | None,
    max_batch: int,
    counting: bool,
    head_cost: float,
    without: tuple[str, ...],
) -> tuple[Engine, CostedModel, list[CostedMtp]]:
    clock = FakeClock()
    model = CostedModel(num_slots=4, clock=clock, cost=COSTS[cost], counting=counting)
    mtp = [CostedMtp(model, mtp_mode, cost=head_cost)] if mtp_mode else []  # type: ignore[arg-type]
    config = EngineConfig(
        max_batch=max_batch, prompt_lookup=lookup, draft_policy="auto", budget_ablation=without
    )
    engine = Engine(model, None, config, mtp=mtp, costs=CostModel(clock))
    engine.calibrate()
    model.forwards.clear()  # the calibration's verifies and head forwards are no part of the trace
    for head in mtp:
        head.forwards.clear()
    return engine, model, mtp


def generate(
    engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int = 40
) -> list[list[int]]:
    reqs = [
        Request(str(i), tuple(p), SamplingParams(max_tokens=max_tokens))
        for i, p in enumerate(prompts)
    ]
    by_id = {r.request_id: list(r.output_ids) for r in engine.generate(reqs)}
    return [by_id[str(i)] for i in range(len(prompts))]


def late_draft_rows(model: FakeModel, prompt_len: int, skip: int = 6) -> list[int]:
    """Drafts of each verify of slot 0 after the first ``skip`` (the warm-up)
    and before the last two (where ``max_tokens`` caps the drafts)."""
    widths = [
        len(s.token_ids) for f in model.forwards for s in f if s.slot == 0 and s.start >= prompt_len
    ]
    return [w - 1 for w in widths[skip:-2]]


# -- the head's schedule in the engine ------------------------------------------


def test_where_drafts_do_not_pay_the_head_reads_no_prompt() -> None:
    read, forwards = {}, {}
    for cost in ("free", "dear"):
        engine, model, head = costed_head(cost)
        prompts = [p * 2 for p in PROMPTS]
        assert generate(engine, prompts) == [reference_greedy(model, p, 40) for p in prompts]
        read[cost] = {s.slot for segments, _ in head.forwards for s in segments if s.start == 0}
        forwards[cost] = len(head.forwards)
    # Rows nearly free: every chain drafts from its first step, prompt first.
    assert read["free"] == {0, 1, 2, 3}
    # A row as dear as a step: a chain not valued yet rests from the start,
    # holding its prompt, and as not even a draft sure to be accepted pays
    # its row, it never starts: the head reads nothing at all.
    assert read["dear"] == set() and forwards["dear"] == 0


def test_a_sequence_admitted_with_others_prices_its_chain_at_the_whole_batch() -> None:
    # A row a third of a step: at the prior's acceptance a first draft is
    # worth a little more than its row at one line, less at four. The four
    # are admitted in one prefill, one after another; priced at the lines
    # decoding so far (1, 2, 3, then 4), each chain was worth its head share,
    # and the head read all four prompts in its first forward. Priced at the
    # four, no chain is worth it: the head reads no prompt.
    engine, model, head = costed_head("cpu")
    prompts = [p * 2 for p in PROMPTS]
    assert generate(engine, prompts) == [reference_greedy(model, p, 40) for p in prompts]
    assert not [s for segments, _ in head.forwards for s in segments if s.start == 0]


# -- the budget in the engine ----------------------------------------------------


def test_a_source_never_accepted_gets_no_rows_after_warm_up() -> None:
    engine, model = costed_engine("cpu", mtp_mode="wrong")
    generate(engine, [PROMPTS[1]], max_tokens=40)
    late = late_draft_rows(model, len(PROMPTS[1]))
    assert late and set(late) == {0}
    assert engine.stats().mtp_accepted == 0


def test_a_source_always_accepted_grows_to_its_cap() -> None:
    engine, model = costed_engine("cpu", mtp_mode="right")
    generate(engine, [PROMPTS[1]], max_tokens=40)
    late = late_draft_rows(model, len(PROMPTS[1]))
    assert late and set(late) == {3}  # the ladder's longest chain


def test_an_always_accepted_copy_grows_to_the_copy_caps_alone_and_in_a_batch() -> None:
    engine, model = costed_engine("cpu", None, LOOKUP, counting=True)
    generate(engine, [REPEATING], max_tokens=60)
    assert max(late_draft_rows(model, len(REPEATING))) == LOOKUP.max_drafts
    engine, model = costed_engine("free", None, LOOKUP, counting=True)
    generate(engine, [REPEATING, REPEATING[1:]], max_tokens=60)
    verifies = [f for f in model.forwards if len(f) == 2 and min(s.start for s in f) >= 39]
    widths = {len(s.token_ids) for f in verifies for s in f}
    assert max(widths) == 1 + BATCHED_COPY_MAX


def test_the_budget_grows_when_rows_are_nearly_free_and_shrinks_when_they_are_dear() -> None:
    mean_drafts = {}
    for cost in ("free", "dear"):
        engine, model = costed_engine(cost, mtp_mode="mixed")
        generate(engine, PROMPTS[:2], max_tokens=40)
        late = late_draft_rows(model, min(len(p) for p in PROMPTS[:2]))
        mean_drafts[cost] = sum(late) / len(late)
    assert mean_drafts["free"] > 2.0  # nearly the whole chain of 3
    # A draft pays a whole step's cost only when it is all but sure: the
    # module's most confident drafts, now and then.
    assert mean_drafts["dear"] < 0.25


def test_the_figures_add_up_under_the_budget() -> None:
    # A head that is always right, at CPU-like costs.
    engine, _ = costed_engine("cpu", mtp_mode="right", lookup=LOOKUP)
    reqs = [Request(str(i), tuple(p), SamplingParams(max_tokens=40)) for i, p in enumerate(PROMPTS)]
    check_figures_add_up(engine, list(engine.generate(reqs)))


def test_the_cost_model_predicts_the_steps_it_measures() -> None:
    engine, _ = costed_engine("cpu", mtp_mode="right", lookup=LOOKUP)
    generate(engine, PROMPTS, max_tokens=40)
    budget = engine.stats().budget
    assert budget is not None and budget.steps > 10
    assert budget.predicted_ms == pytest.approx(budget.measured_ms, rel=0.1)
    assert budget.verify_ms[1] == pytest.approx(13.0, rel=0.01)  # 10 ms + 3 ms a row
    assert sum(budget.chosen["mtp"].values()) > 0 and budget.no_drafts > 0
    assert 0 < budget.mtp_acceptance[0] < 1


@pytest.mark.parametrize("every_s", [0.0, float("inf")])
def test_the_budget_figures_are_published_at_most_so_often_and_whole_at_the_end(
    every_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("metrale.engine.spec.auto.PUBLISH_EVERY_S", every_s)
    engine, _ = costed_engine("cpu", mtp_mode="right", lookup=LOOKUP)
    reqs = [Request(str(i), tuple(p), SamplingParams(max_tokens=40)) for i, p in enumerate(PROMPTS)]
    during = []
    for _ in engine.steps(reqs):
        budget = engine.stats().budget
        assert budget is not None
        during.append(budget.steps)
    final = engine.stats().budget
    assert final is not None and final.steps == engine.stats().verifies > 10
    if every_s == 0.0:  # every step: the figures count up to the end
        assert during == sorted(during) and during[-1] == final.steps
    else:  # never while running: the first step's figures, then the end's
        assert len(set(during)) == 1 and during[0] < final.steps


@pytest.mark.parametrize("cost", list(COSTS))
@pytest.mark.parametrize("mtp_mode", ["right", "mixed", "wrong"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_output_is_identical_under_auto_fixed_and_off(
    cost: str, mtp_mode: str, batch: int
) -> None:
    engine, _ = costed_engine(cost, mtp_mode, LOOKUP, max_batch=batch)
    auto = generate(engine, PROMPTS)
    model = FakeModel(num_slots=4)
    config = EngineConfig(max_batch=batch, prompt_lookup=LOOKUP, draft_policy="fixed")
    mtp = [FakeMtp(model, mtp_mode)]  # type: ignore[arg-type]
    fixed = generate(Engine(model, None, config, mtp=mtp), PROMPTS)
    off = [reference_greedy(FakeModel(), p, 40) for p in PROMPTS]
    assert auto == fixed == off


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_the_budget_with_any_mechanism_turned_off_writes_the_same_greedy_output(
    mechanism: str,
) -> None:
    engine, _ = costed_engine("cpu", "mixed", LOOKUP, max_batch=4, without=(mechanism,))
    off = [reference_greedy(FakeModel(), p, 40) for p in PROMPTS]
    assert generate(engine, PROMPTS) == off


def test_an_unknown_mechanism_to_turn_off_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="budget_ablation: unknown mechanisms \\['chains'\\]"):
        costed_engine("cpu", without=("chains",))


@pytest.mark.slow
def test_the_default_model_writes_the_same_greedy_output_under_auto_fixed_and_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("METRALE_HOME", str(tmp_path))  # a calibration of its own
    loaded = load_model(None, RuntimeConfig(device="cpu", num_slots=4, max_len=512))
    lines = Path("sample_prompts/code_edits.jsonl").read_text().splitlines()[:2]
    texts = [json.loads(line)["messages"][0]["content"] for line in lines]
    texts += ["Repeat after me: one two three, one two three, one two three.", "Hi"]
    prompts = [user_prompt_ids(loaded.tokenizer, t) for t in texts]
    seen = {}
    for name, config in {
        "off": EngineConfig(max_batch=4, mtp=False, prompt_lookup=None),
        "fixed": EngineConfig(max_batch=4, draft_policy="fixed"),
        "auto": EngineConfig(max_batch=4, draft_policy="auto"),
        "auto alone": EngineConfig(max_batch=1, draft_policy="auto"),
    }.items():
        engine = Engine.from_loaded(loaded, config)
        seen[name] = generate(engine, prompts, max_tokens=48)
    assert seen["auto"] == seen["fixed"] == seen["off"] == seen["auto alone"]
    assert list((tmp_path / "calibration").glob("*.json")), "the calibration is cached"
