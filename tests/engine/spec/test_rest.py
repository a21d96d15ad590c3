"""The chain's rest (``spec/rest.py``): which chains pay the head's
forwards, whether any could, and whether a resting chain could repay its
held rows, as pure functions of the costs and estimates (the schedule
itself is driven through ``AutoPolicy`` in ``test_auto.py``)."""

from __future__ import annotations

import pytest

from metrale.engine.spec.budget import DraftBudget, marginal_row_s
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.estimates import RUN_DECAY, RUN_STRENGTH, Rates
from metrale.engine.spec.rest import chain_margin, pays_head, repays_held
from tests.support.fake_model import FakeClock


def fresh_rates() -> Rates:
    return Rates(RUN_DECAY, RUN_STRENGTH)


def head_of_sixteen() -> CostModel:
    """16 tokens in 160 ms (100 tokens/s); a head forward of 1 ms for one
    sequence (0.1 token), 4 ms for sixteen (0.4), interpolated between."""
    costs = CostModel(FakeClock())
    costs.verify.observe(16, 0.160)
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.004)
    return costs


def test_a_chain_drafts_where_what_it_adds_pays_the_head_forwards_for_it() -> None:
    head, price = head_of_sixteen().head, 100.0  # 100 tokens/s, one forward a step
    # A forward of its own: 1 ms, 0.1 token.
    assert not pays_head(0.09, price, head)
    assert pays_head(0.11, price, head)
    # Where a step whose chains ran takes three forwards (chains two drafts
    # deeper), 0.11 no longer pays 0.3; a chain worth nothing never drafts.
    assert not pays_head(0.11, 3 * price, head)
    assert not pays_head(0.0, 0.0, head)


def test_chains_never_valued_are_priced_by_a_first_draft_less_its_row() -> None:
    costs = head_of_sixteen()
    # A row of 16 more costs 10 ms, 1 token at 100 tokens/s; a first draft
    # at the prior's 0.5 is worth 0.5 less that: none is worth running.
    row = 100.0 * marginal_row_s(costs.verify, 16, 16)
    assert row == pytest.approx(1.0)
    value = DraftBudget(costs).predicted_value(16)
    assert value == pytest.approx(-0.5)
    assert not pays_head(value, 100.0, costs.head)


def test_no_chain_could_pay_where_a_row_costs_a_token_and_could_as_the_batch_thins() -> None:
    def costs(head_s: float) -> CostModel:
        costs = CostModel(FakeClock())
        # One or two rows cost about the same (a narrow product); from 16
        # rows on, every row costs what a 16-row step costs per token.
        for rows, seconds in ((1, 0.010), (2, 0.011), (16, 0.048), (32, 0.096)):
            costs.verify.observe(rows, seconds)
        costs.head.observe(1, head_s)
        costs.head.observe(16, 2 * head_s)
        return costs

    # A sure draft's row is a token: nothing left.
    assert chain_margin(costs(0.002), fresh_rates(), 16)[0] <= 0
    # 0.9 token left, the head takes 0.2 of it.
    assert chain_margin(costs(0.002), fresh_rates(), 1)[0] > 0
    # A head as dear as the step takes 1 token.
    assert chain_margin(costs(0.010), fresh_rates(), 1)[0] <= 0


def four_sequence_costs() -> CostModel:
    """At 4 sequences: a 20 ms step, 1.25 ms a row; 200 tokens/s prices a
    row at 0.25 token, and the head's share (4 ms / 4) at 0.2."""
    costs = CostModel(FakeClock())
    for rows, seconds in ((4, 0.020), (8, 0.025)):
        costs.verify.observe(rows, seconds)
    costs.head.observe(4, 0.004)
    return costs


