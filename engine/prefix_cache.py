"""Prompt prefixes read once: a new request starts from the longest prefix a slot holds.

Contract: a slot's KV cache keeps what its last sequence wrote until another
sequence writes over it, so the slots themselves are the cache, bounded by
the KV budget with no memory of their own:

- A slot holds its last sequence's tokens at positions ``0..n-1``, where
  ``n`` is the sequence's final rows: ``seq_len`` (cut to its history after
  a stop string), and below ``head_rows`` where MTP modules lag the main
  cache. A running sequence's content grows step by step; a finished one's
  stays until its slot is taken.
- ``admit`` gives a new request its slot and the positions it reuses. The
  source is the slot sharing the longest prefix with the prompt: a running
  sequence, one admitted this step, or a finished one. Reused are
  ``shared`` positions, at most ``prompt_len - 1`` (the prefill still reads
  the last prompt token, whose logits choose the first output token); the
  MTP modules' rows only below ``shared - lag`` (``Reuse.lagged``), where
  ``lag`` is the modules' reach: module ``k``'s row ``p`` reads token
  ``p+1+k``, which past the shared prefix is the source's, not this
  prompt's. Fewer than ``MIN_REUSE`` positions are not worth a copy.
- Lent rows: a module row is the main model's hidden row at ``p`` (the same
  for both prompts below ``shared``) and token ``p+1``. Where the source's
  draft policy still holds those hidden rows back from the head, from
  where its modules' rows end (``Lender``, ``DraftPolicy.lend``), the
  request takes them, with its own tokens, as rows its own chain holds:
  it reuses all ``shared`` positions, and the head reads the prefix only
  for a chain that drafts. Otherwise the copy is ``shared - lag``
  positions, once the source's modules hold them.
- A free slot whose own content is the best source is taken as is: nothing
  is copied (on the device step only while it is the lowest free slot). Otherwise the request takes the least recently used free slot
  (the device step, whose batch is slots ``0..B-1``, the lowest) and its
  positions are copied from the source (``CopiesPrefixes.copy_prefix``),
  once the source's final rows reach them: a source still prefilling the
  prefix is waited for (``attached``), so lines admitted together that share
  a prefix have it prefilled once, by the first of them. A source counts its
  waiters (``SeqState.waited_on``), and a draft policy holds back the MTP
  rows of a source someone waits for only where it can lend them. Slots in
  use are never taken, so a running sequence's rows are never evicted.
- ``ready`` (each step, before the step runs and before new requests take
  slots) copies for every waiting request whose source got far enough, or
  ended (then as far as it got), and hands it back to be admitted to the
  step's path; ``seq.cached`` records what it reused, ``seq.head_floor``
  below which its modules' rows were copied.

Exactness: the copied rows are the ones this prompt's own prefill would
write (same tokens at the same positions), computed in a forward that
batched them differently, as any two plain runs of the engine may; the
sampling noise is keyed by position, never by slot. A model with gated
DeltaNet layers keeps its recurrent state at each sequence's end only, so
nothing is reused there (``copies_prefixes`` is false; ``info`` says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from metrale.engine.runtime.model import CopiesPrefixes, Model, MtpModule
from metrale.engine.sequence import SeqState

# Fewer shared positions than this are not worth waiting for or copying.
MIN_REUSE = 8


def copiers(model: Model, mtp: Sequence[MtpModule]) -> list[CopiesPrefixes] | None:
    """The main model and each MTP module, where every one of them can copy
    a prefix into another slot; None where any cannot (no reuse at all)."""
    found = [c for c in (model, *mtp) if isinstance(c, CopiesPrefixes) and c.copies_prefixes]
    return found if len(found) == 1 + len(mtp) else None


@dataclass(frozen=True)
class Reuse:
    """The ``length`` leading rows a request reuses from ``source``'s slot,
    and waits for while ``source`` has not written them yet (``ready``);
    the MTP modules' rows only below ``lagged`` (module doc)."""

    source: SeqState
    length: int
    lagged: int


class Lender(Protocol):
    """Where the MTP rows a source held back from the head come from
    (``DraftPolicy.lend``)."""

    def lend(self, source: SeqState, seq: SeqState, start: int, end: int) -> bool: ...


