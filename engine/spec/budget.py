"""The draft budget: each step, how many drafts every sequence verifies and
from which source, chosen from the measured cost of a verify row and the
acceptance seen so far (``--draft-policy auto``; docs/design/speculation.md
is its one-page description).

Owner: ``AutoPolicy`` (``auto.py``), which asks ``plan`` before the verify,
reports the verify with ``observe`` and the step with ``end_step``; and the
MTP drafter, which asks ``deeper`` before each further chain position.

Estimates (``Rates``, one set for the run): the probability that a draft is
accepted given that every draft before it was, per key: for prompt-lookup
copies ``("copy", position, agreement bin)`` (how many tokens before the
copied stretch agreed with the sequence's own) and ``("copy", position)``;
for the MTP chain ``("mtp", depth, confidence bin)`` (the module's own top
probability) and ``("mtp", depth)``. A key's estimate starts from a coarser
one (``_parent``: a bin from its position or depth, a position from the one
before it), so what one key has seen informs those not seen yet. For a
greedy request every source is scored after the verify against the tokens
it produced, whether it was verified or not: a draft agrees with greedy
output exactly when the verify would have accepted it, so a source the plan
left out still learns.

The plan (``plan.py``): a grammar's forced drafts and one bonus token per
sequence are sure; each sequence's MTP chain and its copy are candidate
prefixes with their expected accepted tokens; the allocation maximising
expected tokens over the predicted step time (``cost.py``) wins.

The chain: the head forward after a verify drafts for the sequences whose
chains are worth it together (``share_head``: a forward costs little more for
many sequences than for one); a chain not worth it rests and holds its rows,
looks again now and then (``wants_chain``), and the head takes every held
row when it drafts for it again. A chain runs one more position only where
that draft, with every one before it, is worth its verify row and its share
of the head forward (``deeper``).

Exactness: the plan only decides how many drafts a verify checks. For a
sampled request nothing it uses depends on a draft's draw: its first draft is
priced by the confidence of the distribution it is drawn from, before the
draw, and later ones by their depth alone.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from metrale.engine.sequence import SeqState
from metrale.engine.spec.copies import bucket_width
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.estimates import (
    CONFIDENCE_EDGES,
    COPY_POSITIONS,
    RUN_DECAY,
    RUN_STRENGTH,
    Key,
    Rates,
    accepted_prefix,
    confidence_bin,
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
# looks: a resting chain looks and scouts again (else it restarts only when
#   it pays its share, or once HOLD_MAX rows wait);
# share_head: the chains of a step are priced together against the head
#   forward they share (else each against a forward of its own);
# drain: in a drain, the sequences ahead draft no MTP chain;
# deeper: the chain stops where a draft does not pay its row (else it runs to
#   its cap and the plan alone cuts it);
# confidence: an MTP draft is priced by its confidence bin (else its depth);
# agreement: a copy is priced by its agreement bin (else its position).
MECHANISMS = frozenset(
    {
        "rest",
        "looks",
        "share_head",
        "drain",
        "deeper",
        "confidence",
        "agreement",
    }
)
# How fast the head forwards a step whose chains ran follows the latest.
FORWARDS_ALPHA = 0.2
# The chain goes one position deeper when that draft's worth pays its head
# forward and this share of its verify row: the plan makes the final cut with
# the draft's own confidence, which the average at its depth hides, so the
# chain errs on the side of offering one draft too many.
ROW_SHARE = 0.5
# A chain not among those worth a head forward together (``share_head``,
# ``wants_chain``) rests, holding its rows (its prompt's too, when it rests
# from the start); the head is fed them all in one forward when it drafts
# again: on a look, about every ``EXPLORE_EVERY`` steps (to learn whether the
# chain pays again; twice as far apart after each look that finds it does
# not, up to ``EXPLORE_MAX``), or once ``HOLD_MAX`` rows wait.
VALUE_ALPHA = 0.2
EXPLORE_EVERY = 8
EXPLORE_MAX = 64
HOLD_MAX = 512


def tokens_left(seq: SeqState) -> int:
    """The most tokens ``seq`` may still write: by ``max_tokens`` and its slot's room."""
    room = seq.max_len - max(seq.seq_len, seq.prompt_len)
    return min(room, seq.request.params.max_tokens - len(seq.output_ids))


