"""The MTP drafter: feeds verified positions to the MTP modules and drafts from them.

Contract: each module keeps its own KV cache in the same slots as the main
model. Module ``k`` (its depth, 0-based) at source row ``p`` takes a hidden
row and token ``p+1+k`` and predicts token ``p+2+k``; module 0 reads the main
model's pre-norm hidden ``h_p``, module ``k > 0`` module ``k-1``'s output at
row ``p`` (the norm handed on, and why the row is rotated at ``p`` rather
than at ``p+k``, are the module's business, ``runtime/mtp.py``); a segment
addresses rows, so module ``k``'s cache position ``p`` is row ``p``. For a
decoding sequence with
``seq_len == L`` (tokens ``0..L-1`` in the main cache, ``last_token`` is token
``L``) module ``k``'s cache holds rows ``0..L-1-k``: every row whose token is
final, fed from final hidden rows. Row ``L-1`` of module 0 (token
``last_token``) gives the first draft ``d_1``; module ``k`` at row ``L-1``,
reading ``d_k``, gives ``d_{k+1}``. Module ``k`` therefore also runs rows
``L-k..L-1``, which read the drafts ``d_1..d_k`` (as transformers' ``MtpModel``
runs each layer over the whole window shifted by one).

Rows a module computed from drafts are never kept: after a verify that
advanced the sequence from ``L`` to ``L'``, the engine loop feeds rows
``L..L'-1`` to module 0 again from the verify's hidden rows, and module ``k``
then runs rows ``L-k..L'-1-k`` with the same tokens, overwriting whatever its
draft rows wrote. So every module is trimmed as if none of the drafts were
accepted, in every case, which keeps each on the inputs it was trained on
(final hidden states, never ones computed from a draft); whether the verified
drafts were the drafter's own only decides which figures count them (see
``copies.py``). Module ``k``'s first row of a step, ``L-k``, reads module
``k-1``'s output at that row, which module ``k-1`` computed a step earlier as
the last row it was fed: the drafter keeps that one row per slot and module
(``_last``) rather than recompute it, which would need the main
model's hidden rows of the earlier step too (transformers keeps every one of
them and re-runs the whole stack on the last positions instead).

More drafts asked for than modules: a lone module is chained, as before:
each further draft feeds it its own output hidden and its own previous draft
at the next position (vLLM's default MTP proposer reuses one layer the same
way, warning that acceptance drops). With several modules the drafts stop at
one per module: transformers' ``MtpModel`` drafts exactly ``num_mtp_layers``
tokens, and vLLM's ``MultiLayerEagleProposer``, which runs the layers in
order, sets ``num_speculative_tokens`` to the number of layers. A module
reused at a depth it was not trained for is rarely right.

Sampled drafts: a sampled request's draft at a position is drawn from the
module's distribution, shaped like the target (temperature, top-k, top-p),
with the request's noise key at that position (``sampling.sample_rows``):
the same noise the verify draws the target's token with, so the draft is
that token wherever the module's distribution is close to the model's.

Confidence: a chain stops at the first position where the module's
probability of its draft is below ``min_prob`` (greedy: its top
probability; sampled: that of the drawn token under the shaped
distribution). Each draft costs a verify row and each further position a
module forward, and an unsure draft is rarely accepted. Under a draft
budget (``budget.py``) no draft is held back for its confidence: the
budget decides how deep each chain goes and which prefix a verify checks.
Where a chain stops never matters to the output: acceptance compares drafts
with the tokens the verify chooses, whatever made them. A sequence left without drafts this way
is marked declined (``declined``): it may take a prompt-lookup copy as a
model without MTP would (chain 0). The mark is this module's, kept per
sequence for as long as the sequence lives; a step that drafts on the device
sets it through ``mark_declined``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from metrale.engine.runtime.model import MtpModule, Segment
from metrale.engine.sampling import sample_at, target_probs
from metrale.engine.sequence import SeqState

if TYPE_CHECKING:
    from metrale.engine.spec.budget import DraftBudget


# The sequences whose chain declined at its last drafting (module doc).
_declined: weakref.WeakSet[SeqState] = weakref.WeakSet()


def declined(seq: SeqState) -> bool:
    """Whether ``seq``'s chain found no draft likely enough, or has none yet
    where a step said so: a copy may stand in for it (``copies.py``)."""
    return seq in _declined


def mark_declined(seq: SeqState, flag: bool) -> None:
    """Sets or clears ``seq``'s declined mark (``declined``)."""
    if flag:
        _declined.add(seq)
    else:
        _declined.discard(seq)


