"""Prompt-lookup copies inside the step: take them before the verify, settle
them after.

Owner: the step (``step/``), through its draft policy, which takes copies
(``take_rounds_with_copies``, ``propose_copy``) between the admit and verify
phases; the step settles them right after the verify (``settle_copies``).
Each sequence's prompt lookup (``PromptLookupSeq``: its window, cooldown and
copy in flight) is this module's, kept for as long as the sequence lives
(``lookup_of``).

Invariants:
- A copy replaces ``pending_drafts`` only for a sequence that holds drafts,
  or for any sequence when no MTP chain is drafted (a model without MTP
  layers: chain 0, plain prompt-lookup decoding), or for one whose drafter
  declined to draft this step (no draft likely enough: chain 0,
  ``mtp.declined``).
- A copy is never longer than ``PromptLookupConfig.max_drafts``, the slot's draft
  capacity, nor, in a batch of two or more, 3 tokens (a batched verify takes at
  most 4 rows per sequence).
- Every copy marked in flight by ``take_rounds_with_copies`` is settled by
  ``settle_copies`` in the same step, so no mark outlives its verify.
- While a copy is in flight the MTP drafter is told that none of its drafts
  were accepted (``drafter_accepted``): the verified tokens were not the ones
  it drafted.
- Under a grammar a copy follows the sequence's forced run this step
  (``constrained.forced_of``, always accepted): it is proposed from the
  history with the forced tokens appended, its caps count the forced tokens
  against the slot's capacity, and it is cut at the first token the grammar
  forbids before it is weighed against the chain (``constrained.allowed_copy``);
  should the grammar's check before the verify cut it further, its figures
  follow (``fit_copies``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.engine.sequence import SeqState
from metrale.engine.spec.constrained import allowed_copy, forced_of
from metrale.engine.spec.mtp import declined
from metrale.lookup import (
    Fallback,
    LookupStats,
    PromptLookupConfig,
    PromptLookupSeq,
    ScopeKey,
    SharedLookup,
)

# Drafts in the widest copy a batched verify takes (4 rows per sequence).
BATCHED_COPY_MAX = 3

# Each sequence's prompt lookup, made at its first copy (module doc).
_lookups: weakref.WeakKeyDictionary[SeqState, PromptLookupSeq] = weakref.WeakKeyDictionary()


def lookup_of(seq: SeqState) -> PromptLookupSeq | None:
    """``seq``'s prompt lookup; None before it was first offered a copy."""
    return _lookups.get(seq)


def lookup_for(seq: SeqState, cfg: PromptLookupConfig, longest: bool = False) -> PromptLookupSeq:
    """``seq``'s prompt lookup, made with ``cfg`` (and ``longest``, see
    ``PromptLookupSeq``) if it has none yet."""
    lookup = _lookups.get(seq)
    if lookup is None:
        lookup = _lookups[seq] = PromptLookupSeq(cfg, longest)
    return lookup


@dataclass(frozen=True)
class CopyTaken:
    """A sequence that verifies a copy this step, and where the copy starts:
    its ``seq_len`` before the verify plus the forced drafts ahead of the copy."""

    seq: SeqState
    len_before: int


def copy_in_flight(seq: SeqState) -> int:
    """Length of the copy ``seq`` verifies this step; 0 when its drafts are the MTP's."""
    lookup = _lookups.get(seq)
    return lookup.in_flight if lookup is not None else 0


def drafter_accepted(seq: SeqState, accepted: int) -> int:
    """What the MTP drafter is told was accepted of its own drafts: ``accepted``,
    or 0 when the verified drafts were a copy."""
    return 0 if copy_in_flight(seq) > 0 else accepted


def bucket_copy(copy: list[int]) -> list[int]:
    """Cuts a copy of 4 or more tokens to the largest power of two that fits,
    so long verifies come in few widths (on a GPU each width is a captured
    graph). Shorter copies are kept whole: ``[1..7] -> [1..4]``, ``[1..3]`` stays."""
    return copy[: bucket_width(len(copy))]


def bucket_width(length: int) -> int:
    """The width ``bucket_copy`` verifies a copy of ``length`` tokens at."""
    return 1 << (length.bit_length() - 1) if length >= 4 else length


