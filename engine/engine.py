"""The batch engine: continuous batching over fixed KV slots, one verify per step.

Contract: ``Engine.generate`` takes requests lazily (it pulls a request only
when a slot is about to be free, so an endless stream works) and yields each
``Result`` as soon as it finishes, in completion order. A request that cannot
be generated (empty prompt, prompt + ``max_tokens`` beyond the slot length)
comes back at once as a ``finish_reason == "error"`` result; nothing a request
holds stops the run.

Each step runs six phases in order: admit/prefill, copies, verify, settle,
draft, finish. A request with a grammar drafts its forced tokens before the
copies, has every draft checked against its grammar before the verify, and is
verified under each row's mask (``spec/constrained.py``). All decoding sequences share one verify forward per step;
prefill runs in chunks of at most ``prefill_chunk`` tokens per step
in a forward of its own, so running sequences keep decoding while a long
prompt is read. Output never depends on the drafts: greedy output is plain
decoding token for token, sampled output is plain sampling in distribution.

``Engine.stats`` returns an immutable snapshot the step publishes; any thread
may read it at any time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from metrale.engine.api import Grammar, Request, Result, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.device_step import MAX_WIDTH, VerifyRow, device_step_for
from metrale.engine.kernels.binding import packed_kernel
from metrale.engine.load.home import metrale_home
from metrale.engine.runtime.model import Model, MtpModule, Segment
from metrale.engine.sampling import draw, make_generator, target_probs
from metrale.engine.sequence import Decode, SeqState, error_result
from metrale.engine.spec.acceptance import accept_greedy, accept_sampled
from metrale.engine.spec.budget import HOLD_MAX, SCORED_ROWS, DraftBudget
from metrale.engine.spec.choose import (
    Offer,
    lines_ahead,
    peek_copy,
    score_offers,
    take_planned_drafts,
)
from metrale.engine.spec.constrained import (
    accept_constrained,
    check_drafts,
    first_token,
    take_forced,
)
from metrale.engine.spec.copies import (
    CopyTaken,
    copy_in_flight,
    drafter_accepted,
    settle_copies,
    take_rounds_with_copies,
)
from metrale.engine.spec.cost import CostCache, CostModel
from metrale.engine.spec.grammar import GrammarCompiler, GrammarError
from metrale.engine.spec.matcher import GrammarMatcher
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter
from metrale.engine.stats import EngineStats, RunCounters
from metrale.lookup import LookupStats, ScopeKey, SharedLookup

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel


# Marks the end of the request stream (``None`` from it means "not yet").
_END = object()
# How long an engine with nothing to do waits before asking a quiet source again.
_IDLE_POLL_S = 0.005
# The budget's figures in the published snapshot are refreshed at most this
# often while a run goes on (and whenever it ends): a viewer redraws a few
# times a second, and working them out every step cost 0.2 ms of a 22 ms
# batch-1 step (under a profiler).
_BUDGET_PUBLISH_S = 0.2


class Engine:
    def __init__(
        self,
        model: Model,
        tokenizer: Any,
        config: EngineConfig,
        *,
        mtp: Sequence[MtpModule] = (),
        eos_token_ids: Sequence[int] = (),
        model_name: str = "",
        tokenizer_name: str = "",
        adapter: str = "",
        grammars: GrammarCompiler | None = None,
        costs: CostModel | None = None,
    ) -> None:
        """``tokenizer`` turns output ids into text and matches stop strings:
        an object with ``decode(ids)``, a ``decode`` callable, or None (texts
        are then empty); a Hugging Face fast tokenizer is also bound to the
        grammar engine, once, when the first request with a grammar comes
        (``grammars`` brings a binding instead). ``model_name``/
        ``tokenizer_name``/``adapter`` are the shared-lookup scope fields a
        request's ``scope`` completes. ``costs`` measures steps for the draft
        budget (``draft_policy="auto"``); by default one on the wall clock,
        without a calibration cache."""
        self.model = model
        self.config = config
        self._decode = _as_decode(tokenizer)
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._grammars_problem: str | None = None
        mtp = mtp if config.mtp else ()
        self._device = device_step_for(model, mtp, config)
        # The device step drafts by the fixed rules; the budget is the host's.
        auto = config.draft_policy == "auto" and self._device is None
        self._budget = DraftBudget(costs or CostModel()) if auto else None
        self._drafter = (
            MtpDrafter(mtp, config.mtp_min_prob, self._budget)
            if mtp and self._device is None
            else None
        )
        self._has_mtp = bool(mtp)
        self._lookup = config.prompt_lookup
        if self._device is not None and self._lookup is not None:
            # A device verify is at most MAX_WIDTH rows (device_step.py).
            max_drafts = min(self._lookup.max_drafts, MAX_WIDTH - 1)
            self._lookup = dataclasses.replace(self._lookup, max_drafts=max_drafts)
        # Under the budget a chain may be as long as the ladder's longest.
        self._chain_cap = config.mtp_ladder.longest
        self._eos = frozenset(eos_token_ids)
        self._scope_fields = (model_name, tokenizer_name, adapter)
        shared = config.shared_lookup_config()
        self._shared = SharedLookup(shared) if shared is not None else None
        self._num_slots = min(model.num_slots, config.max_batch)
        self._max_len = model.max_len
        if self._drafter is not None:
            assert self._drafter.num_slots >= self._num_slots, "MTP slots < model slots"
            self._max_len = min(self._max_len, self._drafter.max_len)
        self._free_slots = list(range(self._num_slots - 1, -1, -1))
        self._waiting: deque[Request] = deque()
        self._stream_done = False  # the request stream has ended: no line will join
        self._ended_on_its_own = False  # a line of this run ended before its max_tokens
        self._prefilling: list[SeqState] = []
        self._decoding: list[SeqState] = []
        self._counters = RunCounters()
        self._copies = LookupStats()
        self._started = time.perf_counter()
        self._generating = False
        self._snapshot = EngineStats()
        self._budget_published = 0.0  # when the snapshot's budget figures were worked out
        self._offers: list[Offer] = []
        self._spent = _StepTimes()

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, config: EngineConfig, grammars: GrammarCompiler | None = None
    ) -> Engine:
        """An engine over a loaded model; ``grammars`` shares a grammar
        binding (and its compiled grammars) another engine of the model built."""
        tokenizer_name = getattr(loaded.tokenizer, "name_or_path", "") or loaded.name
        costs = None
        if config.draft_policy == "auto":
            costs = CostModel(cache=CostCache(metrale_home(), calibration_key(loaded)))
        return cls(
            loaded.model,
            loaded.tokenizer,
            config,
            mtp=loaded.mtp,
            eos_token_ids=loaded.eos_token_ids,
            model_name=loaded.name,
            tokenizer_name=str(tokenizer_name),
            grammars=grammars,
            costs=costs,
        )

    # -- public API ---------------------------------------------------------

    def stats(self) -> EngineStats:
        """The latest snapshot (published once per step); while a run goes on,
        with its wall time up to now."""
        snap = self._snapshot
        if not self._generating:
            return snap
        return dataclasses.replace(snap, wall_s=time.perf_counter() - self._started)

    def generate(self, requests: Iterable[Request | None]) -> Iterator[Result]:
        """Results in completion order; rejected requests at once (module doc).

        A ``None`` in ``requests`` means "nothing has arrived yet" (a slow
        pipe): the engine stops pulling for this step and decodes what it
        holds, or, holding nothing, waits a moment and asks again. A source
        that can block should hand its items over from a reader thread and
        yield ``None`` when none is ready, so running sequences never wait
        for input."""
        with contextlib.closing(self.steps(requests)) as steps:
            for results in steps:
                yield from results

    def steps(self, requests: Iterable[Request | None]) -> Generator[list[Result], None, None]:
        """``generate`` a step at a time: one list per step, of the results
        that step finished (often none), and one per rejected request. Lets
        a caller run other work between steps: the budget bench has several
        engines take turns step by step (``bench/budget.py``)."""
        stream = iter(requests)
        self.calibrate()
        self._started, self._generating = time.perf_counter(), True
        try:
            yield from self._run(stream)
        finally:
            self._generating = False
            if self._budget is not None:
                self._budget.costs.save()
            self._publish(final=True)

    def _run(self, stream: Iterator[Request | None]) -> Iterator[list[Result]]:
        self._stream_done = self._ended_on_its_own = False
        while True:
            # Pull only what the free slots can take this step, so a huge
            # stream is read as it is consumed.
            idle_source = False
            while not self._stream_done and len(self._waiting) < len(self._free_slots):
                request = next(stream, _END)
                if request is _END:
                    self._stream_done = True
                    break
                if request is None:
                    idle_source = True
                    break
                assert isinstance(request, Request)
                self._counters.requests_total += 1
                problem = self._rejection(request)
                if problem is not None:
                    self._counters.requests_failed += 1
                    self._publish()
                    yield [error_result(request, problem)]
                    continue
                self._waiting.append(request)
            if not (self._waiting or self._prefilling or self._decoding):
                if self._stream_done:
                    return
                if idle_source:
                    time.sleep(_IDLE_POLL_S)
                continue
            yield self._step()

    # -- the step -----------------------------------------------------------

    def _step(self) -> list[Result]:
        spent = self._spent
        spent.began, spent.prefill_s, spent.verify_s = self._clock(), 0.0, 0.0
        spent.head_s = 0.0
        # 1. Admit waiting requests into free slots; prefill one chunk.
        self._admit()
        done = self._prefill_chunk()
        batch = [s for s in self._decoding if not s.finished]
        if batch and self._device is not None:
            took = self._take_drafts(batch)
            self._verify_on_device(batch)
            settle_copies(took, self._shared, self._copies)
        elif batch:
            # 2. Copies: prompt lookup may replace the drafts of some sequences
            # (under the budget, the plan picks each one's source and length);
            # under a grammar, forced tokens come first and every draft is checked.
            took = self._take_drafts(batch)
            self._constrain(batch, check_drafts)
            batch = [s for s in batch if not s.finished]
            # 3. Verify every sequence's [last_token] + drafts in one forward.
            starts = [s.seq_len for s in batch]
            hidden, first_rows = self._verify(batch) if batch else (None, [])
            # 4. Settle the copies from each sequence's seq_len advance.
            settle_copies(took, self._shared, self._copies)
            if self._budget is not None:
                score_offers(self._budget, self._offers, spent.produced)
            # 5. Draft the next chain from the newly verified positions.
            if hidden is not None:
                self._draft_after_verify(batch, starts, first_rows, hidden)
        # 6. Finish: free slots, store in the shared cache, hand back results.
        results = self._finish(done + [s for s in self._decoding if s.finished])
        if self._budget is not None and spent.verify_s > 0:
            measured = self._clock() - spent.began - spent.prefill_s
            self._budget.end_step(measured, spent.verify_s, spent.head_s)
        self._publish()
        return results

    def _take_drafts(self, batch: list[SeqState]) -> list[CopyTaken]:
        """Phase 2: each sequence's drafts for this verify, and the copies in flight."""
        budget, forced = self._budget, self.config.forced_drafts
        cap = self._ladder_nd(len(batch)) if budget is None else self._chain_cap
        for seq in batch:  # the batch may have grown since these were drafted
            _truncate_drafts(seq, min(cap, seq.draft_capacity()))
        self._constrain(batch, lambda seq: take_forced(seq, forced))
        if budget is not None:
            ahead = self._ahead(batch)
            took, self._offers = take_planned_drafts(
                batch, budget, self._lookup, self._shared, ahead
            )
            return took
        mtp_drafting = self._has_mtp and cap > 0
        return take_rounds_with_copies(batch, self._lookup, self._shared, cap, mtp_drafting)

    def _admit(self) -> None:
        if self._device is not None:
            # The device step's batch is the lowest slots (device_step.py).
            self._free_slots.sort(reverse=True)
        while self._free_slots and self._waiting:
            request = self._waiting.popleft()
            params = request.params
            seq = SeqState(
                request=request,
                slot=self._free_slots.pop(),
                max_len=self._max_len,
                eos_ids=self._eos | frozenset(params.eos_token_ids),
                scope=self._scope_key(request),
                generator=None if params.greedy else self._generator(params.seed),
                grammar=self._matcher(request.grammar),
            )
            self._counters.prompt_tokens += len(request.prompt_ids)
            if self._device is not None and seq.prompt_len == 1:
                seq.drafts_declined = self._has_mtp  # no chain yet (_prefill_chunk)
                self._decoding.append(seq)  # nothing before its last token to prefill
            else:
                self._prefilling.append(seq)

    def _generator(self, seed: int | None) -> torch.Generator:
        """A sampled request's generator: on the model's device under the
        device step, which draws there (``spec/device_accept.py``)."""
        return make_generator(seed, self.model.device if self._device is not None else "cpu")

    def graph_shapes(self) -> list[tuple[Any, ...]]:
        """The shapes the device step captured as CUDA graphs (none elsewhere)."""
        return self._device.graph_shapes() if self._device is not None else []

    @property
    def step_path(self) -> str:
        """``device`` or ``host``: which step this engine runs (``EngineConfig.step_path``)."""
        return "device" if self._device is not None else "host"

    def _matcher(self, grammar: Grammar | None) -> GrammarMatcher | None:
        if grammar is None:
            return None
        assert self._grammars is not None, "_rejection bound the grammar engine"
        return GrammarMatcher(self._grammars.start(grammar), self._grammars.vocab_size)

    def _constrain(self, batch: list[SeqState], phase: Callable[[SeqState], None]) -> None:
        """Runs a grammar phase on each constrained sequence of ``batch``; one
        whose grammar cannot go on fails alone."""
        for seq in batch:
            if seq.grammar is not None and not seq.finished:
                try:
                    phase(seq)
                except GrammarError as exc:
                    seq.fail(str(exc))

    def _prefill_chunk(self) -> list[SeqState]:
        """Feeds up to ``prefill_chunk`` prompt tokens, oldest request first. A
        sequence whose prompt is complete samples its first token and starts
        decoding; returned are those that finished right there."""
        budget, segments, chunked = self.config.prefill_chunk, [], []
        # The device step leaves the prompt's last token to the first verify.
        short = 1 if self._device is not None else 0
        for seq in self._prefilling:
            if budget == 0:
                break
            take = min(budget, seq.prompt_len - short - seq.seq_len)
            segments.append(Segment(seq.slot, seq.seq_len, seq.history[seq.seq_len :][:take]))
            chunked.append(seq)
            budget -= take
        if not segments:
            return []
        began = self._clock()
        out = self.model.forward(segments, logits="last")
        # out.logits: [num_segments, vocab]; out.hidden: [num_tokens, hidden_size]
        self._counters.prefills += 1
        feeds: list[DraftFeed] = []
        rows: list[int] = []
        parts: list[torch.Tensor] = []  # the host's feeds' hidden rows, in order
        done: list[SeqState] = []
        at = 0
        for row, (seq, seg) in enumerate(zip(chunked, segments, strict=True)):
            start, fed = seq.seq_len, len(seg.token_ids)
            seq.seq_len += fed
            complete = seq.seq_len == seq.prompt_len - short
            if complete:
                self._prefilling.remove(seq)
                if self._device is None:
                    self._emit_first(seq, out.logits[row])
                else:  # its first verify has no chain yet: a copy may stand in
                    seq.drafts_declined = self._has_mtp
                (done if seq.finished else self._decoding).append(seq)
            if self._device is not None and self._has_mtp:
                next_ids = seq.history[start + 1 : seq.seq_len + 1]  # prompt tokens only
                feeds.append(DraftFeed(seq, start, next_ids, 0))
                rows.extend(range(at, at + fed))
            elif self._drafter is not None and not seq.finished:
                # Position p gets token p+1: the next prompt token, or the
                # sampled first token at the prompt's last position.
                next_ids = seq.history[start + 1 : seq.seq_len + 1]
                feed = self._prompt_feed(seq, start, next_ids, out.hidden[at : at + fed], complete)
                if feed is not None:
                    feeds.append(feed[0])
                    parts.append(feed[1])
            at += fed
        if feeds and self._device is not None:
            index = torch.tensor(rows, dtype=torch.long, device=out.hidden.device)
            self._device.feed_prompt(
                [Segment(f.seq.slot, f.start, f.next_ids) for f in feeds], out.hidden[index]
            )
        elif feeds:
            assert self._drafter is not None
            self._drafter.feed_and_draft(feeds, torch.cat(parts))
        self._spent.prefill_s = self._clock() - began
        return done

    def _prompt_feed(
        self,
        seq: SeqState,
        start: int,
        next_ids: list[int],
        rows: torch.Tensor,  # [len(next_ids), hidden_size] of this chunk
        complete: bool,
    ) -> tuple[DraftFeed, torch.Tensor] | None:
        """A prefill chunk's feed to the MTP modules on the host, drafting once
        the prompt is complete; None while its rows wait. Under the budget a
        prompt of up to ``HOLD_MAX`` tokens is held until the chain first
        drafts (``DraftBudget.wants_chain``): where drafts do not pay (a
        batch of 16 on a CPU), the head never reads the prompts of the
        sequences whose chains never run. A line that starts ahead in a
        drain (``_ahead``) holds it as every such line holds its rows."""
        budget = self._budget
        if budget is not None and seq.prompt_len <= HOLD_MAX:
            own = budget.for_seq(seq)
            # Every line admitted shares the steps to come, those whose
            # prompts are still being read too.
            live = sum(1 for s in self._decoding if not s.finished) + len(self._prefilling)
            ahead = complete and seq.slot in self._ahead([*self._decoding, seq])
            if not complete or not budget.wants_chain(seq, max(live, 1), ahead):
                own.hold(start, next_ids, rows)
                return None
            start, next_ids, rows = own.release(start, next_ids, rows)
        num_drafts = self._chain_len(seq, len(self._decoding)) if complete else 0
        return DraftFeed(seq, start, next_ids, num_drafts), rows

    def _verify(self, batch: list[SeqState]) -> tuple[torch.Tensor, list[int]]:
        """One forward over every sequence's ``[last_token] + drafts``; emits
        the accepted drafts and the bonus token and advances ``seq_len`` by
        their count. Returns the forward's hidden rows and each sequence's
        first row among them."""
        segments = [Segment(s.slot, s.seq_len, [s.last_token, *s.pending_drafts]) for s in batch]
        began = self._clock()
        out = self.model.forward(segments, logits="all")
        # out.logits: [num_rows, vocab]; out.hidden: [num_rows, hidden_size]
        argmax = out.logits.argmax(dim=-1).tolist()  # [num_rows]
        spent = self._spent
        spent.verify_s = self._clock() - began
        if self._budget is not None:
            self._budget.costs.verify.observe(len(argmax), spent.verify_s)
        spent.produced = {}
        counters, first_rows, row = self._counters, [], 0
        counters.verifies += 1
        for seq in batch:
            drafts, num_rows = seq.pending_drafts, len(seq.pending_drafts) + 1
            first_rows.append(row)
            rows = slice(row, row + num_rows)
            row += num_rows
            try:
                accepted, bonus = self._accept(seq, out.logits[rows], argmax[rows])
            except GrammarError as exc:
                seq.fail(str(exc))
                continue
            if self._budget is not None:
                spent.produced[seq.slot] = [*drafts[len(seq.forced_drafts) : accepted], bonus]
            self._settle_verify(seq, [*drafts[:accepted], bonus])
        return out.hidden, first_rows

    def _settle_verify(self, seq: SeqState, emitted: list[int]) -> None:
        """A sequence's verify on the host: ``emitted`` are its kept drafts
        and the bonus token; counts them, emits them, advances ``seq_len``."""
        accepted, counters = len(emitted) - 1, self._counters
        self._count_drafts(seq, accepted)
        before = len(seq.history)
        seq.emit(emitted, self._decode)
        seq.seq_len += accepted + 1
        seq.set_drafts([], None)
        seq.stats.verifies += 1
        seq.stats.verify_tokens += accepted + 1
        counters.seq_verifies += 1
        counters.verify_tokens += accepted + 1
        counters.generated_tokens += len(seq.history) - before
        self._advance_grammar(seq, seq.history[before:])

    def _verify_on_device(self, batch: list[SeqState]) -> None:
        """Phases 3 and 5 on the device (``device_step.py``): one verify, the
        acceptance and the next MTP chain, read back once; then each
        sequence's bookkeeping on the host, as ``_verify`` does it."""
        assert self._device is not None
        chain = self._ladder_nd(len(batch))
        rows = [
            VerifyRow(
                slot=seq.slot,
                start=seq.seq_len,
                tokens=[seq.last_token, *seq.pending_drafts],
                drafts_q=seq.pending_probs is not None,
                params=seq.request.params,
                generator=seq.generator,
                chain=chain,
            )
            for seq in batch
        ]
        self._counters.verifies += 1
        for seq, out in zip(batch, self._device.run(rows), strict=True):
            self._settle_verify(seq, out.emitted)
            # No chain this time (none sure enough): a copy may stand in, as on the host.
            seq.drafts_declined = chain > 0 and not out.drafts
            if not seq.finished and out.drafts:
                sampled = not seq.request.params.greedy
                probs = self._device.draft_probs(seq.slot, len(out.drafts)) if sampled else None
                seq.set_drafts(out.drafts, probs)

    def _accept(
        self,
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

    def _count_drafts(self, seq: SeqState, accepted: int) -> None:
        """Each source's figures count only its own drafts: the forced run
        first, then the MTP chain after it (with a copy in flight the drafter
        is told nothing of its drafts was accepted)."""
        counters, forced = self._counters, len(seq.forced_drafts)
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

    def _emit_first(self, seq: SeqState, logits: torch.Tensor) -> None:  # logits: [vocab]
        """The token the prefill samples after the prompt."""
        try:
            token = self._sample_one(seq, logits)
        except GrammarError as exc:
            seq.fail(str(exc))
            return
        seq.emit([token], self._decode)
        self._counters.generated_tokens += 1
        self._advance_grammar(seq, [token])

    def _advance_grammar(self, seq: SeqState, emitted: list[int]) -> None:
        if seq.grammar is not None and not seq.finished:
            try:
                seq.grammar.advance(emitted)
            except GrammarError as exc:
                seq.fail(str(exc))

    def _draft_after_verify(
        self,
        batch: list[SeqState],
        starts: list[int],
        first_rows: list[int],
        hidden: torch.Tensor,  # [num_rows, hidden_size] of the verify
    ) -> None:
        """Feeds the MTP modules every position the verify made final (rows
        ``0..accepted`` of each sequence: ``h`` of ``last_token`` and of each
        accepted draft, with the token after each) and drafts the next chain.
        The entries the drafts wrote are rewritten whatever was accepted, as
        if none of them had been (see ``spec/mtp.py`` for why). Under the
        budget a sequence whose chain rests holds its rows back, and the head
        takes them all, in order, the next time it drafts (``spec/budget.py``)."""
        if self._drafter is None:
            return
        running = sum(1 for s in self._decoding if not s.finished)
        budget = self._budget
        feeds: list[DraftFeed] = []
        parts: list[torch.Tensor] = []
        released = 0  # held rows fed: a forward dearer than a step's own
        scoring = 0  # rows scored in this forward (``DraftFeed.scored``)
        ahead = self._ahead(batch) if budget is not None else set()
        if budget is not None:
            lines = [s for s in batch if not s.finished and s.slot not in ahead]
            budget.share_head(lines, running)
        for seq, start, first in zip(batch, starts, first_rows, strict=True):
            if seq.finished:
                continue
            next_ids = seq.history[start + 1 : seq.seq_len + 1]
            rows = hidden[first : first + seq.seq_len - start]
            scored = 0
            if budget is not None:
                # A resting chain's rows wait; a drafting one takes them all,
                # and a greedy one scores what it would have drafted there.
                own = budget.for_seq(seq)
                if not budget.wants_chain(seq, running, seq.slot in ahead):
                    own.hold(start, next_ids, rows)
                    continue
                if own.held_rows() and seq.request.params.greedy and not scoring:
                    scored = scoring = SCORED_ROWS  # one feed a forward: the logits cost rows
                released += own.held_rows()
                start, next_ids, rows = own.release(start, next_ids, rows)
            num_drafts = self._chain_len(seq, running)
            feeds.append(DraftFeed(seq, start, next_ids, num_drafts, scored))
            parts.append(rows)
            if budget is not None:
                length, agreement = peek_copy(seq, self._lookup, running)
                budget.rival_copy(seq, length, agreement)
        if feeds:
            began, forwards = self._clock(), self._drafter.forwards
            self._drafter.feed_and_draft(feeds, torch.cat(parts))
            ran = self._drafter.forwards - forwards
            if self._budget is not None:
                costs, took = self._budget.costs, self._clock() - began
                self._spent.head_s += took
                self._budget.head_ran(ran)
                if ran and released:
                    costs.observe_held(released, len(feeds), ran, took)
                elif ran:
                    costs.head.observe(len(feeds), took / ran)

    def _ahead(self, batch: list[SeqState]) -> set[int]:
        """The slots of the lines that draft nothing this step under the
        budget: in a drain (the stream has ended and nothing waits), those
        ahead of the run's last line (``spec/choose.py``, ``lines_ahead``),
        while no line of the run has ended on its own."""
        if not self._stream_done or self._waiting or self._ended_on_its_own:
            return set()
        return lines_ahead([s for s in batch if not s.finished], self._prefilling)

    def _finish(self, finished: list[SeqState]) -> list[Result]:
        results = []
        for seq in finished:
            if seq in self._decoding:
                self._decoding.remove(seq)
            self._ended_on_its_own |= seq.finish_reason == "stop"
            self._free_slots.append(seq.slot)
            if self._shared is not None and seq.scope is not None and seq.error is None:
                self._shared.insert(seq.scope, seq.history)
            if seq.grammar is not None:
                self._counters.count_grammar(len(seq.output_ids), seq.grammar.spent_s)
            self._counters.requests_done += 1
            results.append(seq.result(self._decode))
        return results

    # -- helpers ------------------------------------------------------------

    def _rejection(self, request: Request) -> str | None:
        prompt_len, max_tokens = len(request.prompt_ids), request.params.max_tokens
        if prompt_len == 0:
            return "empty prompt: a request needs at least one prompt token"
        if prompt_len + max_tokens > self._max_len:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"model's {self._max_len} positions per sequence; shorten the prompt, "
                f"lower max_tokens or raise the context length"
            )
        if request.grammar is not None:
            if self._device is not None:
                return (
                    "structured outputs (a grammar) run on the host step only; this run uses "
                    "the device step (--step-path device or CUDA): run it with --step-path host"
                )
            return self._grammar_rejection(request)
        return None

    def _grammar_rejection(self, request: Request) -> str | None:
        """Why a request's grammar cannot run here (no binding for this
        tokenizer, a stop string beside it, a grammar that does not compile)."""
        if request.params.stop:
            return "stop strings cannot be combined with a grammar (they would cut the output)"
        if self._grammars is None and self._grammars_problem is None:
            vocab, eos = self.model.vocab_size, sorted(self._eos)
            try:
                self._grammars = GrammarCompiler.for_tokenizer(self._tokenizer, vocab, eos)
            except GrammarError as exc:
                self._grammars_problem = str(exc)
        if self._grammars is None:
            return self._grammars_problem
        assert request.grammar is not None
        return self._grammars.problem(request.grammar)

    def _scope_key(self, request: Request) -> ScopeKey | None:
        if self._shared is None or request.scope is None:
            return None
        model, tokenizer, adapter = self._scope_fields
        return ScopeKey(model=model, tokenizer=tokenizer, adapter=adapter, tenant=request.scope)

    def _ladder_nd(self, running: int) -> int:
        return self.config.mtp_ladder.drafts_for(running) if self._has_mtp else 0

    def _chain_len(self, seq: SeqState, running: int) -> int:
        cap = self._ladder_nd(max(running, 1)) if self._budget is None else self._chain_cap
        return min(cap, seq.draft_capacity())

    def _clock(self) -> float:
        return self._budget.costs.clock() if self._budget is not None else time.perf_counter()

    def calibrate(self) -> None:
        """Warm-starts the draft budget's cost model, once, from its cache or
        from verifies of 1..64 rows at the start of free slots (a later
        prefill writes those positions anew), and head forwards feeding 1..16
        of those slots a row each (a later feed writes them anew too);
        ``generate`` calls it. Only before a run, while no request holds a
        slot. One sequence's widths fit one slot; wider ones are spread as a
        batch would be. A no-op under the fixed policy."""
        if self._budget is None or self._budget.costs.calibrated:
            return
        assert not (self._prefilling or self._decoding), "calibrate before a run"
        costs, slots = self._budget.costs, self._num_slots

        def forward(rows: int) -> None:
            spread = 1 if rows <= 9 else min(slots, rows)
            width = -(-rows // spread)
            segments, left = [], rows
            for slot in range(spread):
                take = min(width, left)
                if take:
                    segments.append(Segment(slot, 0, [0] * take))
                left -= take
            self.model.forward(segments, logits="all").logits.argmax(dim=-1).tolist()

        head: Callable[[int, int], int] | None = None
        if self._drafter is not None:
            drafter = self._drafter
            seqs: list[SeqState] = []
            rows: list[torch.Tensor] = []  # [slots, hidden_size]: the rows fed, made once

            def head(count: int, each: int) -> int:
                """A head call feeding ``count`` slots ``each`` rows from their
                start, one draft each, through the drafter as a run calls it
                (more than a row: as a catch-up hands over held rows); the
                forwards it ran."""
                if not seqs:  # only when the costs are not read from the cache
                    segments = [Segment(slot, 0, [0]) for slot in range(slots)]
                    rows.append(self.model.forward(segments, logits="last").hidden)
                    request = Request("calibration", (0,), SamplingParams(max_tokens=1))
                    for slot in range(slots):
                        seqs.append(SeqState(request, slot, self._max_len, frozenset(), None, None))
                feeds = [DraftFeed(seq, 0, [0] * each, 1) for seq in seqs[:count]]
                hidden = rows[0][:count].repeat_interleave(each, dim=0)
                before = drafter.forwards
                drafter.feed_and_draft(feeds, hidden)
                return drafter.forwards - before

        costs.calibrate(forward, min(4 * slots, self._max_len - 1), (head, slots) if head else None)

    def _sample_one(self, seq: SeqState, logits: torch.Tensor) -> int:  # logits: [vocab]
        if seq.grammar is not None:
            return first_token(seq, logits)
        if seq.request.params.greedy:
            return int(logits.argmax())
        assert seq.generator is not None
        return draw(target_probs(logits[None, :], seq.request.params)[0], seq.generator)

    def _publish(self, final: bool = False) -> None:
        running = self._prefilling + self._decoding
        now = time.perf_counter()
        budget = self._snapshot.budget
        if self._budget is not None and (
            final or budget is None or now - self._budget_published >= _BUDGET_PUBLISH_S
        ):
            budget, self._budget_published = self._budget.snapshot(), now
        self._snapshot = self._counters.snapshot(
            running=len(running),
            waiting=len(self._waiting),
            copies=self._copies,
            windows=[s.prompt_lookup.window for s in running if s.prompt_lookup is not None],
            wall_s=now - self._started,
            budget=budget,
        )


@dataclass
class _StepTimes:
    """What the current step spent (seconds on the budget's clock), and the
    tokens each slot's verify produced after its forced run."""

    began: float = 0.0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    head_s: float = 0.0  # the drafter call after the verify (the head's forwards)
    produced: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def calibration_key(loaded: LoadedModel) -> dict[str, str]:
    """What a calibration is valid for: the model and its weights as loaded,
    where and in which dtype they run, on how many threads, and with which
    build of the C kernels (a faster kernel prices rows differently)."""
    info = loaded.info
    return {
        "model": loaded.name,
        "source": info.source,
        "weights": info.weights,
        "parameters": str(info.parameters),
        "mtp": f"{info.mtp_layout}:{info.mtp_count}:{info.mtp_head}",
        "device": info.device,
        "dtype": info.dtype,
        "threads": str(torch.get_num_threads()),
        "slots": str(info.num_slots),
        "kernels": _kernel_build(info.weights),
    }


def _kernel_build(weights: str) -> str:
    kernel = packed_kernel() if weights.startswith("packed") else None
    return kernel.build if kernel is not None else "none"


def _truncate_drafts(seq: SeqState, keep: int) -> None:
    if len(seq.pending_drafts) > keep:
        probs = seq.pending_probs[:keep] if seq.pending_probs is not None else None
        seq.set_drafts(seq.pending_drafts[:keep], probs if keep else None)


def _as_decode(tokenizer: Any) -> Decode | None:
    if tokenizer is None:
        return None
    decode = getattr(tokenizer, "decode", None)
    if decode is not None:
        return lambda ids: str(decode(list(ids)))
    if callable(tokenizer):
        return tokenizer
    raise TypeError("tokenizer must have a decode(ids) method or be a decode callable")
