"""The host step: the verify's acceptance and the MTP head run from the host.

Contract: ``HostStep.run`` reads top to bottom as the step's phases:

1. prefill one chunk of at most ``prefill_chunk`` prompt tokens, oldest
   request first; a sequence whose prompt completes samples its first token
   and starts decoding;
2. drafts: a chain drafted for a smaller batch is cut to the policy's cap,
   a grammar's forced run comes first, then the policy sets each
   sequence's drafts (a copy, a prefix of the chain, or none); every draft
   is checked against the sequence's grammar;
3. verify every decoding sequence's ``[last_token] + drafts`` in one
   forward, accept the longest prefix the model agrees with (greedy: its
   argmax; sampled: speculative sampling) and emit it with the bonus token;
4. settle the copies from each sequence's ``seq_len`` advance and tell the
   policy what the verify did;
5. feed the MTP head every position the verify made final and draft the
   next chain (the policy may hold a resting chain's rows back).

Output never depends on the drafts: greedy output is plain decoding token
for token, sampled output is plain sampling in distribution.
"""

from __future__ import annotations

import torch

from metrale.engine.api import Request
from metrale.engine.runtime.model import Segment
from metrale.engine.sampling import draw, make_generator, target_probs
from metrale.engine.sequence import SeqState
from metrale.engine.spec.acceptance import accept_greedy, accept_sampled
from metrale.engine.spec.constrained import (
    accept_constrained,
    check_drafts,
    first_token,
)
from metrale.engine.spec.copies import settle_copies
from metrale.engine.spec.grammar import GrammarError
from metrale.engine.spec.mtp import DraftFeed
from metrale.engine.step import Queues, StepTimes
from metrale.engine.step.books import StepSetup, constrain, prompt_chunk, take_drafts


