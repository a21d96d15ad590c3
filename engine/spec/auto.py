"""The cost-aware draft policy (``--draft-policy auto``): every source offers
its drafts, the budget (``budget.py``) picks one source and a prefix per
sequence, and after the verify every offer is scored; the chain's rest
(``rest.py``) chooses the sequences the MTP head drafts for.

Contract: ``AutoPolicy`` is a ``DraftPolicy`` (``policy.py``); the step calls
it at the same points as the fixed policy, and it keeps the fixed rule's
invariants:
- A copy is never longer than ``PromptLookupConfig.max_drafts``, the slot's
  draft capacity, nor, in a batch of two or more, 3 tokens; an MTP chain
  never longer than the ladder's longest; copies are off when more than
  ``max_seqs`` sequences run.
- Every copy proposed is either verified, marked in flight at the length the
  plan chose and settled by ``copies.settle_copies`` in the same step, or
  abandoned before the verify.
- A verified copy leaves the MTP drafter told that none of its drafts were
  accepted (``copies.drafter_accepted``): the rows were not its drafts.
- A grammar's forced drafts are always verified, first; the chosen drafts
  follow them, and ``check_drafts`` then cuts at the first forbidden one.

A sequence's own copies come from the longest agreement
(``PromptLookupSeq(longest=True)``): the earlier occurrence of its last
token whose preceding tokens agree longest with its own (on one token
before it at least), offered up to the copy caps without the fixed rule's
window and cooldown: the plan prices each copy by its position instead.

The head: a sequence whose chain is not worth the head forward rests and
holds its verified rows; the head takes them all, in order, when it drafts
for it again (``ChainRest.wants_chain``).
Quiet steps: with copies off for the batch and no chain able to pay
(``ChainRest.chain_may_pay``), every chain rests unpriced until ``HOLD_MAX``
rows wait; a step where no sequence has a draft plans only its sure rows
(``DraftBudget.plan_sure``).
Whether a sequence drafts depends only on what was emitted before the step,
never on a draw, so sampled output stays exact.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from metrale.engine.config import MtpLadder
from metrale.engine.sequence import SeqState
from metrale.engine.spec.budget import Candidates, DraftBudget
from metrale.engine.spec.calibration import calibrate_model
from metrale.engine.spec.constrained import forced_of
from metrale.engine.spec.copies import (
    CopyTaken,
    copies_on,
    copy_path_cap,
    lookup_of,
    propose_copy,
)
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter
from metrale.engine.spec.policy import Feed
from metrale.engine.spec.rest import HOLD_MAX, ChainRest
from metrale.engine.stats import BudgetStats
from metrale.lookup import PromptLookupConfig, SharedLookup

if TYPE_CHECKING:
    from metrale.engine.step import Queues, StepTimes

# The budget's figures in the stats snapshot are worked out at most this
# often while a run goes on (and whenever it ends): a viewer redraws a few
# times a second, and the figures cost more than a step's bookkeeping.
PUBLISH_EVERY_S = 0.2


@dataclass(frozen=True)
class Offer:
    """What a sequence was offered this step, for scoring after the verify."""

    seq: SeqState
    source: str  # "mtp", "copy" or "none"
    drafts: int  # of the chosen source
    chain: list[int]
    copy: list[int]


def take_planned_drafts(
    batch: Sequence[SeqState],
    budget: DraftBudget,
    cfg: PromptLookupConfig | None,
    shared: SharedLookup | None,
) -> tuple[list[CopyTaken], list[Offer]]:
    """Sets each sequence's drafts to the plan's choice (module doc). Runs
    after ``take_forced`` and before ``check_drafts``."""
    copying = copies_on(cfg, len(batch))
    path_cap = copy_path_cap(cfg, len(batch)) if cfg is not None else 0
    candidates: list[Candidates] = []
    for seq in batch:
        own = budget.for_seq(seq)
        # A forced run that matched the chain's first drafts stands in their
        # place (``take_forced``): the chain's keys move past them too.
        forced = forced_of(seq)
        offset = len(forced) if forced and seq.pending_drafts else 0
        own.chain_keys = own.chain_keys[offset : offset + len(seq.pending_drafts)]
        chain = list(seq.pending_drafts[: len(own.chain_keys)])
        copy = None
        if copying and cfg is not None:
            copy = propose_copy(seq, cfg, shared, path_cap, 0, longest=True)
        candidates.append(Candidates(seq, 1 + len(forced), chain, copy or []))
    picked = budget.plan(candidates)
    took: list[CopyTaken] = []
    offers: list[Offer] = []
    for c, (source, n) in zip(candidates, picked, strict=True):
        seq, lookup = c.seq, lookup_of(c.seq)
        if source == "copy":
            assert lookup is not None
            lookup.cut_in_flight(n)
            seq.set_drafts(c.copy[:n])
            took.append(CopyTaken(seq, seq.seq_len + len(forced_of(seq))))
        else:
            if c.copy and lookup is not None:
                lookup.abandon()
            seq.set_drafts(c.chain[:n])
        offers.append(Offer(seq, source, n, c.chain, c.copy))
    return took, offers


def score_offers(
    budget: DraftBudget, offers: Sequence[Offer], produced: dict[int, list[int]]
) -> None:
    """Scores each offer after the verify. ``produced[slot]``: the tokens the
    sequence's verify produced after its forced run (the accepted drafts and
    the bonus token: the model's own token at every position it reached). A
    greedy offer is scored against them whatever was verified; a sampled one
    only on what it verified."""
    for offer in offers:
        seq = offer.seq
        tokens = produced.get(seq.slot)
        if tokens is None:
            continue
        if seq.request.params.greedy:
            budget.observe(seq, tokens, offer.chain, offer.copy)
        elif offer.source != "none":
            budget.observe_counts(seq, offer.source, offer.drafts, len(tokens) - 1)


def sharing(queues: Queues) -> int:
    """The sequences that share the steps to come: those decoding, those
    whose prompts are still being read and those waiting to copy a prefix."""
    return queues.running() + len(queues.prefilling) + queues.attached


class AutoPolicy:
    """The draft budget as a ``DraftPolicy`` (module doc)."""

    name = "auto"

    def __init__(
        self,
        ladder: MtpLadder,
        lookup: PromptLookupConfig | None,
        shared: SharedLookup | None,
        costs: CostModel | None = None,
        without: tuple[str, ...] = (),
    ) -> None:
        self.budget = DraftBudget(costs or CostModel(), without)
        self.rest = ChainRest(self.budget)
        self.lookup, self.shared = lookup, shared
        # Any chain may be as long as the ladder's longest: the plan cuts it.
        self._chain_cap = ladder.longest
        self._offers: list[Offer] = []
        self._quiet = False  # this step, every chain rests (``take_drafts``)
        self._released = 0  # held rows fed to the head this step
        self._sharing = 0  # sequences sharing the steps to come (``sharing``)
        self._snapshot: BudgetStats | None = None
        self._published = 0.0

    @property
    def costs(self) -> CostModel:
        return self.budget.costs

    def clock(self) -> float:
        return self.costs.clock()

    def make_drafter(self, modules: Sequence[Any], min_prob: float) -> MtpDrafter:
        return MtpDrafter(list(modules), min_prob, self.budget)

    def chain_cap(self, running: int) -> int:
        return self._chain_cap

    def chain_len(self, seq: SeqState, running: int) -> int:
        return min(self._chain_cap, seq.draft_capacity())

    def take_drafts(self, batch: list[SeqState], queues: Queues) -> list[CopyTaken]:
        copying = copies_on(self.lookup, len(batch))
        # Quiet: no chain may start while none could pay at this batch's costs.
        self._quiet = not copying and not self.rest.chain_may_pay(queues.running())
        if not copying and not any(seq.pending_drafts for seq in batch):
            # No sequence has a draft to offer: the plan is the sure rows.
            self._offers = []
            sure = sum(1 + len(forced_of(seq)) for seq in batch)
            self.budget.plan_sure(sure, len(batch))
            return []
        took, self._offers = take_planned_drafts(batch, self.budget, self.lookup, self.shared)
        return took

    def verified(self, times: StepTimes) -> None:
        self.costs.verify.observe(times.verify_rows, times.verify_s)
        score_offers(self.budget, self._offers, times.produced)

    def prompt_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,  # [len(next_ids), hidden_size]
        complete: bool,
        queues: Queues,
    ) -> Feed | None:
        """A prefill chunk's feed, drafting once the prompt is complete. A
        prompt of up to ``HOLD_MAX`` tokens is held until the chain first
        drafts: where drafts do not pay, the head never reads the prompts of
        the sequences whose chains never run. A prompt another request waits
        to copy (``prefix_cache.py``) is held only where that request can
        take the held rows with the prefix (``ChainRest.lendable``), and fed
        at once otherwise. A chain that starts as its prompt completes
        repays the prompt's rows, as one resting does its held rows."""
        rest = self.rest
        if seq.prompt_len > HOLD_MAX:
            # Rows lent with a reused prefix come first.
            start, next_ids, rows = rest.release(seq, start, next_ids, rows)
        else:
            live = sharing(queues)
            # Another request copies these rows, and cannot take them held.
            waited = seq.waited_on > 0 and not rest.lendable(seq, start)
            if waited:
                start, next_ids, rows = rest.release(seq, start, next_ids, rows)
            else:
                # Held first: the chain is priced with the prompt rows it
                # would have the head read (``ChainRest.repays_held``).
                rest.hold(seq, start, next_ids, rows)
                if not complete or not rest.wants_chain(seq, max(live, 1)):
                    return None
                start, next_ids, rows = rest.release(seq, seq.seq_len, [], rows[:0])
        num_drafts = self.chain_len(seq, 0) if complete else 0
        return DraftFeed(seq, start, next_ids, num_drafts), rows

    def before_head(self, batch: Sequence[SeqState], queues: Queues) -> None:
        """Readies the step's head forward: the held rows it takes are counted
        afresh, the chains are priced at every sequence that shares the steps
        to come, and the rest learns whether the batch only thins from here."""
        self._released = 0
        self._sharing = sharing(queues)
        self.rest.draining = queues.draining()

    def head_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,  # [len(next_ids), hidden_size]
        running: int,
    ) -> Feed | None:
        """A resting chain's rows wait; a drafting one takes them all, as
        does one whose rows another request waits to copy and could not
        take held (``ChainRest.lendable``). A chain is priced at the
        sequences that share the steps to come (``sharing``), not only those
        decoding now: a batch's first request often decodes alone while the
        others read their prompts or wait on its prefix, and a chain started
        at that lone step's prices would rest again a step later, its head
        forward wasted."""
        rest = self.rest
        live = max(running, self._sharing)
        # Another request copies these rows, and cannot take them held.
        waited = seq.waited_on > 0 and not rest.lendable(seq, start)
        if not waited and not rest.wants_chain(seq, live, quiet=self._quiet):
            rest.hold(seq, start, next_ids, rows)
            return None
        self._released += rest.held_rows(seq)
        start, next_ids, rows = rest.release(seq, start, next_ids, rows)
        return DraftFeed(seq, start, next_ids, self.chain_len(seq, running)), rows

    def head_ran(self, feeds: Sequence[DraftFeed], forwards: int, seconds: float) -> None:
        self.rest.head_ran(forwards)
        if forwards and self._released:
            self.costs.observe_held(self._released, len(feeds), forwards, seconds)
        elif forwards:
            self.costs.head.observe(len(feeds), seconds / forwards)

    def chain_drafted(self, seq: SeqState, drafts: list[int]) -> None:
        """A chain drafted on the device."""
        self.budget.clear_chain(seq)
        for depth in range(len(drafts)):
            self.budget.drafted(seq, depth)

    def end_step(self, times: StepTimes) -> None:
        if times.verify_s > 0:
            measured = self.clock() - times.began - times.prefill_s
            self.budget.end_step(measured, times.verify_s, times.head_s)

    def calibrate(self, model: Any, drafter: MtpDrafter | None, slots: int, max_len: int) -> None:
        """The costs, from the cache or measured."""
        if not self.costs.calibrated:
            calibrate_model(self.costs, model, drafter, slots, max_len)

    def save(self) -> None:
        self.costs.save()

    def ended(self, seq: SeqState) -> Feed | None:
        """The prompt rows a resting chain held, as a feed (``DraftPolicy.ended``):
        the head reads them only where a later request reuses the prefix
        (``MtpDrafter.owe``)."""
        released = self.rest.release_prompt(seq)
        if released is None:
            return None
        start, next_ids, rows = released
        return DraftFeed(seq, start, next_ids, 0), rows

    def lend(self, source: SeqState, seq: SeqState, start: int, end: int) -> bool:
        return self.rest.lend(source, seq, start, end)

    def snapshot(self, final: bool = False) -> BudgetStats | None:
        now = time.perf_counter()
        if final or self._snapshot is None or now - self._published >= PUBLISH_EVERY_S:
            self._snapshot, self._published = self.budget.snapshot(), now
        return self._snapshot