def take_rounds_with_copies(
    seqs: Sequence[SeqState],
    cfg: PromptLookupConfig | None,
    shared: SharedLookup | None,
    ladder_nd: int,
    mtp_drafting: bool,
) -> list[CopyTaken]:
    """For each of ``seqs`` (the sequences this step verifies) proposes a copy
    and, when it is at least as long as the drafter's chain this step
    (``min(pending drafts, ladder_nd)``), makes it the sequence's drafts. A
    shorter copy would verify fewer tokens than the chain it displaces, so it
    is dropped, and the window is never asked for less than that chain.
    ``mtp_drafting`` is False when no MTP chain is drafted (no MTP layers, or
    the drafter is off): every sequence is then eligible with chain 0.

    A no-op when prompt lookup is off or more sequences run than
    ``cfg.max_seqs``.
    """
    if cfg is None or not copies_on(cfg, len(seqs)):
        return []
    path_cap = copy_path_cap(cfg, len(seqs))
    took: list[CopyTaken] = []
    for seq in seqs:
        if mtp_drafting and not seq.pending_drafts and not declined(seq):
            continue
        chain = min(len(seq.pending_drafts), ladder_nd)
        copy = propose_copy(seq, cfg, shared, path_cap, chain)
        if copy is None:
            continue
        if len(copy) < chain:
            lookup_for(seq, cfg).abandon()
            continue
        seq.set_drafts(copy)
        took.append(CopyTaken(seq, seq.seq_len + len(forced_of(seq))))
    return took


def copies_on(cfg: PromptLookupConfig | None, running: int) -> bool:
    """Whether a verify of ``running`` sequences takes copies: lookup is on
    and no more than ``cfg.max_seqs`` run."""
    return cfg is not None and running <= cfg.max_seqs


def copy_path_cap(cfg: PromptLookupConfig, running: int) -> int:
    """The longest copy a verify of ``running`` sequences takes: a lone one
    verifies a copy of any length in one pass; in a batch a copy is cut to
    the 4-row verify."""
    return cfg.max_drafts if running == 1 else BATCHED_COPY_MAX


def slot_copy_cap(seq: SeqState, cfg: PromptLookupConfig, path_cap: int) -> int:
    """The longest copy ``seq`` may verify after its forced run: by
    ``max_drafts``, the slot's draft capacity and the verify's ``path_cap``."""
    return min(cfg.max_drafts, seq.draft_capacity() - len(forced_of(seq)), path_cap)


def propose_copy(
    seq: SeqState,
    cfg: PromptLookupConfig,
    shared: SharedLookup | None,
    path_cap: int,
    chain: int,
    longest: bool = False,
) -> list[int] | None:
    """A copy for ``seq`` after its forced run, in flight at its final length
    (cut to what the grammar allows and to a bucketed width), never asked for
    less than ``chain`` tokens; None when there is none or no room for one."""
    forced = forced_of(seq)
    slot_cap = slot_copy_cap(seq, cfg, path_cap)
    if slot_cap < max(chain, 1):
        return None
    lookup = lookup_for(seq, cfg, longest)
    cap = slot_cap if longest else min(slot_cap, max(lookup.window, chain))
    # With no own match, the finished requests of this scope may supply one.
    fallback = _scope_fallback(shared, seq.scope)
    history = [*seq.history, *forced] if forced else seq.history
    copy = lookup.propose_with(history, cap, fallback)
    if copy is None:
        return None
    copy = bucket_copy(allowed_copy(seq, copy))
    if not copy:
        lookup.abandon()
        return None
    lookup.cut_in_flight(len(copy))
    return copy


def _scope_fallback(shared: SharedLookup | None, scope: ScopeKey | None) -> Fallback | None:
    if shared is None or scope is None:
        return None

    def propose(history: Sequence[int], max_len: int) -> list[int] | None:
        return shared.propose(scope, history, max_len)

    return propose


def fit_copies(took: Sequence[CopyTaken]) -> None:
    """Keeps each taken copy's figures true after the grammar's check before
    the verify (``constrained.check_drafts``): copies were cut to what the
    grammar allows when taken, so this cuts one only should the two checks
    ever disagree."""
    for taken in took:
        seq, lookup = taken.seq, _lookups.get(taken.seq)
        left = len(seq.pending_drafts) - len(forced_of(seq))
        if lookup is None or lookup.in_flight <= left:
            continue
        if left > 0:
            lookup.cut_in_flight(left)
        else:
            lookup.abandon()


def settle_copies(
    took: Sequence[CopyTaken], shared: SharedLookup | None, counters: LookupStats
) -> None:
    """Settles the copies ``take_rounds_with_copies`` put in flight. A verify
    advances ``seq_len`` by the accepted drafts plus one, so the accepted count
    is read from that advance; a sequence that did not advance settles as a miss.
    """
    for taken in took:
        seq, lookup = taken.seq, _lookups.get(taken.seq)
        if lookup is None:
            continue
        accepted = max(seq.seq_len - taken.len_before - 1, 0)
        was_shared = lookup.in_flight_shared
        proposed = lookup.settle(accepted)
        counters.observe(proposed, accepted, was_shared)
        seq.stats.prompt_lookup.observe(proposed, accepted, was_shared)
        if was_shared and shared is not None:
            shared.record(proposed, accepted)
