"""One running request: its slot, its tokens and its drafts.

Contract (owned by the engine loop, one ``SeqState`` per admitted request):

- ``history`` is prompt + every emitted token. While prefilling, the first
  ``seq_len`` prompt tokens are in the slot's KV cache. Once decoding,
  ``len(history) == seq_len + 1``: every token but the last is in the cache,
  and ``last_token == history[seq_len]`` is the token the next verify feeds
  first: the last one sampled, or, under the device step before its first
  verify, the prompt's own last token (that step's prefill stops one short,
  ``step/device_verify.py``), so ``decoding`` turns true only after that verify. The history prompt lookup matches against, every token the
  sequence holds including ``last_token``, is therefore just ``history``.
- ``pending_drafts`` are the drafts the next verify checks after
  ``last_token``: an MTP chain, a copy or a grammar's forced run. Acceptance
  compares them with the tokens the verify chooses, so how a draft was made
  never matters to it. Each draft source keeps its own per-sequence state,
  not here: the copies' lookup (``spec/copies.py``), whether the chain
  declined (``spec/mtp.py``), the forced run and the verify rows' masks
  (``spec/constrained.py``).
- ``noise_key`` (sampled requests only) keys every token the sequence draws
  (``sampling.py``): the token at a position is a function of the key, the
  position and the distribution there.
- A sequence never emits past ``max_tokens``, and never feeds a position at
  or beyond ``max_len``: ``draft_capacity`` bounds every verify by both, and
  by ``verify_rows`` when the model can roll back only that wide a verify
  (gated DeltaNet layers, ``runtime/linear_state.py``).
- ``grammar`` (constrained requests only) has consumed exactly the emitted
  tokens.
- ``logprobs`` (requests that ask for them) holds one ``TokenLogprob`` per
  output token, in step with ``output_ids``.
- ``cached`` prompt positions came from another slot's cache
  (``prefix_cache.py``); ``head_rows`` counts the rows every MTP module
  holds for good, where the host drafter feeds them behind the main cache;
  ``waited_on`` counts the requests waiting for its rows, which a draft
  policy holds back from the MTP head only where those requests can take
  them held (``DraftPolicy.lend``); ``head_floor``: no MTP module row below
  it is ever run again, its rows having come from another slot.
- ``error`` set means the request failed while decoding (its grammar could
  not go on); it finishes with ``finish_reason == "error"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from metrale.engine.api import FinishReason, Request, RequestStats, Result, TokenLogprob
from metrale.lookup import ScopeKey

if TYPE_CHECKING:
    from metrale.engine.spec.matcher import GrammarMatcher

Decode = Callable[[Sequence[int]], str]
TokenBytes = Callable[[int], bytes]


@dataclass(eq=False)
class SeqState:
    request: Request
    slot: int
    max_len: int  # positions of the slot (the smaller of the model's and the drafter's)
    eos_ids: frozenset[int]
    scope: ScopeKey | None  # the shared-lookup scope; None: neither read nor stored
    noise_key: int | None  # sampling.noise_key; None for greedy requests
    history: list[int] = field(default_factory=list)
    seq_len: int = 0
    pending_drafts: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: FinishReason | None = None
    stop_text: str | None = None  # the text cut before a stop string, once one was hit
    grammar: GrammarMatcher | None = None
    error: str | None = None
    verify_rows: int | None = None  # the model's widest verify; None: any
    logprobs: list[TokenLogprob] | None = None
    cached: int = 0  # prompt positions reused from the prefix cache
    head_rows: int | None = None  # MTP module rows held for good; None: as the main cache
    head_floor: int = 0  # MTP module rows below it came from another slot's cache
    waited_on: int = 0  # requests waiting to copy this one's prefix rows

    def __post_init__(self) -> None:
        if not self.history:
            self.history = list(self.request.prompt_ids)
        if self.request.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def decoding(self) -> bool:
        """Prefill is over and a first token was sampled."""
        return len(self.history) > self.prompt_len

    @property
    def last_token(self) -> int:
        assert len(self.history) == self.seq_len + 1, "only a decoding sequence has a last token"
        return self.history[self.seq_len]

    @property
    def output_ids(self) -> list[int]:
        return self.history[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_capacity(self) -> int:
        """Drafts the next verify may hold: it feeds ``1 + drafts`` tokens from
        ``seq_len`` and emits up to ``1 + drafts`` tokens."""
        left_in_slot = self.max_len - self.seq_len - 1
        left_to_emit = self.request.params.max_tokens - len(self.output_ids) - 1
        most = min(left_in_slot, left_to_emit)
        if self.verify_rows is not None:
            most = min(most, self.verify_rows - 1)
        return max(0, most)

    def set_drafts(self, drafts: list[int]) -> None:
        self.pending_drafts = drafts

    def emit(
        self,
        token_ids: Sequence[int],
        decode: Decode | None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        """Appends sampled tokens, stopping at the first EOS, at ``max_tokens``
        or at the first token whose text completes a stop string; tokens after
        that stop are dropped, and so are their ``logprobs`` (one a token,
        given when the request asked). ``seq_len`` is the caller's to move."""
        assert not self.finished, "a finished sequence emits nothing"
        max_tokens = self.request.params.max_tokens
        first_new = len(self.history)
        for token in token_ids:
            self.history.append(token)
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= max_tokens:
                self.finish_reason = "length"
                break
        stops = self.request.params.stop
        if stops and decode is not None:
            self._cut_at_stop(stops, decode, first_new)
        if self.logprobs is not None:
            assert logprobs is not None, "a request that asked for logprobs gets them a token"
            self.logprobs.extend(logprobs[: len(self.history) - first_new])

    def _cut_at_stop(self, stops: Sequence[str], decode: Decode, first_new: int) -> None:
        # One decode per call tells whether any stop string appeared; only then
        # is the earliest token that completes it searched for, token by token,
        # so the cut does not depend on how many tokens a verify emitted.
        if _find_stop(decode(self._text_ids()), stops) is None:
            return
        for end in range(max(first_new, self.prompt_len) + 1, len(self.history) + 1):
            text = decode(self._text_ids(end))
            cut = _find_stop(text, stops)
            if cut is not None:
                del self.history[end:]
                self.finish_reason, self.stop_text = "stop", text[:cut]
                return

    def _text_ids(self, end: int | None = None) -> list[int]:
        ids = self.history[self.prompt_len : end]
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return ids

    def fail(self, message: str) -> None:
        """Ends the request with an error; the other requests go on."""
        self.finish_reason, self.error = "error", message

    def result(self, decode: Decode | None, token_bytes: TokenBytes | None = None) -> Result:
        """The finished request; the text stops before an EOS and a stop
        string, and so do its logprobs, whose tokens ``token_bytes`` spells."""
        assert self.finish_reason is not None, "only a finished sequence has a result"
        if self.grammar is not None:
            self.stats.grammar_s = self.grammar.spent_s
        if self.error is not None:
            return replace(error_result(self.request, self.error), stats=self.stats)
        text = self.stop_text
        if text is None:
            text = decode(self._text_ids()) if decode is not None else ""
        logprobs, spelled = None, {}
        if self.logprobs is not None:
            logprobs = tuple(self.logprobs[: len(self._text_ids())])
            named = {t.token_id for t in logprobs} | {i for t in logprobs for i, _ in t.top}
            if token_bytes is not None:
                spelled = {i: token_bytes(i) for i in sorted(named)}
        return Result(
            request_id=self.request.request_id,
            prompt_tokens=self.prompt_len,
            output_ids=tuple(self.output_ids),
            text=text,
            finish_reason=self.finish_reason,
            stats=self.stats,
            logprobs=logprobs,
            token_bytes=spelled,
            cached_tokens=self.cached,
        )


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in ``text``; None when none does."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def error_result(request: Request, message: str) -> Result:
    """A request that could not be generated; the run goes on."""
    return Result(
        request_id=request.request_id,
        prompt_tokens=len(request.prompt_ids),
        output_ids=(),
        text="",
        finish_reason="error",
        stats=RequestStats(),
        error=message,
    )
