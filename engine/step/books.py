"""What both step paths share: their set-up, the prefill's chunk, the drafts
phase, and what a verify does to a sequence.

Contract: ``Books.settle`` is the one place a verify's outcome lands on a
sequence: the kept drafts and the bonus token are emitted (stopping at EOS,
``max_tokens`` or a stop string), ``seq_len`` advances by their count, the
grammar advances by what was emitted, and each draft source's figures count
only its own drafts. Both steps call it, so their outputs and counters agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from metrale.engine.api import TokenLogprob
from metrale.engine.runtime.model import Model, Segment
from metrale.engine.sequence import Decode, SeqState
from metrale.engine.spec.constrained import clear_forced, forced_of, take_forced
from metrale.engine.spec.copies import CopyTaken, copy_in_flight, drafter_accepted
from metrale.engine.spec.grammar import GrammarError
from metrale.engine.spec.mtp import MtpDrafter
from metrale.engine.spec.policy import DraftPolicy
from metrale.engine.stats import RunCounters
from metrale.lookup import LookupStats, SharedLookup

if TYPE_CHECKING:
    from metrale.engine.step import Queues


@dataclass
class StepSetup:
    """What either step is built from (``Engine`` makes it once)."""

    model: Model
    policy: DraftPolicy
    drafter: MtpDrafter | None  # None: no MTP modules, MTP off, or the device step
    books: Books
    copies: LookupStats  # the run's copy figures
    shared: SharedLookup | None
    prefill_chunk: int
    forced_drafts: bool


class Books:
    """The run's counters and the text decoder, shared by the step's phases."""

    def __init__(self, counters: RunCounters, decode: Decode | None) -> None:
        self.counters = counters
        self.decode = decode

    def settle(
        self, seq: SeqState, emitted: list[int], logprobs: list[TokenLogprob] | None = None
    ) -> None:
        """A sequence's verify: ``emitted`` are its kept drafts and the bonus
        token (``logprobs`` theirs, when the request asked); counts them,
        emits them, advances ``seq_len``."""
        accepted, counters = len(emitted) - 1, self.counters
        self._count_drafts(seq, accepted)
        before = len(seq.history)
        seq.emit(emitted, self.decode, logprobs)
        seq.seq_len += accepted + 1
        seq.set_drafts([])
        seq.stats.verifies += 1
        seq.stats.verify_tokens += accepted + 1
        counters.seq_verifies += 1
        counters.verify_tokens += accepted + 1
        counters.generated_tokens += len(seq.history) - before
        self.advance_grammar(seq, seq.history[before:])

    def emit_first(self, seq: SeqState, token: int, logprob: TokenLogprob | None = None) -> None:
        """The token sampled after the prompt, outside any verify."""
        seq.emit([token], self.decode, [logprob] if logprob is not None else None)
        self.counters.generated_tokens += 1
        self.advance_grammar(seq, [token])

    def _count_drafts(self, seq: SeqState, accepted: int) -> None:
        """Each source's figures count only its own drafts: the forced run
        first, then the MTP chain after it (with a copy in flight the drafter
        is told nothing of its drafts was accepted)."""
        counters, forced = self.counters, len(forced_of(seq))
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
        clear_forced(seq)

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
    """Cuts a sequence's drafts to ``keep``."""
    if len(seq.pending_drafts) > keep:
        seq.set_drafts(seq.pending_drafts[:keep])


def prompt_chunk(
    prefilling: Iterable[SeqState], budget: int, short: int
) -> tuple[list[Segment], list[SeqState]]:
    """The prefill's next chunk: up to ``budget`` prompt tokens, oldest
    request first, each prompt read up to ``short`` tokens before its end."""
    segments, chunked = [], []
    for seq in prefilling:
        if budget == 0:
            break
        take = min(budget, seq.prompt_len - short - seq.seq_len)
        segments.append(Segment(seq.slot, seq.seq_len, seq.history[seq.seq_len :][:take]))
        chunked.append(seq)
        budget -= take
    return segments, chunked


def take_drafts(
    policy: DraftPolicy, batch: list[SeqState], queues: Queues, forced_drafts: bool
) -> list[CopyTaken]:
    """The drafts phase: a chain drafted for a smaller batch is cut to the
    policy's cap, a grammar's forced run comes first, then the policy sets
    each sequence's drafts; returns the copies it put in flight."""
    cap = policy.chain_cap(len(batch))
    for seq in batch:  # the batch may have grown since these were drafted
        truncate_drafts(seq, min(cap, seq.draft_capacity()))
    constrain(batch, lambda seq: take_forced(seq, forced_drafts))
    return policy.take_drafts(batch, queues)