def test_a_chain_may_pay_by_its_first_drafts_as_high_as_the_run_counts_allow() -> None:
    costs, rates = four_sequence_costs(), fresh_rates()
    # Nothing scored: a first draft is believed sure.
    assert chain_margin(costs, rates, 4)[0] == pytest.approx(1.0 - 0.25 - 0.2)
    # 18 first drafts scored, 6 accepted: (6 + 2) / (18 + 2) = 0.4, less the
    # row's 0.25, is 0.15 token, under the head's 0.2.
    for accepted in [True] * 6 + [False] * 12:
        rates.observe(("mtp", 0), accepted)
    assert chain_margin(costs, rates, 4)[0] == pytest.approx(0.15 - 0.2, abs=0.01)
    # 12 more, all accepted: (18 + 2) / (30 + 2) = 0.625, 0.375 less the row.
    for _ in range(12):
        rates.observe(("mtp", 0), True)
    assert chain_margin(costs, rates, 4)[0] == pytest.approx(0.175, abs=0.01)


def test_the_chain_margin_follows_every_figure_it_reads_and_each_moves_its_key() -> None:
    # ``ChainRest`` keeps the margin by (live, costs.version, rates.observed):
    # every figure it reads must move one of them.
    costs, rates = four_sequence_costs(), fresh_rates()
    key = (costs.version, rates.observed)
    margin, rate = chain_margin(costs, rates, 4)
    assert margin == pytest.approx(0.55) and rate == pytest.approx(200.0)

    def moved() -> bool:
        nonlocal key
        before, key = key, (costs.version, rates.observed)
        return key != before

    # Each figure below moves by ALPHA (0.15) towards what is measured.
    costs.head.observe(4, 0.008)  # the head: 4.6 ms, its share 0.2 -> 0.23 token
    assert moved() and chain_margin(costs, rates, 4)[0] == pytest.approx(0.52)
    costs.verify.observe(8, 0.030)  # 8 rows: 25.75 ms, a row 0.25 -> 0.2875 token
    assert moved() and chain_margin(costs, rates, 4)[0] == pytest.approx(0.4825)
    costs.observe_other(0.020)  # a 40 ms step: every token's share halves
    assert moved() and chain_margin(costs, rates, 4)[0] == pytest.approx(0.74125)
    rates.observe(("mtp", 0), False)  # a first draft missed: worth 2/3
    assert moved()
    assert chain_margin(costs, rates, 4)[0] == pytest.approx(2 / 3 - 0.14375 - 0.115)
    assert chain_margin(costs, rates, 2) != chain_margin(costs, rates, 4)


def one_sequence_costs() -> CostModel:
    """Verifies of 1 and 2 rows at 10 and 11 ms, head forwards at 1 ms (1
    sequence) and 8 ms (16)."""
    costs = CostModel(FakeClock())
    costs.verify.observe(1, 0.010)
    costs.verify.observe(2, 0.011)
    costs.head.observe(1, 0.001)
    costs.head.observe(16, 0.008)
    return costs


def test_a_chain_must_repay_the_rows_it_feeds_the_head_before_the_sequence_ends() -> None:
    costs = one_sequence_costs()
    # At 1 sequence, 100 tokens/s: a sure draft adds 1 - 0.1 (its row) - 0.1
    # (the head) = 0.8 token a step at most.
    margin, rate = chain_margin(costs, fresh_rates(), 1)
    assert margin == pytest.approx(0.8) and rate == pytest.approx(100.0)
    # Before a catch-up is measured, a held row costs a sixteenth of the
    # widest calibrated head forward: 0.5 ms.
    assert costs.held_row_s() == pytest.approx(0.0005)
    # 100 held rows: 50 ms, 5 tokens at this rate; 0.8 token a step repays
    # it over 7 tokens left, not over 6.
    assert repays_held(margin, rate, 7, 100, costs.held_row_s())
    assert not repays_held(margin, rate, 6, 100, costs.held_row_s())
    # Nothing held: the chain costs its step only.
    assert repays_held(margin, rate, 1, 0, costs.held_row_s())
    # A catch-up measured: 40 held rows took 4 ms beyond the head's 1 ms.
    costs.observe_held(40, 1, 1, 0.005)
    assert costs.held_row_s() == pytest.approx(0.0001)
    assert repays_held(margin, rate, 2, 100, costs.held_row_s())  # 1 token to repay now
    assert not repays_held(margin, rate, 1, 100, costs.held_row_s())
    # No margin, no start, whatever is held.
    assert not repays_held(0.0, rate, 1000, 0, costs.held_row_s())
