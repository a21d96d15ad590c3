"""The draft budget (``--draft-policy auto``): the plan against a brute force,
the cost model and its cache, and the engine on fakes whose step cost is
injected on a fake clock (no wall clock anywhere here)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

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
)
from metrale.engine.spec.copies import BATCHED_COPY_MAX
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.plan import Plan
from metrale.engine.spec.rest import ChainRest
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


# -- the cost model -------------------------------------------------------------


def test_the_chain_is_worth_its_gain_less_its_rows_time_over_the_best_other_choice() -> None:
    # Rows cost 3 ms each over a 10 ms step; the chain offers 0.9 then 0.7
    # more accepted drafts, a copy 0.5. Two chain drafts: 3 rows in 16 ms.
    costs = CostModel(FakeClock())
    for rows in range(1, 5):
        costs.verify.observe(rows, 0.010 + 0.003 * (rows - 1))
    budget = DraftBudget(costs)
    chain, copy = [0.9, 1.6], [0.5]
    plan = Plan(((0, 2),), rows=3, tokens=2.6, seconds=0.016)
    rate = 2.6 / 0.016
    own = 1.6 - rate * 0.006  # its 2 rows took 6 ms of the step
    other = 0.5 - rate * 0.003  # the copy's 1 row would have taken 3
    assert budget._chain_worth([chain, copy], (0, 2), plan) == pytest.approx(own - other)
    assert budget._chain_worth([chain], (0, 2), plan) == pytest.approx(own)
    took_copy = Plan(((1, 1),), rows=2, tokens=1.5, seconds=0.013)
    assert budget._chain_worth([chain, copy], (1, 1), took_copy) == 0.0


def test_the_head_forward_runs_the_chains_worth_it_together() -> None:
    costs = CostModel(FakeClock())
    costs.verify.observe(16, 0.160)  # 16 tokens in 160 ms: 100 tokens/s
    costs.head.observe(1, 0.001)  # a ms of head forward costs 0.1 token
    costs.head.observe(16, 0.004)  # 4 lines: 1.6 ms, interpolated
    budget = DraftBudget(costs)
    rest = ChainRest(budget)
    lines = [a_line(slot=i) for i in range(16)]

    def running(values: Sequence[float | None]) -> list[int]:
        budget.plan([Candidates(seq, 1, [], []) for seq in lines])
        assert budget.rate_s == pytest.approx(100.0)
        for seq, value in zip(lines, values, strict=True):
            budget.for_seq(seq).chain_value = value
            rest.for_seq(seq).since_chain = 0  # no look is due
        rest.share_head(lines, 16)
        return [seq.slot for seq in lines if rest.wants_chain(seq, 16)]

    # 0.05 token a step each: alone, none pays its 0.1; all 16 together (0.8)
    # pay their 0.4.
    assert running([0.05] * 16) == list(range(16))
    assert running([0.05] + [0.0] * 15) == []
    # Four lines at 0.2 pay a forward of 4 (0.16); a line at 0.01 adds less
    # than the 0.02 its feed adds to the forward.
    assert running([0.2] * 4 + [0.01] * 12) == [0, 1, 2, 3]
    # Chains never valued are priced by their first drafts (the prior's 0.5
    # less a row of 10 ms, 1 token): none is worth running.
    assert running([None] * 16) == []
    # A line the choice did not price (its prompt just completed) joins where
    # its value pays what its feed adds: 0.02 token beside four chains, ...
    newcomer = a_line(slot=16)
    budget.for_seq(newcomer).chain_value = 0.03
    running([0.2] * 4 + [0.01] * 12)
    assert rest.wants_chain(newcomer, 16)
    budget.for_seq(newcomer).chain_value = 0.015
    assert not rest.wants_chain(newcomer, 16)
    # ... or a forward of its own (0.1 token) where none was chosen, also
    # after a choice among no lines at all.
    rest.share_head([], 16)
    budget.for_seq(newcomer).chain_value = 0.09
    assert not rest.wants_chain(newcomer, 16)
    budget.for_seq(newcomer).chain_value = 0.11
    assert rest.wants_chain(newcomer, 16)
    # Where a step whose chains ran has lately taken three head forwards
    # (chains two drafts deeper), the 16 chains at 0.05 no longer pay 1.2.
    for _ in range(40):
        rest.head_ran(3)
    assert rest.forwards == pytest.approx(3.0, abs=0.01)
    assert running([0.05] * 16) == []
    assert running([0.2] * 16) == list(range(16))
    # A line ahead in a drain rests whatever its chain is worth.
    budget.for_seq(lines[0]).chain_value = 10.0
    assert not rest.wants_chain(lines[0], 16, ahead=True)


def test_a_chain_not_valued_yet_is_priced_by_its_first_drafts_confidence() -> None:
    # At 4 sequences a first draft's row costs 0.25 token (four_sequence_costs).
    _, budget = four_sequence_costs()
    seq = a_line()
    budget.plan([Candidates(seq, 1, [], [])] * 4)
    assert budget.predicted_value(seq, 4) == pytest.approx(0.5 - 0.25)  # the prior
    # Half the run's first drafts fall in a bin right 9 times in 10, half in
    # one never right: the plan verifies only the first, worth 0.9 - 0.25.
    for i in range(200):
        budget.rates.observe(("mtp", 0, 5), i % 10 != 0)
        budget.rates.observe(("mtp", 0, 0), False)
    expected = 0.5 * (budget.for_seq(seq).rates.rate(("mtp", 0, 5)) - 0.25)
    assert budget.predicted_value(seq, 4) == pytest.approx(expected)
    assert budget.predicted_value(seq, 4) == pytest.approx(0.5 * (0.9 - 0.25), abs=0.02)


def test_the_heads_forwards_are_kept_out_of_the_rest_of_the_step() -> None:
    # The rest of a step prices every row: counted there, the head's forwards
    # lowered the rate rows and chains are priced at (end_step's doc).
    costs, budget = four_sequence_costs()
    budget.plan([Candidates(a_line(slot=n), 1, [], []) for n in range(4)])
    # A 30 ms step: 20 ms its verify, 6 ms the head's forwards after it.
    budget.end_step(0.030, 0.020, 0.006)
    assert costs.other_s == pytest.approx(0.004)
    assert budget.snapshot().measured_ms == pytest.approx(24.0)
    # A step without a plan (nothing verified under the budget) counts nothing.
    budget.end_step(0.100, 0.050, 0.0)
    assert costs.other_s == pytest.approx(0.004)
    assert budget.snapshot().steps == 1


def a_line(max_tokens: int = 64, slot: int = 0) -> SeqState:
    request = Request(str(slot), (1, 2, 3), SamplingParams(max_tokens=max_tokens))
    return SeqState(request, slot, 128, frozenset(), None, None)


def test_a_copy_is_priced_by_how_long_its_source_agreed() -> None:
    # Copies whose source agreed on 2 tokens are always wrong, those that
    # agreed on 16 always right, both of the same line: each agreement's own
    # estimate learns it, and the plan verifies only the one that agreed long.
    costs = CostModel(FakeClock())
    for rows in range(1, 6):
        costs.verify.observe(rows, 0.010 + 0.002 * (rows - 1))
    budget = DraftBudget(costs)
    seq = a_line()
    for _ in range(30):
        budget.observe(seq, [7, 7, 7, 7, 7], [], [1, 2, 3, 4], agreement=2)
        budget.observe(seq, [1, 2, 3, 4, 7], [], [1, 2, 3, 4], agreement=16)
    own = budget.for_seq(seq)
    assert own.copy_gains(4, 2)[-1] < 0.2
    assert own.copy_gains(4, 16)[-1] > 3.5
    copy = [1, 2, 3, 4]
    assert budget.plan([Candidates(seq, 1, [], copy, agreement=2)]) == [("none", 0)]
    assert budget.plan([Candidates(seq, 1, [], copy, agreement=16)]) == [("copy", 4)]


def test_resting_chains_look_in_the_same_step() -> None:
    costs = CostModel(FakeClock())
    costs.head.observe(1, 0.001)
    budget = DraftBudget(costs)
    rest = ChainRest(budget)
    seqs = [
        SeqState(
            Request(str(i), (1, 2, 3), SamplingParams(max_tokens=64)),
            i,
            128,
            frozenset(),
            None,
            None,
        )
        for i in range(2)
    ]
    looks: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 41):
        budget.plan([Candidates(seq, 1, [], []) for seq in seqs])
        budget.rate_s = 100.0  # a head forward of 1 ms costs 0.1 token
        for seq in seqs:
            # Slot 0's chain stops paying at step 1, slot 1's at step 6.
            budget.for_seq(seq).chain_value = 1.0 if step < 1 + 5 * seq.slot else 0.0
            if rest.wants_chain(seq, 2) and budget.for_seq(seq).chain_value == 0.0:
                looks[seq.slot].append(step)
    # Stopped five steps apart, they look on one step (one head forward) from
    # their second look on, and each looks half as often as before.
    assert looks[0] == [8, 16, 32]
    assert looks[1] == [16, 32]


def test_looks_that_feed_the_head_more_than_a_forward_go_one_a_step() -> None:
    costs = CostModel(FakeClock())
    costs.head.observe(1, 0.001)
    costs.head.observe(4, 0.002)
    costs.verify.observe(4, 0.010)
    costs.verify.observe(8, 0.012)
    costs.observe_held(100, 1, 1, 0.006)  # a held row: 0.05 ms, 20 of them a forward
    budget = DraftBudget(costs)
    rest = ChainRest(budget)

    def line(slot: int, held: int) -> SeqState:
        seq = SeqState(
            Request(str(slot), (1, 2, 3), SamplingParams(max_tokens=500)),
            slot,
            1024,
            frozenset(),
            None,
            None,
        )
        budget.for_seq(seq).chain_value = 0.0  # valued, and not worth its share
        rest.hold(seq, 3, [5] * held, torch.zeros(held, 4))
        return seq

    # Two lines hold a prompt of 100 rows (5 ms to feed), two hold 10 (0.5 ms).
    seqs = [line(0, 100), line(1, 100), line(2, 10), line(3, 10)]
    looks: dict[int, list[int]] = {seq.slot: [] for seq in seqs}
    for step in range(1, 25):
        budget.plan([Candidates(seq, 1, [], []) for seq in seqs])
        for seq in seqs:
            if rest.wants_chain(seq, 4):
                looks[seq.slot].append(step)
                rest.release(seq, 0, [], torch.zeros(0, 4))
            else:
                rest.hold(seq, 0, [5], torch.zeros(1, 4))
    # The light lines look together on steps 8 and 16. Of the heavy ones,
    # one looks on step 8 and the other waits for the next look step, 16
    # (by then the first holds 8 rows, and looks with the light ones).
    assert looks[2] == looks[3] == [8, 16]
    assert looks[0] == [8, 16] and looks[1] == [16]


def test_where_drafts_do_not_pay_the_head_reads_no_prompt() -> None:
    read, forwards = {}, {}
    for cost in ("free", "dear"):
        engine, model = costed_engine(cost, mtp_mode="wrong")
        prompts = [p * 2 for p in PROMPTS]
        assert generate(engine, prompts) == [reference_greedy(model, p, 40) for p in prompts]
        assert engine._drafter is not None
        head = engine._drafter.modules[0]
        assert isinstance(head, CostedMtp)
        read[cost] = {s.slot for segments, _ in head.forwards for s in segments if s.start == 0}
        forwards[cost] = len(head.forwards)
    # Rows nearly free: every chain drafts from its first step, prompt first.
    assert read["free"] == {0, 1, 2, 3}
    # A row as dear as a step: a chain not valued yet rests from the start,
    # holding its prompt, and as not even a draft sure to be accepted pays
    # its row, no look or scout is made: the head reads nothing at all.
    assert read["dear"] == set() and forwards["dear"] == 0


def test_a_line_admitted_with_others_prices_its_chain_at_the_whole_batch() -> None:
    # A row a third of a step: at the prior's acceptance a first draft is
    # worth a little more than its row at one line, less at four. The four
    # are admitted in one prefill, one after another; priced at the lines
    # decoding so far (1, 2, 3, then 4), each chain was worth its head share,
    # and the head read all four prompts in its first forward. Priced at the
    # four, only the run's scout reads one; later scouts read one each.
    engine, model = costed_engine("cpu", mtp_mode="wrong")
    prompts = [p * 2 for p in PROMPTS]
    assert generate(engine, prompts) == [reference_greedy(model, p, 40) for p in prompts]
    assert engine._drafter is not None
    head = engine._drafter.modules[0]
    assert isinstance(head, CostedMtp)
    read = [{s.slot for s in segments if s.start == 0} for segments, _ in head.forwards]
    assert read[0] == {0}
    assert all(len(slots) <= 1 for slots in read)


def test_no_look_is_made_while_a_sure_draft_would_not_pay_its_row_and_the_head() -> None:
    forwards = {}
    for head_cost in (0.0, 0.004):
        engine, model = costed_engine("tight", mtp_mode="wrong", head_cost=head_cost)
        prompts = [p * 2 for p in PROMPTS]
        assert generate(engine, prompts) == [reference_greedy(model, p, 40) for p in prompts]
        assert engine._drafter is not None
        head = engine._drafter.modules[0]
        assert isinstance(head, CostedMtp)
        forwards[head_cost] = len(head.forwards)
    # A free head leaves a sure draft 0.06 token: scouts look for a chain.
    assert forwards[0.0] > 0
    # Shared by 4, a 4 ms head forward costs each 0.12 token: nothing could pay.
    assert forwards[0.004] == 0


def test_no_chain_could_pay_where_a_row_costs_a_token_and_could_as_the_batch_thins() -> None:
    def rest(head_s: float) -> ChainRest:
        costs = CostModel(FakeClock())
        # One or two rows cost about the same (a narrow product); from 16
        # rows on, every row costs what a 16-row step costs per token.
        for rows, seconds in ((1, 0.010), (2, 0.011), (16, 0.048), (32, 0.096)):
            costs.verify.observe(rows, seconds)
        costs.head.observe(1, head_s)
        costs.head.observe(16, 2 * head_s)
        return ChainRest(DraftBudget(costs))

    assert not rest(0.002).chain_may_pay(16)  # a sure draft's row is a token: nothing left
    assert rest(0.002).chain_may_pay(1)  # 0.9 token left, the head takes 0.2 of it
    assert not rest(0.010).chain_may_pay(1)  # a head as dear as the step takes 1 token


def four_sequence_costs() -> tuple[CostModel, DraftBudget]:
    """At 4 sequences: a 20 ms step, 1.25 ms a row; 200 tokens/s prices a
    row at 0.25 token, and the head's share (4 ms / 4) at 0.2."""
    costs = CostModel(FakeClock())
    for rows, seconds in ((4, 0.020), (8, 0.025)):
        costs.verify.observe(rows, seconds)
    costs.head.observe(4, 0.004)
    return costs, DraftBudget(costs)