class PrefixCache:
    """The slots as a prefix cache (module doc)."""

    def __init__(
        self,
        copiers: Sequence[CopiesPrefixes],
        num_slots: int,
        lag: int,
        lowest_first: bool,
        lender: Lender | None = None,
    ) -> None:
        """``copiers``: the main model, then each MTP module whose cache rows
        travel with it; ``lag``: the MTP modules' reach; ``lender``: the rows
        a source held back from the head (module doc)."""
        self.copiers = list(copiers)
        self.lag = lag
        self.lender = lender
        self.lowest_first = lowest_first
        self.content: list[SeqState | None] = [None] * num_slots
        self.used = [0] * num_slots  # when each slot was last read or written
        self.clock = 0
        self.attached: dict[int, Reuse] = {}  # by the waiting sequence's id()
        self.waiting: list[SeqState] = []  # in admission order

    def choose_slot(self, prompt: Sequence[int], free: list[int]) -> tuple[int, Reuse | None]:
        """The slot a request with ``prompt`` takes from ``free`` (removed
        from it), and the prefix it reuses (None: none)."""
        self.clock += 1
        best, best_shared = None, 0
        for slot, held in enumerate(self.content):
            if held is None:
                continue
            shared = _shared(prompt, held.history, _reach(held))
            if shared > best_shared or (shared == best_shared and slot in free):
                best, best_shared = slot, shared
        lagged = self._reuse(best_shared, len(prompt))
        if lagged == 0:
            best = None
        if best is not None and best in free and not (self.lowest_first and best != min(free)):
            slot = best
        elif self.lowest_first:
            slot = min(free)
        else:
            slot = min(free, key=lambda s: self.used[s])
        free.remove(slot)
        if best is None:
            return slot, None
        self.used[best] = self.clock
        source = self.content[best]
        assert source is not None
        return slot, Reuse(source, min(best_shared, len(prompt) - 1), lagged)

    def admit(self, seq: SeqState, reuse: Reuse | None) -> bool:
        """Takes ``seq`` into its slot, reusing the prefix ``choose_slot``
        found; true when it may go to the step now, false when it waits for
        its source (``ready`` hands it back)."""
        previous = self.content[seq.slot]
        self.content[seq.slot] = seq
        self.used[seq.slot] = self.clock
        if reuse is None:
            return True
        source = reuse.source
        if source is previous:  # its own slot holds the prefix: nothing to copy
            self._start(seq, min(reuse.lagged, _final_rows(source)))
            return True
        self.attached[id(seq)] = reuse
        self.waiting.append(seq)
        source.waited_on += 1
        return False

    def ready(self) -> list[SeqState]:
        """Copies for every waiting sequence whose source holds its rows or
        has ended; returns them, in admission order, for the step's path."""
        done = []
        for seq in self.waiting:
            reuse = self.attached[id(seq)]
            source = reuse.source
            if not self._lent(seq, reuse):
                held = _final_rows(source)
                if held < reuse.lagged and not source.finished:
                    continue
                length = min(reuse.lagged, held)
                if length >= MIN_REUSE:
                    self._copy(source, seq, length)
                    self._start(seq, length)
            del self.attached[id(seq)]
            source.waited_on -= 1
            done.append(seq)
        self.waiting = [s for s in self.waiting if id(s) in self.attached]
        return done

    def _lent(self, seq: SeqState, reuse: Reuse) -> bool:
        """Copies the main model's rows of ``reuse`` once ``source`` wrote
        them, where the MTP rows it lacks are ones the source held back from
        the head and lends ``seq`` (module doc); false where they are not."""
        source = reuse.source
        if self.lender is None or source.head_rows is None or source.finished:
            return False
        if min(source.seq_len, len(source.history)) < reuse.length:
            return False
        start = min(source.head_rows, reuse.lagged)
        if not self.lender.lend(source, seq, start, reuse.length):
            return False
        self._copy(source, seq, reuse.length)
        self._start(seq, reuse.length, head=start)
        return True

    def _copy(self, source: SeqState, seq: SeqState, length: int) -> None:
        for copier in self.copiers:
            copier.copy_prefix(source.slot, seq.slot, length)

    def _reuse(self, shared: int, prompt_len: int) -> int:
        length = min(shared - self.lag, prompt_len - 1)
        return length if length >= MIN_REUSE else 0

    @staticmethod
    def _start(seq: SeqState, length: int, head: int | None = None) -> None:
        """``seq`` reuses ``length`` positions, its MTP modules' rows below
        ``head`` (all ``length`` unless lent rows follow them)."""
        head = length if head is None else head
        seq.seq_len = seq.cached = length
        seq.head_floor = head
        if seq.head_rows is not None:
            seq.head_rows = head


def _reach(seq: SeqState) -> int:
    """Positions ``seq``'s slot will hold: all its tokens while it runs (or
    waits), its final rows once it has ended."""
    return _final_rows(seq) if seq.finished else len(seq.history)


def _final_rows(seq: SeqState) -> int:
    """Positions of ``seq``'s slot that hold its tokens for good (module doc)."""
    rows = min(seq.seq_len, len(seq.history))
    return rows if seq.head_rows is None else min(rows, seq.head_rows)


def _shared(prompt: Sequence[int], history: Sequence[int], limit: int) -> int:
    """How many leading tokens ``prompt`` shares with ``history[:limit]``;
    whole prefixes compare at C speed, then one token at a time."""
    most = min(len(prompt), len(history), limit)
    if list(prompt[:most]) == list(history[:most]):
        return most
    low, high = 0, most  # prompt[:low] matches, prompt[:high] does not
    while high - low > 1:
        mid = (low + high) // 2
        if list(prompt[low:mid]) == history[low:mid]:
            low = mid
        else:
            high = mid
    return low
