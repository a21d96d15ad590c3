"""Draft policies: how many drafts each sequence verifies, and from which source.

Contract: a step asks its ``DraftPolicy`` at fixed points and never branches
on which policy it holds:

1. ``chain_cap(running)`` before the drafts are taken: a chain drafted for a
   smaller batch is cut to it (the step does the cut, then the grammar's
   forced run, ``constrained.take_forced``);
2. ``take_drafts(batch, queues)``: sets each sequence's ``pending_drafts``
   after its forced run (a copy in place of the chain, a prefix of the
   chain, or nothing) and returns the copies it put in flight, which the
   step settles right after the verify (``copies.settle_copies``);
3. ``verified(times)`` after the verify: its width and time, and what each
   slot produced (``StepTimes.produced``);
4. the MTP head after the verify: on the host step ``before_head`` once,
   then ``head_feed`` per sequence (a feed for the drafter, or None while
   the policy holds the rows back), and ``head_ran`` with what the drafter
   spent, and in a prefill ``prompt_feed`` per chunk; on the device step,
   which feeds the head every verified row and drafts on the device,
   ``chain_drafted`` per sequence with the chain it read back;
5. ``end_step(times)`` once the step is over.

The draft sources are ``copies.py`` (prompt-lookup copies), ``mtp.py`` (the
MTP chain) and ``constrained.py`` (a grammar's forced tokens); a policy only
chooses among what they offer, so every policy is exact: drafts change how
many tokens a verify keeps, never which.

``FixedPolicy`` is the seed's rule: an MTP chain as long as the ladder says
for the batch, replaced by a copy at least as long. ``AutoPolicy``
(``auto.py``) prices every draft by its expected acceptance and the
measured cost of its row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from metrale.engine.config import MtpLadder
from metrale.engine.sequence import SeqState
from metrale.engine.spec.copies import CopyTaken, take_rounds_with_copies
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter
from metrale.engine.stats import BudgetStats
from metrale.lookup import PromptLookupConfig, SharedLookup

if TYPE_CHECKING:  # the step imports the policies
    from metrale.engine.step import Queues, StepTimes

Feed = tuple[DraftFeed, torch.Tensor]  # a drafter feed and its hidden rows


class DraftPolicy(Protocol):
    """What a step asks before and after its verify (module doc)."""

    name: str  # "fixed" or "auto"

    def clock(self) -> float: ...

    def chain_cap(self, running: int) -> int: ...

    def chain_len(self, seq: SeqState, running: int) -> int: ...

    def take_drafts(self, batch: list[SeqState], queues: Queues) -> list[CopyTaken]: ...

    def verified(self, times: StepTimes) -> None: ...

    def prompt_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,  # [len(next_ids), hidden_size]
        complete: bool,
        queues: Queues,
    ) -> Feed | None: ...

    def before_head(self, batch: Sequence[SeqState], queues: Queues) -> None: ...

    def head_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,  # [len(next_ids), hidden_size]
        running: int,
    ) -> Feed | None: ...

    def head_ran(self, feeds: Sequence[DraftFeed], forwards: int, seconds: float) -> None: ...

    def chain_drafted(self, seq: SeqState, drafts: list[int]) -> None:
        """The device step drafted ``drafts`` as ``seq``'s next chain (on the
        host the drafter reports each draft as it makes it)."""
        ...

    def end_step(self, times: StepTimes) -> None: ...

    def calibrate(self, model: Any, drafter: MtpDrafter | None, slots: int, max_len: int) -> None:
        """Warm-starts what the policy measures, before a run."""
        ...

    def save(self) -> None:
        """Keeps what the policy measured for the next run."""
        ...

    def ended(self, seq: SeqState) -> Feed | None:
        """A feed (drafting nothing) that brings the MTP head up to the
        prompt rows an ended ``seq`` held back from it, so that its slot can
        serve the prompt's prefix to later requests (``prefix_cache.py``
        reuses only the rows every module holds); None when there are none."""
        ...

    def lend(self, source: SeqState, seq: SeqState, start: int, end: int) -> bool:
        """Hands ``seq``, which reuses ``source``'s prompt prefix, the rows
        ``start..end-1`` that ``source``'s chain holds back from the MTP head
        (``prefix_cache.py``): ``seq``'s chain holds them in turn, with its
        own tokens, and the head reads them only if that chain drafts. False
        where ``source`` holds no such rows."""
        ...

    def snapshot(self, final: bool = False) -> BudgetStats | None:
        """The policy's figures for the stats snapshot; None where it keeps none."""
        ...

    def make_drafter(self, modules: Sequence[Any], min_prob: float) -> MtpDrafter:
        """The MTP drafter this policy drafts with."""
        ...


class FixedPolicy:
    """The seed's rule (module doc): chains by the ladder, copies that are at
    least as long replace them (``copies.take_rounds_with_copies``)."""

    name = "fixed"

    def __init__(
        self,
        ladder: MtpLadder,
        has_mtp: bool,
        lookup: PromptLookupConfig | None,
        shared: SharedLookup | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ladder, self.has_mtp = ladder, has_mtp
        self.lookup, self.shared = lookup, shared
        self.clock = clock

    def chain_cap(self, running: int) -> int:
        return self.ladder.drafts_for(running) if self.has_mtp else 0

    def chain_len(self, seq: SeqState, running: int) -> int:
        return min(self.chain_cap(max(running, 1)), seq.draft_capacity())

    def take_drafts(self, batch: list[SeqState], queues: Queues) -> list[CopyTaken]:
        cap = self.chain_cap(len(batch))
        mtp_drafting = self.has_mtp and cap > 0
        return take_rounds_with_copies(batch, self.lookup, self.shared, cap, mtp_drafting)

    def verified(self, times: StepTimes) -> None:
        pass

    def prompt_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,
        complete: bool,
        queues: Queues,
    ) -> Feed | None:
        num_drafts = self.chain_len(seq, len(queues.decoding)) if complete else 0
        return DraftFeed(seq, start, next_ids, num_drafts), rows

    def before_head(self, batch: Sequence[SeqState], queues: Queues) -> None:
        pass

    def head_feed(
        self, seq: SeqState, start: int, next_ids: list[int], rows: torch.Tensor, running: int
    ) -> Feed | None:
        return DraftFeed(seq, start, next_ids, self.chain_len(seq, running)), rows

    def head_ran(self, feeds: Sequence[DraftFeed], forwards: int, seconds: float) -> None:
        pass

    def chain_drafted(self, seq: SeqState, drafts: list[int]) -> None:
        pass

    def end_step(self, times: StepTimes) -> None:
        pass

    def calibrate(self, model: Any, drafter: MtpDrafter | None, slots: int, max_len: int) -> None:
        pass

    def save(self) -> None:
        pass

    def ended(self, seq: SeqState) -> Feed | None:
        return None

    def lend(self, source: SeqState, seq: SeqState, start: int, end: int) -> bool:
        return False

    def snapshot(self, final: bool = False) -> BudgetStats | None:
        return None

    def make_drafter(self, modules: Sequence[Any], min_prob: float) -> MtpDrafter:
        return MtpDrafter(list(modules), min_prob)