def test_a_chain_may_pay_by_its_confidence_bins_as_often_as_the_run_meets_them() -> None:
    _, budget = four_sequence_costs()
    rest = ChainRest(budget)
    assert rest.chain_margin(4)[0] == pytest.approx(1.0 - 0.25 - 0.2)  # nothing scored: sure
    # 40 first drafts at low confidence, none accepted; 10 in the top bin,
    # all accepted: worth (1 - 0.25) a fifth of the steps, 0.15 token, under
    # the head's 0.2.
    for _ in range(40):
        budget.rates.observe(("mtp", 0, 0), False)
    for _ in range(10):
        budget.rates.observe(("mtp", 0, 5), True)
    assert not rest.chain_may_pay(4)
    # Four times as many in the top bin: worth 0.75 * 40/80 = 0.375 token.
    for _ in range(30):
        budget.rates.observe(("mtp", 0, 5), True)
    assert rest.chain_may_pay(4)
    assert rest.chain_margin(4)[0] == pytest.approx(0.175, abs=0.02)


def test_the_chain_margin_kept_between_asks_follows_every_figure_it_reads() -> None:
    costs, budget = four_sequence_costs()
    rest = ChainRest(budget)
    first = rest.chain_margin(4)[0]
    assert first == pytest.approx(0.55) and rest.chain_margin(4)[0] == first
    # Each figure below moves by ALPHA (0.15) towards what is measured.
    costs.head.observe(4, 0.008)  # the head: 4.6 ms, its share 0.2 -> 0.23 token
    assert rest.chain_margin(4)[0] == pytest.approx(0.52)
    costs.verify.observe(8, 0.030)  # 8 rows: 25.75 ms, a row 0.25 -> 0.2875 token
    assert rest.chain_margin(4)[0] == pytest.approx(0.4825)
    costs.observe_other(0.020)  # a 40 ms step: every token's share halves
    assert rest.chain_margin(4)[0] == pytest.approx(0.74125)
    budget.rates.observe(("mtp", 0, 5), False)  # a first draft missed: worth 2/3
    assert rest.chain_margin(4)[0] == pytest.approx(2 / 3 - 0.14375 - 0.115)
    assert rest.chain_margin(2) != rest.chain_margin(4)