class HostStep:
    """The step on the host (module doc)."""

    name = "host"

    def __init__(self, setup: StepSetup) -> None:
        self.model, self.policy, self.drafter = setup.model, setup.policy, setup.drafter
        self.books, self.copies, self.shared = setup.books, setup.copies, setup.shared
        self.prefill_chunk, self.forced_drafts = setup.prefill_chunk, setup.forced_drafts

    def admit(self, seq: SeqState, queues: Queues) -> None:
        queues.prefilling.append(seq)

    def generator(self, seed: int | None) -> torch.Generator:
        return make_generator(seed, "cpu")

    def rejection(self, request: Request) -> str | None:
        return None

    def run(self, queues: Queues, times: StepTimes) -> list[SeqState]:
        # 1. Prefill one chunk.
        done = self._prefill(queues, times)
        batch = [s for s in queues.decoding if not s.finished]
        if not batch:
            return done
        # 2. Drafts: the forced run, then the policy's choice, checked by the grammar.
        took = take_drafts(self.policy, batch, queues, self.forced_drafts)
        constrain(batch, check_drafts)
        batch = [s for s in batch if not s.finished]
        # 3. Verify every sequence's [last_token] + drafts in one forward.
        starts = [s.seq_len for s in batch]
        hidden, first_rows = self._verify(batch, times) if batch else (None, [])
        # 4. Settle the copies; the policy learns what the verify did.
        settle_copies(took, self.shared, self.copies)
        if batch:
            self.policy.verified(times)
        # 5. Draft the next chain from the newly verified positions.
        if hidden is not None:
            self._draft(batch, starts, first_rows, hidden, queues, times)
        return done

    def _prefill(self, queues: Queues, times: StepTimes) -> list[SeqState]:
        """Feeds up to ``prefill_chunk`` prompt tokens, oldest request first;
        returns the sequences that finished on their first token."""
        segments, chunked = prompt_chunk(queues.prefilling, self.prefill_chunk, short=0)
        if not segments:
            return []
        began = self.policy.clock()
        out = self.model.forward(segments, logits="last")
        # out.logits: [num_segments, vocab]; out.hidden: [num_tokens, hidden_size]
        self.books.counters.prefills += 1
        feeds: list[DraftFeed] = []
        parts: list[torch.Tensor] = []  # the feeds' hidden rows, in order
        done: list[SeqState] = []
        at = 0
        for row, (seq, seg) in enumerate(zip(chunked, segments, strict=True)):
            start, fed = seq.seq_len, len(seg.token_ids)
            seq.seq_len += fed
            complete = seq.seq_len == seq.prompt_len
            if complete:
                queues.prefilling.remove(seq)
                self._emit_first(seq, out.logits[row])
                (done if seq.finished else queues.decoding).append(seq)
            if self.drafter is not None and not seq.finished:
                # Position p gets token p+1: the next prompt token, or the
                # sampled first token at the prompt's last position.
                next_ids = seq.history[start + 1 : seq.seq_len + 1]
                rows = out.hidden[at : at + fed]
                feed = self.policy.prompt_feed(seq, start, next_ids, rows, complete, queues)
                if feed is not None:
                    feeds.append(feed[0])
                    parts.append(feed[1])
            at += fed
        if feeds:
            assert self.drafter is not None
            self.drafter.feed_and_draft(feeds, torch.cat(parts))
        times.prefill_s = self.policy.clock() - began
        return done

    def _emit_first(self, seq: SeqState, logits: torch.Tensor) -> None:  # logits: [vocab]
        """The token the prefill samples after the prompt."""
        try:
            token = _sample_one(seq, logits)
        except GrammarError as exc:
            seq.fail(str(exc))
            return
        self.books.emit_first(seq, token)

    def _verify(self, batch: list[SeqState], times: StepTimes) -> tuple[torch.Tensor, list[int]]:
        """One forward over every sequence's ``[last_token] + drafts``; emits
        the accepted drafts and the bonus token and advances ``seq_len`` by
        their count. Returns the forward's hidden rows and each sequence's
        first row among them."""
        segments = [Segment(s.slot, s.seq_len, [s.last_token, *s.pending_drafts]) for s in batch]
        began = self.policy.clock()
        out = self.model.forward(segments, logits="all")
        # out.logits: [num_rows, vocab]; out.hidden: [num_rows, hidden_size]
        argmax = out.logits.argmax(dim=-1).tolist()  # [num_rows]
        times.verify_s, times.verify_rows = self.policy.clock() - began, len(argmax)
        times.produced = {}
        self.books.counters.verifies += 1
        first_rows, row = [], 0
        for seq in batch:
            drafts, num_rows = seq.pending_drafts, len(seq.pending_drafts) + 1
            first_rows.append(row)
            rows = slice(row, row + num_rows)
            row += num_rows
            try:
                accepted, bonus = _accept(seq, out.logits[rows], argmax[rows])
            except GrammarError as exc:
                seq.fail(str(exc))
                continue
            times.produced[seq.slot] = [*drafts[len(seq.forced_drafts) : accepted], bonus]
            self.books.settle(seq, [*drafts[:accepted], bonus])
        return out.hidden, first_rows

    def _draft(
        self,
        batch: list[SeqState],
        starts: list[int],
        first_rows: list[int],
        hidden: torch.Tensor,  # [num_rows, hidden_size] of the verify
        queues: Queues,
        times: StepTimes,
    ) -> None:
        """Feeds the MTP modules every position the verify made final (rows
        ``0..accepted`` of each sequence: ``h`` of ``last_token`` and of each
        accepted draft, with the token after each) and drafts the next chain.
        The entries the drafts wrote are rewritten whatever was accepted, as
        if none of them had been (``spec/mtp.py`` says why)."""
        if self.drafter is None:
            return
        running = queues.running()
        self.policy.before_head(batch, queues)
        feeds: list[DraftFeed] = []
        parts: list[torch.Tensor] = []
        for seq, start, first in zip(batch, starts, first_rows, strict=True):
            if seq.finished:
                continue
            next_ids = seq.history[start + 1 : seq.seq_len + 1]
            rows = hidden[first : first + seq.seq_len - start]
            feed = self.policy.head_feed(seq, start, next_ids, rows, running)
            if feed is not None:
                feeds.append(feed[0])
                parts.append(feed[1])
        if not feeds:
            return
        began, forwards = self.policy.clock(), self.drafter.forwards
        self.drafter.feed_and_draft(feeds, torch.cat(parts))
        took = self.policy.clock() - began
        times.head_s += took
        self.policy.head_ran(feeds, self.drafter.forwards - forwards, took)


def _accept(
    seq: SeqState,
    logits: torch.Tensor,  # [num_drafts + 1, vocab] the sequence's verify rows
    argmax: list[int],  # [num_drafts + 1]
) -> tuple[int, int]:
    """``(accepted drafts, bonus token)`` of one sequence's verify rows."""
    if seq.grammar is not None:
        return accept_constrained(seq, logits, argmax)
    if seq.request.params.greedy:
        return accept_greedy(seq.pending_drafts, argmax)
    assert seq.generator is not None
    target = target_probs(logits, seq.request.params)
    return accept_sampled(seq.pending_drafts, seq.pending_probs, target, seq.generator)


def _sample_one(seq: SeqState, logits: torch.Tensor) -> int:  # logits: [vocab]
    if seq.grammar is not None:
        return first_token(seq, logits)
    if seq.request.params.greedy:
        return int(logits.argmax())
    assert seq.generator is not None
    return draw(target_probs(logits[None, :], seq.request.params)[0], seq.generator)
