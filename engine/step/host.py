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
   forward, choose each row's token (greedy: the argmax; sampled: drawn with
   the request's noise key at the row's position), keep the longest prefix
   of drafts equal to them and emit it with the bonus token (and their
   logprobs, read from the same rows, when the request asked);
4. settle the copies from each sequence's ``seq_len`` advance and tell the
   policy what the verify did;
5. feed the MTP head every position the verify made final and draft the
   next chain (the policy may hold a resting chain's rows back).

Output never depends on the drafts: greedy and sampled output alike are
plain decoding's token for token (``spec/acceptance.py``).
"""

from __future__ import annotations

import torch

from metrale.engine.api import Request
from metrale.engine.logprobs import token_logprobs
from metrale.engine.runtime.model import Segment
from metrale.engine.sampling import sample_at, target_probs
from metrale.engine.sequence import SeqState
from metrale.engine.spec.acceptance import accept_drafts
from metrale.engine.spec.constrained import (
    accept_constrained,
    check_drafts,
    first_token,
    forced_of,
)
from metrale.engine.spec.copies import fit_copies, settle_copies
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
        fit_copies(took)
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
        firsts = _first_tokens(chunked, segments, out.logits)
        at = 0
        for row, (seq, seg) in enumerate(zip(chunked, segments, strict=True)):
            start, fed = seq.seq_len, len(seg.token_ids)
            seq.seq_len += fed
            complete = seq.seq_len == seq.prompt_len
            if complete:
                queues.prefilling.remove(seq)
                self._emit_first(seq, firsts[row], out.logits[row])
                (done if seq.finished else queues.decoding).append(seq)
            # A sequence that ended on its first token drafts nothing, but
            # the requests waiting on its prefix need its modules' rows.
            wanted = not seq.finished or (seq.waited_on > 0 and seq.error is None)
            if self.drafter is not None and wanted:
                # Position p gets token p+1: the next prompt token, or the
                # sampled first token at the prompt's last position.
                next_ids = seq.history[start + 1 : seq.seq_len + 1]
                rows = out.hidden[at : at + fed]
                drafting = complete and not seq.finished
                feed = self.policy.prompt_feed(seq, start, next_ids, rows, drafting, queues)
                if feed is not None:
                    feeds.append(feed[0])
                    parts.append(feed[1])
            at += fed
        if feeds:
            assert self.drafter is not None
            self.drafter.feed_and_draft(feeds, torch.cat(parts))
        times.prefill_s = self.policy.clock() - began
        return done

    def _emit_first(
        self,
        seq: SeqState,
        first: int | GrammarError,
        logits: torch.Tensor,  # [vocab] the prompt's last row, which chose it
    ) -> None:
        """The token the prefill chose after the prompt (a grammar that could
        not choose one fails the sequence)."""
        if isinstance(first, GrammarError):
            seq.fail(str(first))
            return
        top = seq.request.params.logprobs
        logprob = token_logprobs(logits[None, :], [first], top)[0] if top is not None else None
        self.books.emit_first(seq, first, logprob)

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
        sizes = [len(s.pending_drafts) + 1 for s in batch]
        first_rows = [sum(sizes[:i]) for i in range(len(batch))]
        chosen = _choose(batch, out.logits, argmax, first_rows)
        for seq, first, own in zip(batch, first_rows, chosen, strict=True):
            drafts = seq.pending_drafts
            rows = slice(first, first + len(drafts) + 1)
            try:
                if own is None:
                    accepted, bonus = accept_constrained(seq, out.logits[rows], argmax[rows])
                else:
                    accepted, bonus = accept_drafts(drafts, own)
            except GrammarError as exc:
                seq.fail(str(exc))
                continue
            times.produced[seq.slot] = [*drafts[len(forced_of(seq)) : accepted], bonus]
            emitted = [*drafts[:accepted], bonus]
            top, logprobs = seq.request.params.logprobs, None
            if top is not None:
                logprobs = token_logprobs(out.logits[first : first + accepted + 1], emitted, top)
            self.books.settle(seq, emitted, logprobs)
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


def _choose(
    batch: list[SeqState],
    logits: torch.Tensor,  # [num_rows, vocab] the verify's rows, batch order
    argmax: list[int],  # [num_rows]
    first_rows: list[int],  # each sequence's first row
) -> list[list[int] | None]:
    """Each sequence's chosen token per row (``spec/acceptance.py``): the
    argmax when greedy; drawn with its noise key when sampled, every
    sampled row of the batch in one call; None under a grammar, whose rows
    are chosen under their masks (``accept_constrained``). A sequence's row
    ``r`` chooses the token at position ``len(history) + r``."""
    chosen: list[list[int] | None] = []
    sampled: list[tuple[int, int]] = []  # (index in batch, rows)
    parts: list[torch.Tensor] = []
    keys: list[int] = []
    positions: list[int] = []
    for i, (seq, first) in enumerate(zip(batch, first_rows, strict=True)):
        rows = len(seq.pending_drafts) + 1
        chosen.append(argmax[first : first + rows] if seq.grammar is None else None)
        if seq.grammar is None and seq.noise_key is not None:
            sampled.append((i, rows))
            parts.append(target_probs(logits[first : first + rows], seq.request.params))
            keys += [seq.noise_key] * rows
            positions += range(len(seq.history), len(seq.history) + rows)
    if parts:
        drawn = sample_at(torch.cat(parts), keys, positions)
        at = 0
        for i, rows in sampled:
            chosen[i], at = drawn[at : at + rows], at + rows
    return chosen


def _first_tokens(
    chunked: list[SeqState],
    segments: list[Segment],
    logits: torch.Tensor,  # [num_segments, vocab] each segment's last row
) -> dict[int, int | GrammarError]:
    """The first token of each sequence whose prompt this chunk completes, by
    segment: chosen as a verify row is (``_choose``, unconstrained ones in one
    call), or under the grammar's start mask."""
    completing = [
        row
        for row, (seq, seg) in enumerate(zip(chunked, segments, strict=True))
        if seq.seq_len + len(seg.token_ids) == seq.prompt_len
    ]
    plain = [row for row in completing if chunked[row].grammar is None]
    firsts: dict[int, int | GrammarError] = {}
    if plain:
        rows = logits[plain]  # [num_plain, vocab]
        seqs = [chunked[row] for row in plain]
        chosen = _choose(seqs, rows, rows.argmax(dim=-1).tolist(), list(range(len(plain))))
        firsts.update((row, own[0]) for row, own in zip(plain, chosen, strict=True) if own)
    for row in completing:
        if chunked[row].grammar is not None:
            try:
                firsts[row] = first_token(chunked[row], logits[row])
            except GrammarError as exc:
                firsts[row] = exc
    return firsts
