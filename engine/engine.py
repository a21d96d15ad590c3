"""The batch engine: continuous batching over fixed KV slots, one verify per step.

Contract: ``Engine.generate`` takes requests lazily (it pulls a request only
when a slot is about to be free, so an endless stream works) and yields each
``Result`` as soon as it finishes, in completion order. A request that cannot
be generated (empty prompt, prompt + ``max_tokens`` beyond the slot length)
comes back at once as a ``finish_reason == "error"`` result; nothing a request
holds stops the run.

The engine keeps the loop: admit, step, finish, results. How a step runs is
its ``Step``'s (``step/host.py`` or ``step/device.py``), and which drafts a
verify checks is its ``DraftPolicy``'s (``spec/policy.py``): the loop
branches on neither. Output never depends on the drafts: greedy output is
plain decoding token for token, sampled output is plain sampling in
distribution.

``Engine.stats`` returns an immutable snapshot the loop publishes once a
step; any thread may read it at any time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from metrale.engine.api import Request, Result
from metrale.engine.config import EngineConfig
from metrale.engine.logprobs import TokenBytes
from metrale.engine.prefix_cache import Lender, PrefixCache, copiers
from metrale.engine.runtime.model import Model, MtpModule
from metrale.engine.sampling import noise_key
from metrale.engine.sequence import Decode, SeqState, error_result
from metrale.engine.spec.auto import AutoPolicy
from metrale.engine.spec.calibration import calibration_cache
from metrale.engine.spec.copies import lookup_of
from metrale.engine.spec.cost import CostModel
from metrale.engine.spec.grammar import GrammarCompiler
from metrale.engine.spec.matcher import ModelGrammars
from metrale.engine.spec.policy import DraftPolicy, FixedPolicy
from metrale.engine.stats import EngineStats, RunCounters
from metrale.engine.step import Queues, Step, StepTimes
from metrale.engine.step.books import Books, StepSetup
from metrale.engine.step.device import DeviceStep, device_lookup
from metrale.engine.step.device_verify import DeviceVerify, device_verify_for
from metrale.engine.step.host import HostStep
from metrale.lookup import LookupStats, ScopeKey, SharedLookup

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel


# Marks the end of the request stream (``None`` from it means "not yet").
_END = object()
# How long an engine with nothing to do waits before asking a quiet source again.
_IDLE_POLL_S = 0.005


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
        # The bytes of the tokens a result's logprobs name.
        self._token_bytes = TokenBytes(tokenizer, self._decode).spell if self._decode else None
        mtp = mtp if config.mtp else ()
        device = device_verify_for(model, mtp, config)
        lookup = config.prompt_lookup if device is None else device_lookup(config.prompt_lookup)
        shared = config.shared_lookup_config()
        self._shared = SharedLookup(shared) if shared is not None else None
        self.policy: DraftPolicy = FixedPolicy(config.mtp_ladder, bool(mtp), lookup, self._shared)
        if config.draft_policy == "auto":
            self.policy = AutoPolicy(
                config.mtp_ladder, lookup, self._shared, costs, config.budget_ablation
            )
        drafter = None
        if mtp and device is None:
            drafter = self.policy.make_drafter(mtp, config.mtp_min_prob)
        self._drafter = drafter
        self._eos = frozenset(eos_token_ids)
        self._grammars = ModelGrammars(tokenizer, model.vocab_size, self._eos, grammars)
        self._scope_fields = (model_name, tokenizer_name, adapter)
        self._num_slots = min(model.num_slots, config.max_batch)
        self._max_len = model.max_len
        # A model with linear layers rolls back within its widest verify only.
        self._verify_rows: int | None = getattr(model, "max_verify_rows", None)
        if drafter is not None:
            assert drafter.num_slots >= self._num_slots, "MTP slots < model slots"
            self._max_len = min(self._max_len, drafter.max_len)
        self._free_slots = list(range(self._num_slots - 1, -1, -1))
        lender = self.policy if drafter is not None else None
        self._prefixes = _prefix_cache(model, mtp, config, self._num_slots, device, lender)
        self._queues = Queues()
        self._counters = RunCounters(prefix_cache=self._prefixes is not None)
        self._copies = LookupStats()
        setup = StepSetup(
            model=model,
            policy=self.policy,
            drafter=drafter,
            books=Books(self._counters, self._decode),
            copies=self._copies,
            shared=self._shared,
            prefill_chunk=config.prefill_chunk,
            forced_drafts=config.forced_drafts,
        )
        self._device = device
        self._path: Step = (
            HostStep(setup) if device is None else DeviceStep(setup, device, bool(mtp))
        )
        self._started = time.perf_counter()
        self._generating = False
        self._snapshot = EngineStats()

    @classmethod
    def from_loaded(
        cls, loaded: LoadedModel, config: EngineConfig, grammars: GrammarCompiler | None = None
    ) -> Engine:
        """An engine over a loaded model; ``grammars`` shares a grammar
        binding (and its compiled grammars) another engine of the model built."""
        tokenizer_name = getattr(loaded.tokenizer, "name_or_path", "") or loaded.name
        costs = None
        if config.draft_policy == "auto":
            costs = CostModel(cache=calibration_cache(loaded))
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
        a caller run other work between steps (the budget bench has several
        engines take turns step by step)."""
        stream = iter(requests)
        self.calibrate()
        self._started, self._generating = time.perf_counter(), True
        try:
            yield from self._run(stream)
        finally:
            self._generating = False
            self.policy.save()
            self._publish(final=True)

    def calibrate(self) -> None:
        """Warm-starts the draft policy's cost figures before a run (a no-op
        under the fixed policy, or once done); ``generate`` calls it."""
        queues = self._queues
        assert not (queues.prefilling or queues.decoding), "calibrate before a run"
        self.policy.calibrate(self.model, self._drafter, self._num_slots, self._max_len)

    def graph_shapes(self) -> list[tuple[Any, ...]]:
        """The shapes the device step captured as CUDA graphs (none elsewhere)."""
        return self._device.graph_shapes() if self._device is not None else []

    @property
    def step_path(self) -> str:
        """``device`` or ``host``: which step this engine runs (``EngineConfig.step_path``)."""
        return self._path.name

    # -- the loop -----------------------------------------------------------

    def _run(self, stream: Iterator[Request | None]) -> Iterator[list[Result]]:
        queues = self._queues
        queues.stream_done = False
        while True:
            # Pull only what the free slots can take this step, so a huge
            # stream is read as it is consumed.
            idle_source = False
            while not queues.stream_done and len(queues.waiting) < len(self._free_slots):
                request = next(stream, _END)
                if request is _END:
                    queues.stream_done = True
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
                queues.waiting.append(request)
            attached = self._prefixes is not None and self._prefixes.waiting
            if not (queues.waiting or queues.prefilling or queues.decoding or attached):
                if queues.stream_done:
                    return
                if idle_source:
                    time.sleep(_IDLE_POLL_S)
                continue
            yield self._step()

    def _step(self) -> list[Result]:
        times = StepTimes(began=self.policy.clock())
        # 1. Admit waiting requests into free slots, each from the longest
        # cached prefix; those whose source now holds it join the step.
        self._attach_ready()
        self._admit()
        self._attach_ready()
        self._queues.attached = len(self._prefixes.waiting) if self._prefixes is not None else 0
        self._queues.free_slots = len(self._free_slots)
        # 2. The step: prefill a chunk, draft, verify, draft the next chain.
        done = self._path.run(self._queues, times)
        # 3. Finish: free slots, store in the shared cache, hand back results.
        results = self._finish(done + [s for s in self._queues.decoding if s.finished])
        self.policy.end_step(times)
        self._publish()
        return results

    def _admit(self) -> None:
        # Without a prefix cache, the lowest free slot first: the device
        # step's batch is slots 0..B-1.
        self._free_slots.sort(reverse=True)
        prefixes = self._prefixes
        while self._free_slots and self._queues.waiting:
            request = self._queues.waiting.popleft()
            params = request.params
            reuse = None
            if prefixes is None:
                slot = self._free_slots.pop()
            else:
                slot, reuse = prefixes.choose_slot(request.prompt_ids, self._free_slots)
                if self._drafter is not None:
                    # The source's owed rows are read as far as they are
                    # reused; the slot's old ones are written over.
                    if reuse is not None:
                        self._drafter.pay(reuse.source.slot, reuse.lagged)
                    self._drafter.forget(slot)
            seq = SeqState(
                request=request,
                slot=slot,
                max_len=self._max_len,
                eos_ids=self._eos | frozenset(params.eos_token_ids),
                scope=self._scope_key(request),
                noise_key=noise_key(params, request.choice),
                grammar=self._grammars.matcher(request.grammar),
                verify_rows=self._verify_rows,
                head_rows=0 if self._drafter is not None else None,
            )
            self._counters.prompt_tokens += len(request.prompt_ids)
            self._counters.admitted += 1
            if prefixes is None or prefixes.admit(seq, reuse):
                self._join(seq)

    def _attach_ready(self) -> None:
        """Admits to the step every sequence whose prefix source got far enough."""
        if self._prefixes is not None:
            for seq in self._prefixes.ready():
                self._join(seq)

    def _join(self, seq: SeqState) -> None:
        if seq.cached:
            self._counters.cached_tokens += seq.cached
            self._counters.prefix_hits += 1
        self._path.admit(seq, self._queues)

    def _finish(self, finished: list[SeqState]) -> list[Result]:
        results = []
        for seq in finished:
            if seq in self._queues.decoding:
                self._queues.decoding.remove(seq)
            self._free_slots.append(seq.slot)
            self._feed_ended(seq)
            if self._shared is not None and seq.scope is not None and seq.error is None:
                self._shared.insert(seq.scope, seq.history)
            if seq.grammar is not None:
                self._counters.count_grammar(len(seq.output_ids), seq.grammar.spent_s)
            self._counters.requests_done += 1
            results.append(seq.result(self._decode, self._token_bytes))
        return results

    def _feed_ended(self, seq: SeqState) -> None:
        """The head owes the prompt rows ``seq``'s chain held (``DraftPolicy.ended``):
        its slot serves the prompt's prefix to a request after it, which
        has the head read them first (``_admit``, ``MtpDrafter.owe``)."""
        if self._prefixes is None or self._drafter is None or seq.error is not None:
            return
        feed = self.policy.ended(seq)
        if feed is not None:
            self._drafter.owe(*feed)
            if seq.waited_on:  # a request waits to copy them now
                self._drafter.pay(seq.slot, seq.prompt_len)

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
        return self._path.rejection(request) or self._grammars.rejection(request)

    def _scope_key(self, request: Request) -> ScopeKey | None:
        if self._shared is None or request.scope is None:
            return None
        model, tokenizer, adapter = self._scope_fields
        return ScopeKey(model=model, tokenizer=tokenizer, adapter=adapter, tenant=request.scope)

    def _publish(self, final: bool = False) -> None:
        queues = self._queues
        running = queues.prefilling + queues.decoding
        attached = len(self._prefixes.waiting) if self._prefixes is not None else 0
        self._snapshot = self._counters.snapshot(
            running=len(running) + attached,
            waiting=len(queues.waiting),
            copies=self._copies,
            windows=[w.window for w in map(lookup_of, running) if w is not None],
            wall_s=time.perf_counter() - self._started,
            budget=self.policy.snapshot(final),
        )


def _prefix_cache(
    model: Model,
    mtp: Sequence[MtpModule],
    config: EngineConfig,
    num_slots: int,
    device: DeviceVerify | None,
    lender: Lender | None,
) -> PrefixCache | None:
    """The slots as a prefix cache, where the config asks for one and the
    model and every MTP module in use can copy a prefix (``prefix_cache.py``).
    Module ``k`` of a host stack reads token ``p+1+k`` at row ``p``, so the
    copies of its rows lag the shared prefix by the stack's depth; the
    device step runs one module. ``lender``: the host drafter's policy."""
    found = copiers(model, mtp) if config.prefix_cache else None
    if found is None:
        return None
    lag = (1 if device is not None else len(mtp)) if mtp else 0
    return PrefixCache(found, num_slots, lag, device is not None, lender)


def _as_decode(tokenizer: Any) -> Decode | None:
    if tokenizer is None:
        return None
    decode = getattr(tokenizer, "decode", None)
    if decode is not None:
        return lambda ids: str(decode(list(ids)))
    if callable(tokenizer):
        return tokenizer
    raise TypeError("tokenizer must have a decode(ids) method or be a decode callable")