@dataclass
class SeqBudget:
    """One sequence's estimates, the keys of the MTP chain it holds, and the
    verified rows the head has not been fed yet while its chain rests."""

    rates: Rates
    chain_keys: list[Key] = field(default_factory=list)  # one per MTP draft, in order
    chain_odds: float = 1.0  # the chance every chain draft so far is accepted
    chain_gain: float = 0.0  # expected accepted drafts of the chain so far
    # Expected tokens a step the chain added over the other source: decayed
    # over the steps whose plan could choose it; None before its chain first
    # ran (``DraftBudget.predicted_value`` stands for it).
    chain_value: float | None = None
    # The ``share_head`` choice this sequence was last priced in (its count),
    # and whether its chain was among those chosen there.
    shared_at: int = -1
    shared: bool = False
    since_chain: int = 0  # steps since the chain last drafted
    explore_every: int = EXPLORE_EVERY  # steps between looks while it rests
    held: list[tuple[int, list[int], torch.Tensor]] = field(default_factory=list)
    _held_count: int = 0  # rows in ``held``: asked several times a step by every sequence

    def hold(self, start: int, next_ids: list[int], rows: torch.Tensor) -> None:
        """Keeps a verify's final rows for the head instead of feeding them."""
        self.held.append((start, next_ids, rows.clone()))
        self._held_count += len(next_ids)
        self.chain_keys = []

    def release(
        self, start: int, next_ids: list[int], rows: torch.Tensor
    ) -> tuple[int, list[int], torch.Tensor]:
        """This verify's rows with every held one before them, as one feed:
        held feeds are contiguous (each starts where the one before ended)."""
        if not self.held:
            return start, next_ids, rows
        first = self.held[0][0]
        ids = [t for _, held_ids, _ in self.held for t in held_ids] + next_ids
        hidden = torch.cat([r for _, _, r in self.held] + [rows])
        self.held, self._held_count = [], 0
        return first, ids, hidden

    def held_rows(self) -> int:
        return self._held_count

    def chain_gains(self, drafts: int) -> list[float]:
        return cumulative(self.rates.rate(k) for k in self.chain_keys[:drafts])

    def copy_gains(self, drafts: int, agreement: int = 0) -> list[float]:
        """A copy of 4 or more is verified at a power-of-two width only
        (``copies.bucket_copy``): a width between gains no more than the one
        below it, so the plan never picks it."""
        gains = cumulative(self.rates.rate(k) for k in copy_keys(drafts, agreement))
        return [gains[bucket_width(n) - 1] for n in range(1, drafts + 1)]


@dataclass(frozen=True)
class Candidates:
    """What a sequence may verify this step beyond its sure rows."""

    seq: SeqState
    sure_rows: int  # 1 + forced drafts
    chain: list[int]  # its MTP drafts (after any forced run)
    copy: list[int]  # its copy proposal; [] when none
    agreement: int = 0  # tokens the copy's source agreed on before it; 0: unknown


