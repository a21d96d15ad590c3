"""The chain's rest: for which sequences the MTP head drafts after a verify,
under the draft budget (``--draft-policy auto``).

Contract: ``AutoPolicy`` (``auto.py``) asks ``wants_chain`` per sequence
before the head's forward (and per prompt chunk of a sequence whose prompt
it holds), and reports the forward with ``head_ran``.
A sequence whose chain is not wanted rests: its verified rows are kept
(``hold``) instead of fed, and the head takes every one of them, in order,
in one feed when it drafts for it again (``release``); held feeds are
contiguous. A request that reuses a sequence's prompt prefix may take the
rows of it the sequence holds, or released while the request waited
(``lend``, ``prefix_cache.py``). What a chain is worth is the budget's
(``budget.py``: ``chain_value``, ``predicted_value``, the rate and the
costs); this module only reads it, and keeps each sequence's place in the
head's schedule.

A chain drafts while what it adds a step pays the head's forwards for it
(``pays_head``). A resting chain starts again when it pays, as the estimates it
is priced by move (the other chains' drafts and the copies score the run's
rates), or once ``HOLD_MAX`` rows wait; never while the
rows it holds are more than it could repay before the sequence ends
(``repays_held``). Nor, while the run drains (a slot is free and no
request will join the steps to come: the batch only thins), does a chain
start that has rested since its prompt: its first feed would be its prompt
and all it wrote, paid at once on an acceptance never measured for it,
with the last steps of a thinning batch left to repay it. Only a run that
has not scored a single first draft of the head still starts one there: it
is that run's one way to learn the head.

What pays is decided by pure functions of the costs and estimates
(``chain_margin``, ``repays_held``, ``pays_head``);
``ChainRest`` keeps the state they are asked about.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from metrale.engine.sequence import SeqState
from metrale.engine.spec.budget import DraftBudget, marginal_row_s
from metrale.engine.spec.cost import CostModel, RunningCosts
from metrale.engine.spec.estimates import RUN_STRENGTH, Rates

# How fast the head forwards a step whose chains ran follows the latest.
FORWARDS_ALPHA = 0.2
# A chain not worth its head forwards (``wants_chain``) rests, holding its rows (its prompt's too, when it rests
# from the start); the head is fed them all in one forward when it drafts
# again, at the latest once ``HOLD_MAX`` rows wait.
HOLD_MAX = 512


def tokens_left(seq: SeqState) -> int:
    """The most tokens ``seq`` may still write: by ``max_tokens`` and its slot's room."""
    room = seq.max_len - max(seq.seq_len, seq.prompt_len)
    return min(room, seq.request.params.max_tokens - len(seq.output_ids))


@dataclass
class SeqRest:
    """One sequence's place in the head's schedule, and the verified rows the
    head has not been fed yet while its chain rests."""

    held: list[tuple[int, list[int], torch.Tensor]] = field(default_factory=list)
    _held_count: int = 0  # rows in ``held``: asked several times a step by every sequence
    # The rows released to the head while requests wait to copy this
    # sequence's prefix, from their first position (``ChainRest.lend``).
    released: tuple[int, torch.Tensor] | None = None

    def hold(self, start: int, next_ids: list[int], rows: torch.Tensor) -> None:
        """Keeps a verify's final rows for the head instead of feeding them."""
        self.held.append((start, next_ids, rows.clone()))
        self._held_count += len(next_ids)

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

    def first_held(self, start: int) -> int:
        """The position the held rows begin at, once a feed at ``start`` is held."""
        return self.held[0][0] if self.held else start

    def rows_between(self, start: int, end: int) -> torch.Tensor | None:
        """The rows at positions ``start..end-1``, held or released while
        requests waited (None: not all of them)."""
        if start >= end:
            return None
        if self.held and self.held[0][0] <= start <= end <= self.held[0][0] + self._held_count:
            first = self.held[0][0]
            return torch.cat([rows for _, _, rows in self.held])[start - first : end - first]
        if self.released is not None:
            first, rows = self.released
            if first <= start and end <= first + rows.shape[0]:
                return rows[start - first : end - first]
        return None

    def release_below(self, end: int) -> tuple[int, list[int], torch.Tensor] | None:
        """The held rows at positions below ``end``, as one feed (None: none),
        and nothing held any more: the sequence has ended."""
        below = [feed for feed in self.held if feed[0] < end]
        self.held, self._held_count = [], 0
        if not below:
            return None
        first = below[0][0]
        ids = [t for _, held_ids, _ in below for t in held_ids][: end - first]
        return first, ids, torch.cat([rows for _, _, rows in below])[: len(ids)]


