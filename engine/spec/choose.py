"""The draft phase under ``--draft-policy auto``: every source offers its
drafts, the budget picks one source and a prefix per sequence, and after the
verify every offer is scored.

Owner: the engine loop (``engine.py``), in place of the fixed copy rule
(``copies.take_rounds_with_copies``), between the admit and verify phases;
``score_offers`` right after the verify.

A line's own copies come from the longest agreement
(``PromptLookupSeq(longest=True)``): the earlier occurrence of its last
token whose preceding tokens agree longest with its own, however short the
agreement, offered up to the copy caps without the copy window; the plan
prices each by its agreement (``budget.py``). The fixed rule's n-gram,
``min_match`` (a shorter agreement asks the shared cache first), window and
miss cooldown guard a rule that cannot price a copy; here the estimates do.
Replayed on the greedy outputs of the ten benchmark sets at one sequence
(8 lines each, 8,901 tokens; every copy verified at 8 drafts), the fixed
rule's copies (8 tokens agreeing at the latest occurrence of a 4-gram, with
its window and cooldown) would have been accepted for 1,638 tokens, the
longest agreement's for 4,109.

Invariants (the fixed rule's, kept):
- A copy is never longer than ``PromptLookupConfig.max_drafts``, the slot's
  draft capacity, nor, in a batch of two or more, 3 tokens; an MTP chain
  never longer than ``chain_cap``; copies are off when more than
  ``max_seqs`` sequences run.
- Every copy proposed is either verified, marked in flight at the length the
  plan chose and settled by ``settle_copies`` in the same step, or abandoned
  before the verify.
- A verified copy leaves the MTP drafter told that none of its drafts were
  accepted (``copies.drafter_accepted``): the rows were not its drafts.
- A grammar's forced drafts are always verified, first; the chosen drafts
  follow them, and ``check_drafts`` then cuts at the first forbidden one.

The drain: once the request stream has ended and nothing waits, the run
ends when its last line does. A line that would finish before that line
even if it drafted nothing more gains the wall time nothing by drafting:
it still finishes first, and each row it takes is paid for now to save a
row later. So ``lines_ahead`` names the lines whose tokens left to write
(by ``max_tokens`` and slot room) are fewer than the steps the slowest line
still needs: the most, over every line, of its tokens left over the tokens
a verify has made it so far (a line still reading its prompt has made none
and needs a step a token). Those verify no MTP draft that step, and their
chains rest, holding their rows, without looks; the others draft as the
plan says. Copies stay offered to every line, and the plan prices them as
ever: a copy costs no head forward, and a line that ends at end of
sequence long before its ``max_tokens`` is not ahead of anything, though
the drain counts it so (README, "The defaults choose", has the figures).
A line a token or two ahead of the others is not among them while drafts
pay: stopping it would make it the last. A line that ends on its own (end
of sequence, a stop string) cannot be told apart early; it counts as having
its ``max_tokens`` left. Once one line of the run has ended on its own, the
others' tokens left are no guide to which ends last (the line that has
written most, held back as ahead, may well be the longest), and the drain
stops for the rest of the run (``Engine._ahead``); the drain was made for
a batch whose lines all run to ``max_tokens``. (On JSON rewrites at 16
lines, whose answers end at end of sequence, the two rules came out alike
in one same-run comparison.) While the stream runs (or requests wait)
every token counts alike, as before. Whether a line drafts depends only on what
was emitted before the step, never on a draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metrale.engine.sequence import SeqState
from metrale.engine.spec.budget import Candidates, DraftBudget, tokens_left
from metrale.engine.spec.copies import (
    CopyTaken,
    bucket_width,
    copy_path_cap,
    propose_copy,
    slot_copy_cap,
)
from metrale.lookup import PromptLookupConfig, SharedLookup


@dataclass(frozen=True)
class Offer:
    """What a sequence was offered this step, for scoring after the verify."""

    seq: SeqState
    source: str  # "mtp", "copy" or "none"
    drafts: int  # of the chosen source
    chain: list[int]
    copy: list[int]
    agreement: int  # the copy's agreement (``PromptLookupSeq.agreement``)


def take_planned_drafts(
    batch: Sequence[SeqState],
    budget: DraftBudget,
    cfg: PromptLookupConfig | None,
    shared: SharedLookup | None,
    ahead: set[int] | frozenset[int] = frozenset(),
) -> tuple[list[CopyTaken], list[Offer]]:
    """Sets each sequence's drafts to the plan's choice (module doc); the
    sequences whose slots are in ``ahead`` get no MTP draft. Runs after
    ``take_forced`` and before ``check_drafts``."""
    copies_on = cfg is not None and len(batch) <= cfg.max_seqs
    path_cap = copy_path_cap(cfg, len(batch)) if cfg is not None else 0
    candidates: list[Candidates] = []
    for seq in batch:
        own = budget.for_seq(seq)
        # A forced run that matched the chain's first drafts stands in their
        # place (``take_forced``): the chain's keys move past them too.
        offset = len(seq.forced_drafts) if seq.forced_drafts and seq.pending_drafts else 0
        own.chain_keys = own.chain_keys[offset : offset + len(seq.pending_drafts)]
        chain = list(seq.pending_drafts[: len(own.chain_keys)])
        copy = None
        if seq.slot in ahead:
            chain = []
        if copies_on and cfg is not None:
            copy = propose_copy(seq, cfg, shared, path_cap, 0, longest=True)
        sure = 1 + len(seq.forced_drafts)
        agreement = seq.prompt_lookup.agreement if copy and seq.prompt_lookup else 0
        candidates.append(Candidates(seq, sure, chain, copy or [], agreement))
    picked = budget.plan(candidates)
    took: list[CopyTaken] = []
    offers: list[Offer] = []
    for c, (source, n) in zip(candidates, picked, strict=True):
        seq, lookup = c.seq, c.seq.prompt_lookup
        if source == "copy":
            assert lookup is not None
            lookup.cut_in_flight(n)
            seq.set_drafts(c.copy[:n], None)
            took.append(CopyTaken(seq, seq.seq_len + len(seq.forced_drafts)))
        else:
            if c.copy and lookup is not None:
                lookup.abandon()
            probs = seq.pending_probs
            seq.set_drafts(c.chain[:n], probs[:n] if probs is not None and n else None)
        offers.append(Offer(seq, source, n, c.chain, c.copy, c.agreement))
    return took, offers


def peek_copy(seq: SeqState, cfg: PromptLookupConfig | None, running: int) -> tuple[int, int]:
    """``(length, agreement)`` of the copy ``seq`` would be offered next
    with ``running`` sequences, without proposing it (``PromptLookupSeq.peek``);
    ``(0, 0)`` where copies are off, under a grammar (its forced run comes
    first), or before the line's lookup exists."""
    lookup = seq.prompt_lookup
    if cfg is None or running > cfg.max_seqs or lookup is None or seq.grammar is not None:
        return 0, 0
    length, agreement = lookup.peek(
        seq.history, slot_copy_cap(seq, cfg, copy_path_cap(cfg, running))
    )
    return bucket_width(length) if length else 0, agreement


def lines_ahead(decoding: Sequence[SeqState], prefilling: Sequence[SeqState]) -> set[int]:
    """The slots of the ``decoding`` lines that would finish before the
    slowest line, ``prefilling`` ones included, without another draft
    (module doc: the drain); none while a single line is left."""
    lines = [*decoding, *prefilling]
    if len(lines) < 2:
        return set()
    slowest = max(tokens_left(s) / max(_tokens_a_verify(s), 1.0) for s in lines)
    return {s.slot for s in decoding if tokens_left(s) < slowest}


def _tokens_a_verify(seq: SeqState) -> float:
    stats = seq.stats
    return stats.verify_tokens / stats.verifies if stats.verifies else 1.0


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
            budget.observe(seq, tokens, offer.chain, offer.copy, offer.agreement)
        elif offer.source != "none":
            budget.observe_counts(seq, offer.source, offer.drafts, len(tokens) - 1, offer.agreement)