@dataclass(frozen=True)
class DraftFeed:
    """Positions ``start..start+len(next_ids)`` of ``seq``'s slot to feed, with
    the tokens that follow each (so ``next_ids[-1]`` is the sequence's
    ``last_token`` when the feed reaches ``seq_len``), then ``num_drafts``
    drafts to chain from the last one (0: feed only). A slot's feed starts
    where its previous one ended."""

    seq: SeqState
    start: int
    next_ids: Sequence[int]
    num_drafts: int

    @property
    def end(self) -> int:
        return self.start + len(self.next_ids)

    @property
    def floor(self) -> int:
        """No module runs a row below it: the module rows below it were
        copied from another slot with a reused prompt prefix
        (``prefix_cache.py``), so a feed there starts every module afresh, as
        a feed from row 0 does."""
        return self.seq.head_floor


class MtpDrafter:
    """Drafts from ``modules``, in stack order, or from one module (see module doc)."""

    def __init__(
        self,
        modules: MtpModule | Sequence[MtpModule],
        min_prob: float = 0.0,
        budget: DraftBudget | None = None,
    ) -> None:
        self.modules = list(modules) if isinstance(modules, Sequence) else [modules]
        assert self.modules, "a drafter needs at least one module"
        self.min_prob = min_prob
        # With a draft budget, every draft is kept and the budget decides how
        # deep each chain goes (``budget.py``); ``min_prob`` is not used.
        self.budget = budget
        self.forwards = 0  # module forwards run, for the budget's head costs
        # Per module but the last: [num_slots, hidden_size], its output at the
        # last final row of each slot's latest feed; made on first use.
        self._last: list[torch.Tensor] = []
        # By slot: an ended sequence's held rows, not fed yet (``owe``).
        self._owed: dict[int, tuple[DraftFeed, torch.Tensor]] = {}

    @property
    def num_slots(self) -> int:
        return min(m.num_slots for m in self.modules)

    @property
    def max_len(self) -> int:
        return min(m.max_len for m in self.modules)

    def feed_and_draft(
        self,
        feeds: Sequence[DraftFeed],
        hidden: torch.Tensor,  # [sum of len(next_ids), hidden_size] main pre-norm hidden, feed order
    ) -> None:
        """Feeds every ``feed`` (one forward per module and further chain
        position); sets the drafts of each feed's sequence that asked for
        drafts, and clears them for the others."""
        if not feeds:
            return
        drafts: list[list[int]] = [[] for _ in feeds]
        if self.budget is not None:
            for feed in feeds:
                self.budget.clear_chain(feed.seq)
        if len(self.modules) == 1:
            self._chain(feeds, hidden, drafts)
        else:
            self._stack(feeds, hidden, drafts)
        for i, feed in enumerate(feeds):
            self._count_rows(feed)
            feed.seq.set_drafts(drafts[i])
            mark_declined(feed.seq, feed.num_drafts > 0 and not drafts[i])

    def owe(self, feed: DraftFeed, hidden: torch.Tensor) -> None:
        """Keeps the feed of rows an ended sequence's chain held (``hidden``:
        their rows) for its slot: fed as far as a request reuses the slot's
        prefix (``pay``), dropped once another takes the slot (``forget``).
        The slot counts them as held meanwhile: a later request may find its
        prefix there, and reuses only the part it shares, or none."""
        self._owed[feed.seq.slot] = feed, hidden
        self._count_rows(feed)

    def pay(self, slot: int, rows: int) -> None:
        """Feeds as much of what ``slot`` owes (``owe``) as every module needs
        to hold its first ``rows`` rows; the rest stays owed."""
        owed = self._owed.pop(slot, None)
        if owed is None:
            return
        feed, hidden = owed
        cut = max(min(rows + len(self.modules) - 1, feed.end) - feed.start, 0)
        if cut:
            head = dataclasses.replace(feed, next_ids=feed.next_ids[:cut])
            self.feed_and_draft([head], hidden[:cut])
        if cut < len(feed.next_ids):
            rest = dataclasses.replace(feed, start=feed.start + cut, next_ids=feed.next_ids[cut:])
            self._owed[slot] = rest, hidden[cut:]

    def forget(self, slot: int) -> None:
        """Drops what ``slot`` owes: another sequence writes over its rows."""
        self._owed.pop(slot, None)

    def _count_rows(self, feed: DraftFeed) -> None:
        """Raises the rows ``feed``'s slot holds for good in every module:
        module ``k`` holds those below ``end - k``."""
        if feed.seq.head_rows is not None:
            final = len(self.modules) - 1
            feed.seq.head_rows = max(feed.seq.head_rows, feed.end - final)

    def _chain(
        self,
        feeds: Sequence[DraftFeed],
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        drafts: list[list[int]],
    ) -> None:
        """The lone module: fed, then applied to its own output per draft."""
        module = self.modules[0]
        segments = [Segment(f.seq.slot, f.start, list(f.next_ids)) for f in feeds]
        sizes = [len(f.next_ids) for f in feeds]
        out = module.forward(segments, hidden, logits="last")
        self.forwards += 1
        # out.logits: [num_feeds, vocab]; out.hidden: [num_tokens, hidden_size]
        ends = torch.tensor(sizes).cumsum(0) - 1  # [num_feeds]
        live = [i for i, f in enumerate(feeds) if f.num_drafts > 0]
        index = torch.tensor(live, dtype=torch.long)
        logits = out.logits[index.to(out.logits.device)]  # [num_live, vocab]
        chain_hidden = out.hidden[ends[index].to(out.hidden.device)]  # [num_live, hidden_size]
        depth = 0
        while live:
            self._choose(feeds, live, logits, depth, drafts)
            depth += 1
            keep = [
                k
                for k, i in enumerate(live)
                if len(drafts[i]) == depth
                and feeds[i].num_drafts > depth
                and self._deeper(feeds[i].seq, depth, len(live))
            ]
            if not keep:
                break
            live = [live[k] for k in keep]
            # The chain's next position: the last fed one plus the drafts so far.
            segments = [
                Segment(feeds[i].seq.slot, feeds[i].end - 1 + depth, [drafts[i][-1]]) for i in live
            ]
            chain_hidden = chain_hidden[torch.tensor(keep, device=chain_hidden.device)]
            out = module.forward(segments, chain_hidden, logits="last")
            self.forwards += 1
            logits, chain_hidden = out.logits, out.hidden  # [num_live, vocab], [num_live, hidden]

    def _stack(
        self,
        feeds: Sequence[DraftFeed],
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        drafts: list[list[int]],
    ) -> None:
        """Every module in order, each over its final rows and, for a feed
        still drafting, the rows that read the drafts so far."""
        # The previous module's output rows per feed, from that module's first row.
        before: list[torch.Tensor | None] = []
        # Drafts each feed may still get: its ask, cut where the budget stops it.
        caps = [f.num_drafts for f in feeds]
        for depth, module in enumerate(self.modules):
            if depth > 0:
                going = sum(_drafts_on(c, depth, d) for c, d in zip(caps, drafts, strict=True))
                for i, feed in enumerate(feeds):
                    if _drafts_on(caps[i], depth, drafts[i]) and not self._deeper(
                        feed.seq, depth, going
                    ):
                        caps[i] = depth
            rows = [_rows_at(f, c, depth, d) for f, c, d in zip(feeds, caps, drafts, strict=True)]
            fed = [i for i, (_, tokens) in enumerate(rows) if tokens]
            sizes = [len(rows[i][1]) for i in fed]
            rows_in = hidden
            if depth > 0:
                # A module may have no row to run: a one-token feed at the
                # slot's start that drafts no further hands nothing on.
                if fed:
                    rows_in = self._handed_on(feeds, depth, fed, sizes, before)
                self._keep_last_final(feeds, depth - 1, before)
            before = [None] * len(feeds)
            if not fed:
                continue
            segments = [Segment(feeds[i].seq.slot, *rows[i]) for i in fed]
            out = module.forward(segments, rows_in, logits="last")
            self.forwards += 1
            # out.logits: [num_fed, vocab]; out.hidden: [num_rows, hidden_size]
            for i, piece in zip(fed, out.hidden.split(sizes), strict=True):
                before[i] = piece
            live = [n for n, i in enumerate(fed) if _drafts_on(caps[i], depth, drafts[i])]
            if live:
                index = torch.tensor(live, device=out.logits.device)
                logits = out.logits[index]  # [num_live, vocab]
                self._choose(feeds, [fed[n] for n in live], logits, depth, drafts)

    def _handed_on(
        self,
        feeds: Sequence[DraftFeed],
        depth: int,
        fed: list[int],
        sizes: list[int],
        before: list[torch.Tensor | None],
    ) -> torch.Tensor:  # [sum(sizes), hidden_size]
        """Module ``depth``'s input rows: module ``depth-1``'s output at the
        same rows. Its first row, ``start - depth``, was the last row module
        ``depth-1`` was fed a step earlier, so it comes from ``_last``."""
        parts: list[torch.Tensor] = []
        for i, size in zip(fed, sizes, strict=True):
            rows = before[i]
            assert rows is not None, "a module runs no row its predecessor skipped"
            if feeds[i].start - feeds[i].floor >= depth:
                parts.append(self._last[depth - 1][feeds[i].seq.slot][None])
                size -= 1
            assert rows.shape[0] >= size, "the predecessor ran every row handed on"
            parts.append(rows[:size])
        return torch.cat(parts)

    def _keep_last_final(
        self, feeds: Sequence[DraftFeed], depth: int, out: list[torch.Tensor | None]
    ) -> None:
        """Keeps module ``depth``'s output at each feed's last final row,
        ``end - 1 - depth``, for the next step's module ``depth + 1``."""
        for feed, rows in zip(feeds, out, strict=True):
            row = feed.end - 1 - depth
            if rows is None or row < feed.floor:
                continue
            if len(self._last) <= depth:
                self._last.append(rows.new_zeros(self.num_slots, rows.shape[-1]))
            self._last[depth][feed.seq.slot] = rows[row - max(feed.floor, feed.start - depth)]

    def _choose(
        self,
        feeds: Sequence[DraftFeed],
        live: list[int],
        logits: torch.Tensor,  # [len(live), vocab] each live feed's next draft position
        depth: int,
        drafts: list[list[int]],
    ) -> None:
        """Appends each live feed's draft at ``depth``, unless the confidence
        rule (module doc) holds it back; with a budget, always, telling it."""
        budget = self.budget
        argmax, sure = self._greedy_reads(logits, gate=budget is None)  # [num_live] each
        sampled = [k for k, i in enumerate(live) if feeds[i].seq.noise_key is not None]
        drawn = self._sampled(feeds, live, logits, sampled, depth)
        for k, (draft, confidence) in zip(sampled, drawn, strict=True):
            argmax[k] = draft
            sure[k] = budget is not None or confidence >= self.min_prob
        for k, i in enumerate(live):
            if sure[k]:
                drafts[i].append(argmax[k])
                if budget is not None:
                    budget.drafted(feeds[i].seq, depth)

    @staticmethod
    def _sampled(
        feeds: Sequence[DraftFeed],
        live: list[int],
        logits: torch.Tensor,  # [len(live), vocab]
        sampled: list[int],  # the rows of ``logits`` whose sequence samples
        depth: int,
    ) -> list[tuple[int, float]]:
        """Each sampled row's draft, drawn from the module's shaped
        distribution with its request's key (the draft at ``depth`` is the
        token at position ``end + 1 + depth``), and its probability there."""
        if not sampled:
            return []
        seqs = [feeds[live[k]].seq for k in sampled]
        q = torch.cat(
            [
                target_probs(logits[k][None, :], s.request.params)
                for k, s in zip(sampled, seqs, strict=True)
            ]
        )  # [num_sampled, vocab]
        keys = [s.noise_key for s in seqs if s.noise_key is not None]
        positions = [feeds[live[k]].end + 1 + depth for k in sampled]
        drawn = sample_at(q, keys, positions)
        confidence = q[torch.arange(len(drawn)), torch.tensor(drawn)].tolist()
        return list(zip(drawn, confidence, strict=True))

    def _deeper(self, seq: SeqState, depth: int, live: int) -> bool:
        """Whether a chain still drafting goes on to ``depth`` (always, without
        a budget: the ask and the confidence rule decide)."""
        return self.budget is None or self.budget.deeper(seq, depth, live)

    def _greedy_reads(self, logits: torch.Tensor, gate: bool) -> tuple[list[int], list[bool]]:
        """Per row of ``logits`` ``[rows, vocab]``: the greedy draft and,
        under the ``min_prob`` rule (``gate``), whether the module's top
        probability makes it likely enough to propose; read back in one
        device sync."""
        argmax = logits.argmax(dim=-1)  # [rows]
        if gate and self.min_prob > 0.0:
            sure = logits.float().softmax(dim=-1).amax(dim=-1) >= self.min_prob  # [rows]
            both = torch.stack([argmax, sure.long()]).tolist()
            return both[0], [bool(x) for x in both[1]]
        return argmax.tolist(), [True] * logits.shape[0]


def _drafts_on(cap: int, depth: int, drafts: list[int]) -> bool:
    """Whether module ``depth`` drafts for a feed that may get ``cap`` drafts:
    it was given every draft before this depth and may have one more."""
    return len(drafts) == depth and cap > depth


def _rows_at(feed: DraftFeed, cap: int, depth: int, drafts: list[int]) -> tuple[int, list[int]]:
    """``(first row, tokens)`` module ``depth`` runs for ``feed``: row ``p``
    reads token ``p+1+depth``, so the rows whose token the feed made final are
    ``start-depth..end-1-depth`` (none below the feed's ``floor``) with the
    feed's own tokens; when it drafts on, rows ``end-depth..end-1`` follow with
    the drafts so far. For example ``start=5, end=7, depth=2`` and drafts
    ``[a, b]``: rows 3..6 read ``t_6, t_7, a, b``."""
    tokens = list(feed.next_ids)[max(0, depth - (feed.start - feed.floor)) :]
    if _drafts_on(cap, depth, drafts):
        tokens += drafts[max(0, depth - (feed.end - feed.floor)) :]
    return max(feed.floor, feed.start - depth), tokens