def one_sequence_costs() -> tuple[CostModel, DraftBudget]:
    """Verifies of 1 and 2 rows at 10 and 11 ms, head forwards at 1 ms (1
    sequence) and 8 ms (16)."""
    costs = CostModel(FakeClock())
    costs.verify.observe(1, 0.010)
    costs.verify.observe(2, 0.011)
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.008)
    return costs, DraftBudget(costs)


def test_a_look_must_repay_the_rows_it_feeds_the_head_before_the_line_ends() -> None:
    costs, budget = one_sequence_costs()
    rest = ChainRest(budget)
    # At 1 sequence, 100 tokens/s: a sure draft adds 1 - 0.1 (its row) - 0.1
    # (the head) = 0.8 token a step at most.
    margin, rate = rest.chain_margin(1)
    assert margin == pytest.approx(0.8) and rate == pytest.approx(100.0)
    # Before a catch-up is measured, a held row costs a sixteenth of the
    # widest calibrated head forward: 0.5 ms.
    assert costs.held_row_s() == pytest.approx(0.0005)

    def line(tokens_left: int, held: int) -> SeqState:
        request = Request("a", (1, 2, 3), SamplingParams(max_tokens=tokens_left))
        seq = SeqState(request, 0, 1024, frozenset(), None, None)
        if held:
            rest.hold(seq, 3, [5] * held, torch.zeros(held, 4))
        return seq

    # 100 held rows: 50 ms, 5 tokens at this rate; 0.8 token a step repays
    # it over 7 tokens left, not over 6.
    assert rest.look_may_pay(line(7, 100), 1)
    assert not rest.look_may_pay(line(6, 100), 1)
    assert rest.look_may_pay(line(1, 0), 1)  # nothing held: a look costs its step only
    # A catch-up measured: 40 held rows took 4 ms beyond the head's 1 ms.
    costs.observe_held(40, 1, 1, 0.005)
    assert costs.held_row_s() == pytest.approx(0.0001)
    assert rest.look_may_pay(line(2, 100), 1)  # 1 token to repay now
    assert not rest.look_may_pay(line(1, 100), 1)