class ChainRest:
    """Which chains the head drafts for, priced by ``budget`` (module doc)."""

    def __init__(self, budget: DraftBudget) -> None:
        self.budget = budget
        self._seqs: weakref.WeakKeyDictionary[SeqState, SeqRest] = weakref.WeakKeyDictionary()
        self.forwards = 1.0  # head forwards a step whose chains ran, decayed
        # ``chain_margin``'s last answer, by live count and the versions of
        # what it reads: every resting sequence of a batch asks it every step.
        self._margin: tuple[object, tuple[float, float]] | None = None
        # The batch only thins from here (``Queues.draining``), as of the
        # last ``AutoPolicy.before_head``.
        self.draining = False

    def for_seq(self, seq: SeqState) -> SeqRest:
        own = self._seqs.get(seq)
        if own is None:
            own = self._seqs[seq] = SeqRest()
        return own

    def hold(self, seq: SeqState, start: int, next_ids: list[int], rows: torch.Tensor) -> None:
        """Keeps ``seq``'s rows for the head (``SeqRest.hold``): its chain rests."""
        self.for_seq(seq).hold(start, next_ids, rows)
        self.budget.clear_chain(seq)

    def release(
        self, seq: SeqState, start: int, next_ids: list[int], rows: torch.Tensor
    ) -> tuple[int, list[int], torch.Tensor]:
        """``seq``'s feed with every row it held (``SeqRest.release``); kept
        while requests wait to copy its prefix, which may take them (``lend``)."""
        own = self.for_seq(seq)
        feed = own.release(start, next_ids, rows)
        kept = own.released
        if seq.waited_on == 0:
            own.released = None
        elif kept is not None and kept[0] + len(kept[1]) == feed[0]:
            own.released = kept[0], torch.cat([kept[1], feed[2]])
        else:
            own.released = feed[0], feed[2]
        return feed

    def held_rows(self, seq: SeqState) -> int:
        return self.for_seq(seq).held_rows()

    def lendable(self, seq: SeqState, start: int) -> bool:
        """Whether ``seq``'s held rows, once a feed at ``start`` is held too,
        begin where every MTP module's rows end (``SeqState.head_rows``): a
        request reusing its prefix can then take them (``lend``) rather than
        wait for the head to read them."""
        return self.for_seq(seq).first_held(start) == seq.head_rows

    def lend(self, source: SeqState, seq: SeqState, start: int, end: int) -> bool:
        """Holds for ``seq`` the rows ``start..end-1`` that ``source`` holds,
        with ``seq``'s own tokens (``DraftPolicy.lend``)."""
        own = self._seqs.get(source)
        rows = None if own is None else own.rows_between(start, end)
        if rows is None:
            return False
        self.hold(seq, start, list(seq.history[start + 1 : end + 1]), rows)
        return True

    def release_prompt(self, seq: SeqState) -> tuple[int, list[int], torch.Tensor] | None:
        """An ended ``seq``'s held rows of its prompt (``SeqRest.release_below``)."""
        own = self._seqs.get(seq)
        return None if own is None else own.release_below(seq.prompt_len)

    # -- what a chain could pay -------------------------------------------------

    def chain_may_pay(self, live: int) -> bool:
        """Whether any chain could pay at these costs (``chain_margin`` > 0)."""
        return self.chain_margin(live)[0] > 0

    def chain_margin(self, live: int) -> tuple[float, float]:
        """``chain_margin`` at the run's costs and estimates, kept until
        either moves: every resting sequence of a batch asks it every step."""
        costs, rates = self.budget.costs, self.budget.rates
        key = (live, costs.version, rates.observed)
        if self._margin is None or self._margin[0] != key:
            self._margin = key, chain_margin(costs, rates, live)
        return self._margin[1]

    def repays_held(self, seq: SeqState, live: int) -> bool:
        """``repays_held`` for ``seq``'s resting chain and the rows it holds;
        never, while the run drains (``draining``), for a chain that has
        rested since its prompt (not valued yet) and holds rows past it, once
        the run has scored a first draft of the head."""
        if self.draining and seq.seq_len > seq.prompt_len:
            unvalued = self.budget.for_seq(seq).chain_value is None
            if unvalued and self.budget.rates.counts(("mtp", 0))[1] > 0:
                return False
        margin, rate = self.chain_margin(live)
        held = self.for_seq(seq).held_rows()
        return repays_held(margin, rate, tokens_left(seq), held, self.budget.costs.held_row_s())

    # -- the head ---------------------------------------------------------------

    def head_ran(self, forwards: int) -> None:
        """The drafter call after a verify ran ``forwards`` head forwards
        (``wants_chain`` prices a chain by them)."""
        if forwards:
            self.forwards += FORWARDS_ALPHA * (forwards - self.forwards)

    # -- rest -------------------------------------------------------------------

    def wants_chain(self, seq: SeqState, live: int, quiet: bool = False) -> bool:
        """Whether the head drafts for ``seq`` after this verify: while what
        its chain adds a step (``chain_value``, or ``predicted_value`` for a
        chain not valued yet) pays the head's forwards for it (``pays_head``),
        at as many forwards as a step whose chains ran has lately taken
        (``head_ran``), and it holds no rows it could not repay
        (``repays_held``); or when ``HOLD_MAX`` rows wait.

        ``quiet`` (``AutoPolicy``'s quiet steps: copies off and no chain
        able to pay): no chain is priced; it drafts only once ``HOLD_MAX``
        rows wait."""
        budget, own = self.budget, self.for_seq(seq)
        if "rest" in budget.without:
            return True
        live = max(live, 1)
        worth = False
        if not quiet:
            value = budget.for_seq(seq).chain_value
            if value is None:
                value = budget.predicted_value(live)
            price = budget.chain_rate(live) * self.forwards
            worth = pays_head(value, price, budget.costs.head)
            worth = worth and (not own.held_rows() or self.repays_held(seq, live))
        return worth or own.held_rows() >= HOLD_MAX


