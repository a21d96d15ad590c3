"""The draft budget: each step, how many drafts every sequence verifies and
from which source, chosen from the measured cost of a verify row and the
acceptance seen so far (``--draft-policy auto``; docs/design/speculation.md
is its one-page description).

Contract: ``AutoPolicy`` (``auto.py``) asks ``plan`` before the verify,
reports the verify with ``observe`` and the step with ``end_step``; the MTP
drafter asks ``deeper`` before each further chain position and reports each
draft with ``drafted``. This module keeps the run's prices: the estimates,
the costs, the rate the last plan predicted, and what each sequence's chain
is worth (``chain_value``, ``predicted_value``). Which chains the head
drafts for after a verify, and the rows a resting chain holds, are
``rest.py``'s; it reads these prices and never writes them, except to drop
the keys of a chain that rests (``clear_chain``).

Estimates (``estimates.py``, one ``Rates`` for the run): the probability that
a draft is accepted given that every draft before it was, per copy position
and per MTP depth. For a greedy request
every source is scored after the verify against the tokens it produced,
whether it was verified or not: a draft agrees with greedy output exactly
when the verify would have accepted it, so a source the plan left out still
learns.

The plan (``plan.py``): a grammar's forced drafts and one bonus token per
sequence are sure; each sequence's MTP chain and its copy are candidate
prefixes with their expected accepted tokens; the allocation maximising
expected tokens over the predicted step time (``cost.py``) wins. What the
chain added to a step's plan, over the other source, is its value, followed
from step to step. A chain runs one more position only where that draft,
with every one before it, is worth its verify row and its share of the head
forward (``deeper``). What a chain added to a plan (``chain_worth``) is a
pure function; ``DraftBudget`` keeps the state it is asked about.

Exactness: the plan only decides how many drafts a verify checks, from
estimates by position and depth: nothing it uses depends on a draft's draw.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from metrale.engine.sequence import SeqState
from metrale.engine.spec.copies import bucket_width
from metrale.engine.spec.cost import CostModel, RunningCosts
from metrale.engine.spec.estimates import (
    COPY_POSITIONS,
    RUN_DECAY,
    RUN_STRENGTH,
    Key,
    Rates,
    accepted_prefix,
    copy_key,
    copy_keys,
    cumulative,
    score,
)
from metrale.engine.spec.plan import Plan, best_plan
from metrale.engine.stats import BudgetStats

# The mechanisms an ablation may turn off (``DraftBudget(without=...)``):
# rest: a chain that does not pay rests and holds its rows (else every chain
#   drafts every step);
# deeper: the chain stops where a draft does not pay its row (else it runs to
#   its cap and the plan alone cuts it).
MECHANISMS = frozenset({"rest", "deeper"})
# The chain goes one position deeper when that draft's worth pays its head
# forward and this share of its verify row: the plan makes the final cut
# with the whole step's prices (the copy beside the chain, the batch's
# rows), so the chain errs on the side of offering one draft too many.
ROW_SHARE = 0.5
# How fast a chain's value follows what it added to the latest plan.
VALUE_ALPHA = 0.2


@dataclass
class SeqBudget:
    """One sequence's estimates, and the keys and value of the MTP chain it holds."""

    rates: Rates
    chain_keys: list[Key] = field(default_factory=list)  # one per MTP draft, in order
    chain_odds: float = 1.0  # the chance every chain draft so far is accepted
    # Expected tokens a step the chain added over the other source: decayed
    # over the steps whose plan could choose it; None before its chain first
    # ran (``DraftBudget.predicted_value`` stands for it).
    chain_value: float | None = None

    def chain_gains(self, drafts: int) -> list[float]:
        return cumulative(self.rates.rate(k) for k in self.chain_keys[:drafts])

    def copy_gains(self, drafts: int) -> list[float]:
        """A copy of 4 or more is verified at a power-of-two width only
        (``copies.bucket_copy``): a width between gains no more than the one
        below it, so the plan never picks it."""
        gains = cumulative(self.rates.rate(k) for k in copy_keys(drafts))
        return [gains[bucket_width(n) - 1] for n in range(1, drafts + 1)]


