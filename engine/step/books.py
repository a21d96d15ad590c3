"""What a verify does to a sequence, whichever path ran it.

Contract: ``Books.settle`` is the one place a verify's outcome lands on a
sequence: the kept drafts and the bonus token are emitted (stopping at EOS,
``max_tokens`` or a stop string), ``seq_len`` advances by their count, the
grammar advances by what was emitted, and each draft source's figures count
only its own drafts. Both steps call it, so their outputs and counters agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from metrale.engine.sequence import Decode, SeqState
from metrale.engine.spec.copies import copy_in_flight, drafter_accepted
from metrale.engine.spec.grammar import GrammarError
from metrale.engine.stats import RunCounters


class Books:
    """The run's counters and the text decoder, shared by the step's phases."""

    def __init__(self, counters: RunCounters, decode: Decode | None) -> None:
        self.counters = counters
        self.decode = decode

    def settle(self, seq: SeqState, emitted: list[int]) -> None:
        """A sequence's verify: ``emitted`` are its kept drafts and the bonus
        token; counts them, emits them, advances ``seq_len``."""
        accepted, counters = len(emitted) - 1, self.counters
        self._count_drafts(seq, accepted)
        before = len(seq.history)
        seq.emit(emitted, self.decode)
        seq.seq_len += accepted + 1
        seq.set_drafts([], None)
        seq.stats.verifies += 1
        seq.stats.verify_tokens += accepted + 1
        counters.seq_verifies += 1
        counters.verify_tokens += accepted + 1
        counters.generated_tokens += len(seq.history) - before
        self.advance_grammar(seq, seq.history[before:])

    def emit_first(self, seq: SeqState, token: int) -> None:
        """The token sampled after the prompt, outside any verify."""
        seq.emit([token], self.decode)
        self.counters.generated_tokens += 1
        self.advance_grammar(seq, [token])

    def _count_drafts(self, seq: SeqState, accepted: int) -> None:
        """Each source's figures count only its own drafts: the forced run
        first, then the MTP chain after it (with a copy in flight the drafter
        is told nothing of its drafts was accepted)."""
        counters, forced = self.counters, len(seq.forced_drafts)
        if forced:
            counters.forced_proposed += forced
            counters.forced_accepted += min(accepted, forced)
            seq.stats.forced_proposed += forced
            seq.stats.forced_accepted += min(accepted, forced)
        chain = len(seq.pending_drafts) - forced
        if chain > 0 and copy_in_flight(seq) == 0:
            own = drafter_accepted(seq, max(accepted - forced, 0))
            counters.count_mtp(chain, own, first_depth=forced)
            seq.stats.mtp_proposed += chain
            seq.stats.mtp_accepted += own
        seq.forced_drafts = []

    @staticmethod
    def advance_grammar(seq: SeqState, emitted: list[int]) -> None:
        if seq.grammar is not None and not seq.finished:
            try:
                seq.grammar.advance(emitted)
            except GrammarError as exc:
                seq.fail(str(exc))


def constrain(batch: Iterable[SeqState], phase: Callable[[SeqState], None]) -> None:
    """Runs a grammar phase on each constrained sequence of ``batch``; one
    whose grammar cannot go on fails alone."""
    for seq in batch:
        if seq.grammar is not None and not seq.finished:
            try:
                phase(seq)
            except GrammarError as exc:
                seq.fail(str(exc))


def truncate_drafts(seq: SeqState, keep: int) -> None:
    """Cuts a sequence's drafts (and their distributions) to ``keep``."""
    if len(seq.pending_drafts) > keep:
        probs = seq.pending_probs[:keep] if seq.pending_probs is not None else None
        seq.set_drafts(seq.pending_drafts[:keep], probs if keep else None)