def test_a_chain_worth_its_share_waits_while_its_held_rows_would_not_be_repaid() -> None:
    # The costs of the test above: a sure draft adds 0.8 token a step at one
    # sequence, a held row costs 0.5 ms, 0.05 token at 100 tokens/s.
    _, budget = one_sequence_costs()
    rest = ChainRest(budget)

    def line(tokens_left: int, held: int) -> SeqState:
        request = Request("a", (1, 2, 3), SamplingParams(max_tokens=tokens_left))
        seq = SeqState(request, 0, 1024, frozenset(), None, None)
        budget.for_seq(seq).chain_value = 1.0  # worth far more than its share
        if held:
            rest.hold(seq, 3, [5] * held, torch.zeros(held, 4))
        return seq

    assert rest.wants_chain(line(6, 0), 1)  # nothing held: it drafts
    assert rest.wants_chain(line(7, 100), 1)  # 5 tokens to repay over 7 left
    assert not rest.wants_chain(line(6, 100), 1)  # ... not over 6


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
    return engine, model


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


def drafts_by_slot(
    engine: Engine,
    model: CostedModel,
    ends: bool,
    prompts: tuple[Sequence[int], Sequence[int]] = (PROMPTS[0], PROMPTS[1]),
) -> tuple[dict[str, list[int]], dict[int, list[int]]]:
    """Decodes a 40-token line (slot 0) and an 8-token one (slot 1) from a
    stream that ends after them (``ends``), or goes on idling; returns the
    outputs and each slot's drafts per verify."""
    reqs = [
        Request("long", tuple(prompts[0]), SamplingParams(max_tokens=40)),
        Request("short", tuple(prompts[1]), SamplingParams(max_tokens=8)),
    ]

    def stream() -> Iterator[Request | None]:
        yield from reqs
        while not ends:
            yield None  # more may come: the run is not draining

    outputs: dict[str, list[int]] = {}
    for result in engine.generate(stream()):
        outputs[result.request_id] = list(result.output_ids)
        if len(outputs) == 2:
            break
    starts = {0: len(prompts[0]), 1: len(prompts[1])}
    drafts: dict[int, list[int]] = {0: [], 1: []}
    for forward in model.forwards:
        for seg in forward:
            if seg.start >= starts[seg.slot]:
                drafts[seg.slot].append(len(seg.token_ids) - 1)
    return outputs, drafts