class DraftBudget:
    """The run's estimates, costs and choices (module doc)."""

    def __init__(self, costs: CostModel, without: Iterable[str] = ()) -> None:
        self.costs = costs
        without = frozenset(without)
        unknown = sorted(without - MECHANISMS)
        if unknown:
            raise ValueError(f"budget_ablation: unknown mechanisms {unknown}")
        self.without = without  # mechanisms turned off (``MECHANISMS``)
        # Each sequence's own estimates and held rows, for as long as it lives.
        self._seqs: weakref.WeakKeyDictionary[SeqState, SeqBudget] = weakref.WeakKeyDictionary()
        self.rates = Rates(RUN_DECAY, RUN_STRENGTH)
        self.rate_s = 0.0  # tokens/s the last plan predicted
        self.marginal_s = 0.0  # one more verify row per sequence, per row
        # ``share_head``'s choices so far, and how many chains the last chose.
        self._shares = 0
        self._sharing = 0
        self.forwards = 1.0  # head forwards a step whose chains ran, decayed
        # ``_first_draft_terms``' last answer, by what it reads.
        self._terms: tuple[object, tuple[float, float, list[tuple[int, float]]]] | None = None
        self._chosen: dict[str, Counter[int]] = {"mtp": Counter(), "copy": Counter()}
        self._none = 0
        self._predicted_s = self._measured_s = 0.0
        self._steps = 0
        self._planned = 0  # plans made: the clock looks keep (``wants_chain``)
        self._scout_every = EXPLORE_EVERY  # steps between looks of chains not valued
        self._scouted = -1  # the plan count of the last such look, or of a dear one
        self._plan: Plan | None = None
        # ``chain_margin``'s last answer, by live count and the versions of
        # what it reads: every resting sequence of a batch asks it every step.
        self._margin: tuple[object, tuple[float, float]] | None = None

    def for_seq(self, seq: SeqState) -> SeqBudget:
        """A sequence's budget; its chain unvalued until it first runs
        (``predicted_value`` stands for it)."""
        own = self._seqs.get(seq)
        if own is None:
            own = self._seqs[seq] = SeqBudget(self.rates)
        return own

    def predicted_value(self, seq: SeqState, live: int = 1) -> float:
        """What ``seq``'s chain is expected to add a step before it was valued
        (``SeqBudget.chain_value``), in tokens: its first draft's worth less
        the time of its verify row at the current rate (the plan's own
        pricing; before the first plan, at the rate of a step of ``live``
        rows), read per confidence bin at the sequence's own acceptance there
        (its estimate over the run's) and weighed by how often the run's
        first drafts fell in that bin. The plan verifies a draft only where
        it is worth its row, so a bin worth less adds nothing. Before any
        first draft was scored: the sequence's first-draft estimate less its row."""
        _, row, shares = self._first_draft_terms(live)
        rates = self.for_seq(seq).rates
        if not shares:
            return rates.rate(("mtp", 0)) - row
        return sum(share * max(rates.rate(("mtp", 0, b)) - row, 0.0) for b, share in shares)

    def _first_draft_terms(self, live: int) -> tuple[float, float, list[tuple[int, float]]]:
        """``predicted_value``'s run-wide terms: the rate that prices a chain
        (tokens/s: the last plan's, or before the first plan a step of
        ``live`` rows'), a first draft's verify row in tokens at that rate,
        and the share of the run's scored first drafts per confidence bin
        (``[]`` before any)."""
        planned = self._planned > 0
        key = (
            (self.rate_s, self.marginal_s, self.rates.observed)
            if planned
            else (live, self.costs.version, self.rates.observed)
        )
        if self._terms is None or self._terms[0] != key:
            rate, marginal = self.rate_s, self.marginal_s
            if not planned:
                step_s = self.costs.step_s(live)
                rate = live / step_s if step_s > 0 else 0.0
                marginal = self._marginal(live, live)
            bins = [self.rates.counts(("mtp", 0, b))[1] for b in range(len(CONFIDENCE_EDGES) + 1)]
            total = sum(bins)
            shares = [(b, seen / total) for b, seen in enumerate(bins) if seen > 0] if total else []
            self._terms = key, (rate, rate * marginal, shares)
        return self._terms[1]

    def chain_may_pay(self, live: int) -> bool:
        """Whether any chain could pay at these costs (``chain_margin`` > 0)."""
        return self.chain_margin(live)[0] > 0

    def chain_margin(self, live: int) -> tuple[float, float]:
        """The most a chain could add a step, in tokens, and the rate that
        prices it, on a plain step of ``live`` rows at that step's rate:
        its first draft's worth less its verify row, where the plan would
        verify it, less its share of a head forward that all ``live``
        sequences share, which it pays every step. The first draft's worth
        is read per confidence bin, weighed by how often the run's first
        drafts fell in it, each bin's acceptance taken as high as its counts
        allow (a bin seen little is believed sure): a head whose top bin is
        right but rare is worth that bin's share of steps. Before any first
        draft was scored, a draft sure to be accepted. The bound takes no
        account of the copies or drafts the plan would otherwise verify (a
        chain only ever replaces them), nor of how few chains the head
        forward drafts for (``share_head``)."""
        key = (live, self.costs.version, self.rates.observed)
        if self._margin is None or self._margin[0] != key:
            self._margin = key, self._chain_margin(live)
        return self._margin[1]

    def _chain_margin(self, live: int) -> tuple[float, float]:
        step_s = self.costs.step_s(live)
        if step_s <= 0:  # nothing measured yet
            return 1.0, 0.0
        rate = live / step_s
        row = rate * self._marginal(live, live)
        head = rate * self.costs.head.predict(live) / live
        bins = [self.rates.counts(("mtp", 0, b)) for b in range(len(CONFIDENCE_EDGES) + 1)]
        total = sum(seen for _, seen in bins)
        if total <= 0:
            return 1.0 - row - head, rate
        worth = sum(
            seen / total * max((accepted + RUN_STRENGTH) / (seen + RUN_STRENGTH) - row, 0.0)
            for accepted, seen in bins
        )
        return worth - head, rate

    def look_may_pay(self, seq: SeqState, live: int) -> bool:
        """Whether a look at ``seq``'s resting chain could pay for itself:
        the most the chain could add a step (``chain_margin``), over every
        token the sequence has left to write (a step makes one at least), against
        the head's time over the rows the chain holds, which the look feeds
        it (``CostModel.held_row_s``)."""
        margin, rate = self.chain_margin(live)
        if margin <= 0:
            return False
        held = self.for_seq(seq).held_rows()
        return margin * tokens_left(seq) > rate * held * self.costs.held_row_s()

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
                opts.append(budget.copy_gains(len(c.copy), c.agreement))
                names.append("copy")
            options.append(opts)
            sources.append(names)
        sure = sum(c.sure_rows for c in candidates)
        plan = best_plan(sure, float(sure), options, self.costs.step_s)
        self._plan = plan
        self._planned += 1
        self.rate_s = plan.rate
        self.marginal_s = self._marginal(plan.rows, len(candidates))
        for c, opts, names, choice in zip(candidates, options, sources, plan.choices, strict=True):
            if names and names[0] == "mtp":
                self._value_chain(c.seq, self._chain_worth(opts, choice, plan), len(candidates))
        picked: list[tuple[str, int]] = []
        for names, (o, n) in zip(sources, plan.choices, strict=True):
            if n == 0:
                self._none += 1
                picked.append(("none", 0))
            else:
                self._chosen[names[o]][n] += 1
                picked.append((names[o], n))
        return picked

    def _chain_worth(self, opts: list[list[float]], choice: tuple[int, int], plan: Plan) -> float:
        """What the chain (``opts[0]``) added to this step, in tokens at the
        plan's rate: its expected accepted drafts less the time of the rows
        they took, over the best the other source could have done with the
        rest of the plan as chosen; 0 when the plan did not take it."""
        o, n = choice
        if n == 0 or o != 0:
            return 0.0
        rate, step_s = plan.rate, self.costs.step_s
        without = plan.rows - n
        base = step_s(without)
        worth = opts[0][n - 1] - rate * (plan.seconds - base)
        other = 0.0
        if len(opts) > 1:
            for m, gain in enumerate(opts[1], 1):
                other = max(other, gain - rate * (step_s(without + m) - base))
        return max(worth - other, 0.0)

    def _value_chain(self, seq: SeqState, value: float, live: int) -> None:
        """Follows what the chain adds a step (``_chain_worth``), from what it
        was expected to (``predicted_value``) before it first ran."""
        budget = self.for_seq(seq)
        own = budget.chain_value
        if own is None:
            own = self.predicted_value(seq, live)
        budget.chain_value = own + VALUE_ALPHA * (value - own)

    def share_head(self, sequences: Sequence[SeqState], live: int) -> None:
        """Chooses, for the head forward after this verify, the chains worth
        it together: the ``k`` sequences of highest value (``chain_value``, or
        ``predicted_value`` for a chain not valued yet) whose values sum
        furthest above the time of the head's forwards feeding ``k``, in
        tokens at the current rate (as many forwards as a step whose chains
        ran has lately taken, ``head_ran``: a chain that goes deeper runs
        one more); ``wants_chain`` starts those chains. ``sequences``:
        those that may draft (not ahead in a drain); a sequence whose held rows
        its chain could not repay (``look_may_pay``) is left out. A sequence
        this choice did not price (its prompt completes before its first
        verify) joins where its value pays what its feed adds to the
        forward (``_joins``). The forward is priced as if only the chosen
        chains fed it: looks and scouts that will share it are not known
        yet, so a chain may be left out whose feed would have cost less.

        A head forward costs little more for many sequences than for one, so
        whether a chain pays its share depends on how many others run
        theirs: priced one at a time, each would be charged the whole
        forward."""
        self._shares += 1
        rate = self._first_draft_terms(live)[0]
        valued: list[tuple[float, SeqBudget]] = []
        for seq in sequences:
            budget = self.for_seq(seq)
            budget.shared_at, budget.shared = self._shares, False
            if budget.held_rows() and not self.look_may_pay(seq, live):
                continue
            value = budget.chain_value
            if value is None:
                value = self.predicted_value(seq, live)
            valued.append((value, budget))
        valued.sort(key=lambda item: item[0], reverse=True)
        best, total, chosen = 0.0, 0.0, 0
        for k, (value, _) in enumerate(valued, 1):
            total += value
            gain = total - rate * self.forwards * self.costs.head.predict(k)
            if gain > best:
                best, chosen = gain, k
        for _, budget in valued[:chosen]:
            budget.shared = True
        self._sharing = chosen

    def _joins(self, value: float, live: int) -> bool:
        """Whether a chain of ``value`` that ``share_head`` did not price
        pays what its feed adds to the head forward the chosen chains run
        (a forward of its own when none was chosen)."""
        rate, head, k = self._first_draft_terms(live)[0], self.costs.head, self._sharing
        added = head.predict(k + 1) - head.predict(k) if k else head.predict(1)
        return value >= rate * self.forwards * added

    def head_ran(self, forwards: int) -> None:
        """The drafter call after a verify ran ``forwards`` head forwards
        (``share_head`` prices a step's chains by them)."""
        if forwards:
            self.forwards += FORWARDS_ALPHA * (forwards - self.forwards)

    def wants_chain(self, seq: SeqState, live: int, ahead: bool = False) -> bool:
        """Whether the head drafts for ``seq`` after this verify: while the
        chain is among those worth the head forward together (``share_head``,
        or ``_joins`` for a sequence it did not price), on a look, or when
        ``HOLD_MAX`` rows wait.
        (Further positions of the chain pay their own forwards, ``deeper``.)

        Looks: a resting chain looks on the first step, half its spacing or
        more after it stopped, whose plan count is a multiple of that spacing
        (``EXPLORE_EVERY``, doubled after each look that found the chain not
        worth it). Spacings are powers of two, so the looks of a batch fall
        in one head forward rather than one each. A chain never valued (it
        has not run: ``predicted_value`` stands for it) looks as a scout:
        one such sequence a look, on the run's own doubling spacing, so that
        a first batch where drafts do not pay learns the chain's acceptance
        without feeding the head every prompt. A look whose held rows cost
        the head more than a forward of its own takes a scout's turn too,
        one a step: sharing a forward saves such looks little, and one look
        tells the run what 16 would. A sequence ``ahead`` in a
        drain (``choose.lines_ahead``) verifies no MTP draft, so its chain
        rests without looks until ``HOLD_MAX`` rows wait.

        No look and no scout is made while it could not pay for the head's
        time over the rows the chain holds (``look_may_pay``): where a
        verify row costs about a token's share of the step, every look would
        be a head forward, held prompt and all, for nothing. Looks resume as
        soon as the costs allow, as a batch thins out, unless the sequence is
        too near its end. Nor does a chain worth its share start while it
        holds rows that it could not repay."""
        budget = self.for_seq(seq)
        if ahead and budget.held_rows() < HOLD_MAX:
            return False
        if "rest" in self.without:
            return True
        budget.since_chain += 1
        live = max(live, 1)
        value, valued = budget.chain_value, budget.chain_value is not None
        if budget.shared_at == self._shares:
            worth = budget.shared  # held rows it could not repay: left out there
        else:
            if value is None:
                value = self.predicted_value(seq, live)
            worth = self._joins(value, live)
            worth = worth and (not budget.held_rows() or self.look_may_pay(seq, live))
        if worth:
            budget.since_chain, budget.explore_every = 0, EXPLORE_EVERY
            return True
        if budget.held_rows() >= HOLD_MAX:
            budget.since_chain = 0
            return True
        if "looks" in self.without or not self.look_may_pay(seq, live):
            return False
        if not valued:
            if self._planned % self._scout_every or not self._scout_turn():
                return False
            self._scout_every = min(2 * self._scout_every, EXPLORE_MAX)
            budget.since_chain = 0
            return True
        every = budget.explore_every
        if 2 * budget.since_chain < every or self._planned % every:
            return False
        if self._feeds_more_than_a_forward(budget) and not self._scout_turn():
            return False  # a look that costs as a scout does waits for a scout's turn
        # A look that finds the chain still not worth it looks half as often.
        budget.since_chain = 0
        budget.explore_every = min(2 * every, EXPLORE_MAX)
        return True

    def _scout_turn(self) -> bool:
        """Takes this step's one turn for a scout or a dear look, if still free."""
        if self._scouted == self._planned:
            return False
        self._scouted = self._planned
        return True

    def _feeds_more_than_a_forward(self, budget: SeqBudget) -> bool:
        """Whether feeding the head the rows ``budget`` holds costs more than
        a head forward of its own (``wants_chain``: such looks go one a step)."""
        return budget.held_rows() * self.costs.held_row_s() > self.costs.head.predict(1)

    def _marginal(self, rows: int, seqs: int) -> float:
        step = max(seqs, 1)
        verify = self.costs.verify
        return max((verify.predict(rows + step) - verify.predict(rows)) / step, 0.0)

    # -- the chain ------------------------------------------------------------

    def start_chain(self, seq: SeqState) -> None:
        budget = self.for_seq(seq)
        budget.chain_keys, budget.chain_odds, budget.chain_gain = [], 1.0, 0.0

    def drafted(self, seq: SeqState, depth: int, top_prob: float | None) -> None:
        """Records the chain's draft at ``depth`` (``top_prob``: the module's
        top probability there, or None when it may not be used)."""
        budget = self.for_seq(seq)
        if "confidence" in self.without:
            top_prob = None
        key: Key = ("mtp", depth) if top_prob is None else ("mtp", depth, confidence_bin(top_prob))
        budget.chain_keys.append(key)
        budget.chain_odds *= budget.rates.rate(key)
        budget.chain_gain += budget.chain_odds

    def deeper(self, seq: SeqState, depth: int, live: int) -> bool:
        """Whether the head runs chain position ``depth`` for ``seq``, given the
        drafts before it and ``live`` sequences sharing that head forward."""
        budget = self.for_seq(seq)
        if "deeper" in self.without:
            return True
        worth = budget.chain_odds * budget.rates.rate(("mtp", depth))
        head = self.costs.head.predict(live) / max(live, 1)
        return worth >= self.rate_s * (ROW_SHARE * self.marginal_s + head)

    # -- what happened --------------------------------------------------------

    def observe(
        self,
        seq: SeqState,
        produced: Sequence[int],
        chain: Sequence[int],
        copy: Sequence[int],
        agreement: int = 0,
    ) -> None:
        """Scores a greedy sequence's chain and copy drafts against the tokens
        its verify ``produced`` after the sure rows (module doc): each draft
        agrees with greedy output exactly when the verify would accept it."""
        budget = self.for_seq(seq)
        copied = copy_keys(len(copy), agreement)
        for keys, drafts in ((budget.chain_keys, chain), (copied, copy)):
            agreed = [d == t for d, t in zip(drafts, produced, strict=False)]
            score(budget.rates, keys, len(agreed), len(accepted_prefix(agreed)))

    def observe_counts(
        self, seq: SeqState, source: str, proposed: int, accepted: int, agreement: int = 0
    ) -> None:
        """A sampled sequence's verified drafts: only what was verified is known."""
        budget = self.for_seq(seq)
        keys = budget.chain_keys if source == "mtp" else copy_keys(proposed, agreement)
        score(budget.rates, keys, proposed, accepted)

    def end_step(self, measured_s: float, verify_s: float, head_s: float = 0.0) -> None:
        """A step that verified: its measured time against the plan's, both
        without the head's forwards after the verify (``head_s``), which
        ``share_head`` and ``deeper`` price apart: counted in the rest of the
        step, they would lower the rate every row is priced at."""
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
