"""The MTP drafter: feeds verified positions to an MTP module and chains drafts.

Contract: the module keeps its own KV cache in the same slots as the main
model. At position ``p`` it takes the main model's pre-norm hidden ``h_p`` and
token ``p+1`` and predicts token ``p+2``. For a decoding sequence with
``seq_len == L`` (tokens ``0..L-1`` in the main cache, ``last_token`` is
token ``L``) the module's cache holds positions ``0..L-1``, fed from the main
model's hidden states; position ``L-1`` (with ``last_token``) gives the first
draft, and each further draft feeds the module its own output hidden and its
own previous draft at the next position (a chain).

Positions the chain wrote (``L, L+1, ..``) are never kept: they were computed
from the module's own hidden states, not from ``h``. After a verify that
advanced the sequence from ``L`` to ``L'``, the engine loop feeds positions
``L..L'-1`` again from the verify's hidden rows, overwriting the chain's. So
the module is trimmed as if none of its drafts were accepted, in every case,
which keeps it on the inputs it was trained on (the main model's hidden
states, never its own); whether the verified drafts were the drafter's own
only decides which figures count them (see ``copies.py``).

With several MTP modules only the first is driven, applied repeatedly: every
public layout ships one, and chaining one module needs one cache.

Confidence: a greedy chain stops at the first position where the module's
softmax has no token of probability ``min_prob`` or more. Each draft costs a
verify row and each further position a module forward, and an unsure draft
is rarely accepted. A sampled chain is judged at its first position only
(the distribution it draws from there), never at a later one: a later
position's distribution depends on the drafts drawn before it, so stopping
there would make the chain's length depend on those draws, and the copy
step, which keeps MTP drafts only when a copy is shorter than the chain,
would then keep a biased first draft. Judged before any draw, the choice
leaves speculative sampling exact. A sequence left without drafts this way
is marked ``drafts_declined``: it may take a prompt-lookup copy as a model
without MTP would (chain 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from metrale.engine.runtime.model import MtpModule, Segment
from metrale.engine.sampling import draw, target_probs
from metrale.engine.sequence import SeqState


@dataclass(frozen=True)
class DraftFeed:
    """Positions ``start..start+len(next_ids)`` of ``seq``'s slot to feed, with
    the tokens that follow each (so ``next_ids[-1]`` is the sequence's
    ``last_token`` when the feed reaches ``seq_len``), then ``num_drafts``
    drafts to chain from the last one (0: feed only)."""

    seq: SeqState
    start: int
    next_ids: Sequence[int]
    num_drafts: int


class MtpDrafter:
    def __init__(self, module: MtpModule, min_prob: float = 0.0) -> None:
        self.module = module
        self.min_prob = min_prob

    @property
    def max_len(self) -> int:
        return self.module.max_len

    def feed_and_draft(
        self,
        feeds: Sequence[DraftFeed],
        hidden: torch.Tensor,  # [sum of len(next_ids), hidden_size] main pre-norm hidden, feed order
    ) -> None:
        """Feeds every ``feed`` in one module forward, then chains; sets the
        drafts (and, for sampled requests, their distributions) of each feed's
        sequence that asked for drafts, and clears them for the others."""
        if not feeds:
            return
        segments = [Segment(f.seq.slot, f.start, list(f.next_ids)) for f in feeds]
        out = self.module.forward(segments, hidden, logits="last")
        # out.logits: [num_feeds, vocab]; out.hidden: [num_tokens, hidden_size]
        ends = torch.tensor([len(f.next_ids) for f in feeds]).cumsum(0) - 1  # [num_feeds]
        drafts: list[list[int]] = [[] for _ in feeds]
        probs: list[list[torch.Tensor]] = [[] for _ in feeds]
        live = [i for i, f in enumerate(feeds) if f.num_drafts > 0]
        index = torch.tensor(live, dtype=torch.long)
        logits = out.logits[index.to(out.logits.device)]  # [num_live, vocab]
        chain_hidden = out.hidden[ends[index].to(out.hidden.device)]  # [num_live, hidden_size]
        depth = 0
        while live:
            argmax = logits.argmax(dim=-1).tolist()  # [num_live]: one device sync a depth
            sure = self._sure(logits)  # [num_live]
            for k, i in enumerate(live):
                seq = feeds[i].seq
                if seq.request.params.greedy:
                    if sure[k]:
                        drafts[i].append(argmax[k])
                    continue
                q = target_probs(logits[k][None, :], seq.request.params)[0]  # [vocab]
                if depth > 0 or self.min_prob == 0.0 or float(q.max()) >= self.min_prob:
                    drafts[i].append(_draw(seq, q))
                    probs[i].append(q)
            depth += 1
            keep = [
                k
                for k, i in enumerate(live)
                if len(drafts[i]) == depth and feeds[i].num_drafts > depth
            ]
            if not keep:
                break
            live = [live[k] for k in keep]
            # The chain's next position: the last fed one plus the drafts so far.
            segments = [
                Segment(
                    feeds[i].seq.slot,
                    feeds[i].start + len(feeds[i].next_ids) - 1 + depth,
                    [drafts[i][-1]],
                )
                for i in live
            ]
            chain_hidden = chain_hidden[torch.tensor(keep, device=chain_hidden.device)]
            out = self.module.forward(segments, chain_hidden, logits="last")
            logits, chain_hidden = out.logits, out.hidden  # [num_live, vocab], [num_live, hidden]
        for i, feed in enumerate(feeds):
            feed.seq.set_drafts(drafts[i], torch.stack(probs[i]) if probs[i] else None)
            feed.seq.drafts_declined = feed.num_drafts > 0 and not drafts[i]

    def _sure(self, logits: torch.Tensor) -> list[bool]:
        """Per row of ``logits`` ``[rows, vocab]``: whether the greedy draft is
        likely enough to propose."""
        if self.min_prob == 0.0:
            return [True] * logits.shape[0]
        top = logits.float().softmax(dim=-1).amax(dim=-1)  # [rows]
        return (top >= self.min_prob).tolist()


def _draw(seq: SeqState, q: torch.Tensor) -> int:
    """A sampled request draws its draft from the module's distribution shaped
    like the target (temperature, top-k, top-p), kept as ``q``."""
    assert seq.generator is not None, "a sampled request carries its generator"
    return draw(q, seq.generator)