def test_in_a_drain_a_line_that_finishes_first_anyway_drafts_nothing() -> None:
    for ends in (True, False):
        engine, model = costed_engine("cpu", mtp_mode="right")
        outputs, drafts = drafts_by_slot(engine, model, ends)
        assert outputs["long"] == reference_greedy(model, PROMPTS[0], 40)
        assert outputs["short"] == reference_greedy(model, PROMPTS[1], 8)
        assert max(drafts[0]) == 3  # the line the run waits for drafts its chain
        if ends:
            # 8 tokens at most, against the long line's 40 at 4 a verify.
            assert set(drafts[1]) == {0}
        else:
            assert max(drafts[1]) > 0  # while the stream runs, every token counts


def test_the_drain_stops_once_a_line_has_ended_on_its_own() -> None:
    # A stream of three lines that then ends. The drain holds back the
    # 8-token line, ahead of the 40-token ones all the way (they draft, at
    # most 4 tokens a verify), unless the
    # first line ends at end of sequence, six tokens in: from then on which
    # line ends last cannot be told from tokens left, and it drafts again.
    probe = FakeModel(num_slots=4)
    eos = reference_greedy(probe, PROMPTS[2], 6)[-1]
    lines = {"first": (PROMPTS[2], 40), "long": (PROMPTS[0], 40), "short": (PROMPTS[1], 8)}
    short_drafts = {}
    for ends in ((), (eos,)):
        expected = {name: reference_greedy(probe, p, n, ends) for name, (p, n) in lines.items()}
        lengths = [len(expected[name]) for name in lines]
        assert lengths == ([6, 40, 8] if ends else [40, 40, 8])  # only the first ends early
        engine, model = costed_engine("cpu", mtp_mode="right")
        reqs = [
            Request(name, tuple(p), SamplingParams(max_tokens=n, eos_token_ids=ends))
            for name, (p, n) in lines.items()
        ]
        outputs = {r.request_id: list(r.output_ids) for r in engine.generate(reqs)}
        assert outputs == expected
        short_drafts[ends] = [
            len(seg.token_ids) - 1
            for forward in model.forwards
            for seg in forward
            if seg.slot == 2 and seg.start >= len(PROMPTS[1])
        ]
    assert set(short_drafts[()]) == {0}
    assert max(short_drafts[(eos,)]) > 0


def test_in_a_drain_a_line_ahead_still_verifies_its_copies() -> None:
    # The drain rests the chains of lines ahead, not their copies: a copy
    # costs no head forward, and a line may end at EOS long before the
    # max_tokens the drain counts it by.
    engine, model = costed_engine("free", mtp_mode=None, lookup=LOOKUP)
    seed = PROMPTS[1]
    # The short line's prompt ends as it began, so its output repeats what
    # followed the start: a copy from its first verify on.
    echo = [*seed, *reference_greedy(model, seed, 16), *seed]
    outputs, drafts = drafts_by_slot(engine, model, True, (PROMPTS[0], echo))
    assert outputs["short"] == reference_greedy(model, echo, 8)
    assert max(drafts[1]) > 0


def test_the_figures_add_up_under_the_budget() -> None:
    # A head that is always right: a scout shows it, and chains run.
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