def chain_margin(costs: CostModel, rates: Rates, live: int) -> tuple[float, float]:
    """The most a chain could add a step, in tokens, and the rate that
    prices it, on a plain step of ``live`` rows at that step's rate: its
    first draft's worth less its verify row, where the plan would verify it,
    less its share of a head forward that all ``live`` sequences share,
    which it pays every step. The first draft's acceptance is taken as high
    as the run's counts allow (a head seen little is believed sure: before
    any first draft was scored, a draft sure to be accepted); before any
    step was measured, ``(1.0, 0.0)``. The bound takes no account of the
    copies or drafts the plan would otherwise verify (a chain only ever
    replaces them), nor of how few chains the head forward drafts for."""
    step_s = costs.step_s(live)
    if step_s <= 0:  # nothing measured yet
        return 1.0, 0.0
    rate = live / step_s
    row = rate * marginal_row_s(costs.verify, live, live)
    head = rate * costs.head.predict(live) / live
    accepted, seen = rates.counts(("mtp", 0))
    worth = max((accepted + RUN_STRENGTH) / (seen + RUN_STRENGTH) - row, 0.0)
    return worth - head, rate


def repays_held(margin: float, rate: float, tokens: int, held: int, held_row_s: float) -> bool:
    """Whether a resting chain that starts again could repay the rows it
    holds: the most the chain could add a step (``margin``, in tokens,
    ``chain_margin``), over the ``tokens`` the sequence has left to write (a
    step makes one at least), against the head's time over the ``held``
    rows, which its first feed gives it, in tokens at ``rate`` (``held_row_s``:
    ``CostModel.held_row_s``). Example, in time units: a margin of 0.8
    token at 0.1 token a unit and 0.5 unit a held row: 100 held rows cost
    5 tokens, repaid over 7 tokens left (5.6), not over 6 (4.8)."""
    if margin <= 0:
        return False
    return margin * tokens > rate * held * held_row_s


def pays_head(value: float, price: float, head: RunningCosts) -> bool:
    """Whether a chain of ``value`` (what it adds a step, in tokens) pays a
    head forward of its own, ``price * head.predict(1)`` in tokens
    (``price``: the rate times the head forwards a step whose chains ran
    takes). A chain worth nothing never drafts."""
    return value > 0 and value >= price * head.predict(1)