@dataclass(frozen=True)
class Candidates:
    """What a sequence may verify this step beyond its sure rows."""

    seq: SeqState
    sure_rows: int  # 1 + forced drafts
    chain: list[int]  # its MTP drafts (after any forced run)
    copy: list[int]  # its copy proposal; [] when none


class DraftBudget:
    """The run's estimates, costs and choices (module doc)."""

    def __init__(self, costs: CostModel, without: Iterable[str] = ()) -> None:
        self.costs = costs
        without = frozenset(without)
        unknown = sorted(without - MECHANISMS)
        if unknown:
            raise ValueError(f"budget_ablation: unknown mechanisms {unknown}")
        self.without = without  # mechanisms turned off (``MECHANISMS``)
        # Each sequence's own estimates and chain, for as long as it lives.
        self._seqs: weakref.WeakKeyDictionary[SeqState, SeqBudget] = weakref.WeakKeyDictionary()
        self.rates = Rates(RUN_DECAY, RUN_STRENGTH)
        self.rate_s = 0.0  # tokens/s the last plan predicted
        self.marginal_s = 0.0  # one more verify row per sequence, per row
        # ``_first_draft_terms``' last answer, by what it reads.
        self._terms: tuple[object, tuple[float, float]] | None = None
        self._chosen: dict[str, Counter[int]] = {"mtp": Counter(), "copy": Counter()}
        self._none = 0
        self._predicted_s = self._measured_s = 0.0
        self._steps = 0
        self.planned = 0  # plans made
        self._plan: Plan | None = None
        self._plan_seqs = 0  # the sequences the last plan priced

    def for_seq(self, seq: SeqState) -> SeqBudget:
        """A sequence's budget; its chain unvalued until it first runs
        (``predicted_value`` stands for it)."""
        own = self._seqs.get(seq)
        if own is None:
            own = self._seqs[seq] = SeqBudget(self.rates)
        return own

    def clear_chain(self, seq: SeqState) -> None:
        """Forgets ``seq``'s chain: a new one starts, or it rests."""
        budget = self.for_seq(seq)
        budget.chain_keys, budget.chain_odds = [], 1.0

    def predicted_value(self, live: int = 1) -> float:
        """What a chain is expected to add a step before it was valued
        (``SeqBudget.chain_value``), in tokens: the run's first-draft
        estimate less the time of its verify row at the current rate (the
        plan's own pricing; before the first plan, or where the last priced
        fewer sequences than ``live``, at the rate of a step of ``live``
        rows). It may be below 0."""
        return self.rates.rate(("mtp", 0)) - self._first_draft_terms(live)[1]

    def chain_rate(self, live: int) -> float:
        """The rate that prices a chain, in tokens/s: the last plan's, or a
        step of ``live`` rows' before the first plan or where the last
        priced fewer sequences than ``live``."""
        return self._first_draft_terms(live)[0]

    def _first_draft_terms(self, live: int) -> tuple[float, float]:
        """``predicted_value``'s run-wide terms: the rate that prices a chain
        (``chain_rate``) and a first draft's verify row in tokens at that rate."""
        # The last plan's prices, unless it priced fewer sequences than share
        # the steps to come (the first of a batch to decode, its others
        # still reading their prompts): then a step of ``live`` rows'.
        planned = self.planned > 0 and self._plan_seqs >= live
        key = (self.rate_s, self.marginal_s) if planned else (live, self.costs.version)
        if self._terms is None or self._terms[0] != key:
            rate, marginal = self.rate_s, self.marginal_s
            if not planned:
                step_s = self.costs.step_s(live)
                rate = live / step_s if step_s > 0 else 0.0
                marginal = self.marginal(live, live)
            self._terms = key, (rate, rate * marginal)
        return self._terms[1]

    def marginal(self, rows: int, seqs: int) -> float:
        """``marginal_row_s`` at the measured verify costs."""
        return marginal_row_s(self.costs.verify, rows, seqs)

    # -- the plan -------------------------------------------------------------

    def plan(self, candidates: Sequence[Candidates]) -> list[tuple[str, int]]:
        """Per candidate: ``("mtp" | "copy" | "none", drafts)``."""
        options: list[list[list[float]]] = []
        sources: list[list[str]] = []
        for c in candidates:
            budget = self.for_seq(c.seq)
            opts, names = [], []
            if c.chain:
                opts.append(budget.chain_gains(len(c.chain)))
                names.append("mtp")
            if c.copy:
                opts.append(budget.copy_gains(len(c.copy)))
                names.append("copy")
            options.append(opts)
            sources.append(names)
        sure = sum(c.sure_rows for c in candidates)
        plan = best_plan(sure, float(sure), options, self.costs.step_s)
        self._made(plan, len(candidates))
        for c, opts, names, choice in zip(candidates, options, sources, plan.choices, strict=True):
            if names and names[0] == "mtp":
                worth = chain_worth(opts, choice, plan, self.costs.step_s)
                self._value_chain(c.seq, worth, len(candidates))
        picked: list[tuple[str, int]] = []
        for names, (o, n) in zip(sources, plan.choices, strict=True):
            if n == 0:
                self._none += 1
                picked.append(("none", 0))
            else:
                self._chosen[names[o]][n] += 1
                picked.append((names[o], n))
        return picked

    def plan_sure(self, sure_rows: int, seqs: int) -> None:
        """``plan`` for a step where none of the ``seqs`` sequences has a
        draft to offer: each verifies its sure rows (``sure_rows`` in all),
        and the run's prices move as that plan would move them."""
        seconds = self.costs.step_s(sure_rows)
        self._made(Plan(((-1, 0),) * seqs, sure_rows, float(sure_rows), seconds), seqs)
        self._none += seqs

    def _made(self, plan: Plan, seqs: int) -> None:
        """Keeps ``plan`` as the step's, and the rate it prices rows at."""
        self._plan, self._plan_seqs = plan, seqs
        self.planned += 1
        self.rate_s = plan.rate
        self.marginal_s = self.marginal(plan.rows, seqs)

    def _value_chain(self, seq: SeqState, value: float, live: int) -> None:
        """Follows what the chain adds a step (``chain_worth``), from what it
        was expected to (``predicted_value``) before it first ran."""
        budget = self.for_seq(seq)
        own = budget.chain_value
        if own is None:
            own = self.predicted_value(live)
        budget.chain_value = own + VALUE_ALPHA * (value - own)

    # -- the chain ------------------------------------------------------------

    def drafted(self, seq: SeqState, depth: int) -> None:
        """Records the chain's draft at ``depth``."""
        budget = self.for_seq(seq)
        budget.chain_keys.append(("mtp", depth))
        budget.chain_odds *= budget.rates.rate(("mtp", depth))

    def deeper(self, seq: SeqState, depth: int, live: int) -> bool:
        """Whether the head runs chain position ``depth`` for ``seq``, given the
        drafts before it and ``live`` sequences sharing that head forward."""
        if "deeper" in self.without:
            return True
        worth = self.for_seq(seq).chain_odds * self.rates.rate(("mtp", depth))
        head = self.costs.head.predict(live) / max(live, 1)
        return worth >= self.rate_s * (ROW_SHARE * self.marginal_s + head)

    # -- what happened --------------------------------------------------------

    def observe(
        self,
        seq: SeqState,
        produced: Sequence[int],
        chain: Sequence[int],
        copy: Sequence[int],
    ) -> None:
        """Scores a greedy sequence's chain and copy drafts against the tokens
        its verify ``produced`` after the sure rows (module doc): each draft
        agrees with greedy output exactly when the verify would accept it."""
        budget = self.for_seq(seq)
        copied = copy_keys(len(copy))
        for keys, drafts in ((budget.chain_keys, chain), (copied, copy)):
            agreed = [d == t for d, t in zip(drafts, produced, strict=False)]
            score(budget.rates, keys, len(agreed), len(accepted_prefix(agreed)))

    def observe_counts(self, seq: SeqState, source: str, proposed: int, accepted: int) -> None:
        """A sampled sequence's verified drafts: only what was verified is known."""
        budget = self.for_seq(seq)
        keys = budget.chain_keys if source == "mtp" else copy_keys(proposed)
        score(budget.rates, keys, proposed, accepted)

    def end_step(self, measured_s: float, verify_s: float, head_s: float = 0.0) -> None:
        """A step that verified: its measured time against the plan's, both
        without the head's forwards after the verify (``head_s``), which
        the chain's rest (``rest.py``) prices apart:
        counted in the rest of the step, they would lower the rate every row
        is priced at."""
        if self._plan is None:
            return
        self._steps += 1
        self._predicted_s += self._plan.seconds
        self._measured_s += measured_s - head_s
        self.costs.observe_other(measured_s - verify_s - head_s)
        self._plan = None

    def snapshot(self) -> BudgetStats:
        costs = self.costs
        return BudgetStats(
            steps=self._steps,
            chosen={k: dict(sorted(v.items())) for k, v in self._chosen.items()},
            no_drafts=self._none,
            verify_ms={k: 1e3 * v for k, v in costs.verify.table().items()},
            head_ms={k: 1e3 * v for k, v in costs.head.table().items()},
            other_ms=1e3 * costs.other_s,
            predicted_ms=1e3 * self._predicted_s / self._steps if self._steps else 0.0,
            measured_ms=1e3 * self._measured_s / self._steps if self._steps else 0.0,
            copy_acceptance=tuple(
                self.rates.rate(copy_key(j)) for j in range(1, COPY_POSITIONS + 1)
            ),
            mtp_acceptance=tuple(self.rates.rate(("mtp", d)) for d in range(3)),
        )


def chain_worth(
    opts: Sequence[Sequence[float]],
    choice: tuple[int, int],
    plan: Plan,
    step_s: Callable[[int], float],
) -> float:
    """What a sequence's chain added to a step, in tokens at the plan's rate:
    its expected accepted drafts less the time of the rows they took, over
    the best the sequence's other source could have done with the rest of
    the plan as chosen; 0 when the plan did not take the chain.

    ``opts``: the sequence's gains (``plan.py``), the chain's first and its
    copy's, if any, second; ``choice``: the plan's ``(source, drafts)`` for
    it; ``step_s``: seconds of a step by its rows. Example, in time units:
    rows at 3 units over a 10-unit step, a chain of gains [0.9, 1.6] taken
    whole (3 rows in 16 units, 2.6 tokens: 0.1625 token a unit) beside a
    copy of [0.5]: the chain's 1.6 less its 6 units (0.975 token) is 0.625;
    the copy's 0.5 less its 3 units (0.4875) is 0.0125; the chain added
    0.6125."""
    o, n = choice
    if n == 0 or o != 0:
        return 0.0
    rate = plan.rate
    without = plan.rows - n
    base = step_s(without)
    worth = opts[0][n - 1] - rate * (plan.seconds - base)
    other = 0.0
    if len(opts) > 1:
        for m, gain in enumerate(opts[1], 1):
            other = max(other, gain - rate * (step_s(without + m) - base))
    return max(worth - other, 0.0)


def marginal_row_s(verify: RunningCosts, rows: int, seqs: int) -> float:
    """Seconds of one more verify row for each of ``seqs`` sequences on a
    verify of ``rows`` rows, per row (never below 0)."""
    step = max(seqs, 1)
    return max((verify.predict(rows + step) - verify.predict(rows)) / step, 0.0)
