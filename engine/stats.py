"""Run-wide figures, readable at any time by the live view.

Definitions:
- ``verifies``: forward passes of the main model that decoded tokens (prefill
  passes are counted apart in ``prefills``).
- ``seq_verifies``: verifies of one sequence each (a pass verifying 16
  sequences counts 16); ``verify_tokens``: tokens those verifies produced,
  accepted drafts plus the bonus token, before any cut at EOS or a stop.
- ``mean_tokens_per_verify`` = ``verify_tokens / seq_verifies``: the mean
  acceptance length. It counts the bonus token (the model's own token after
  the last accepted draft), so plain decoding scores exactly 1.0 at any batch
  size. ``generated_tokens`` also counts each request's first token, which its
  prefill samples.
- MTP ``proposed_by_position[i]``/``accepted_by_position[i]``: drafts at chain
  depth ``i + 1`` that were verified / accepted. A draft is only counted at
  depth ``i + 1`` when it was proposed at all.
- ``prompt_lookup``: copies verified, tokens they proposed, tokens of them
  accepted, in total and for the copies the cross-request cache supplied
  (``metrale.lookup.stats`` defines them).
- ``forced_proposed``/``forced_accepted``: drafts that were a grammar's
  forced continuation (the only token its mask allowed), verified / accepted;
  they are always accepted, and are counted neither as MTP drafts nor copies.
- ``grammar_s``: time spent on grammars (forced runs, masks, checking drafts,
  advancing matchers, applying masks to logits) by the finished constrained
  requests, ``grammar_tokens`` the tokens those requests emitted, so
  ``grammar_us_per_token`` is the grammar's cost per constrained token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from metrale.lookup import LookupStats


@dataclass(frozen=True)
class BudgetStats:
    """What the draft budget (``--draft-policy auto``) chose and believed.

    ``chosen[source][n]``: sequence-steps that verified ``n`` drafts of
    ``source`` (``"mtp"`` or ``"copy"``); ``no_drafts``: those that verified
    none beyond a grammar's forced run. ``verify_ms``: the cost model's verify
    time by row-count bucket; ``head_ms``: one MTP head forward by the
    sequences it drafts for; ``other_ms``: the rest of a step. ``predicted_ms``
    and ``measured_ms``: mean step time as planned and as it came out, both
    without the head's forwards after the verify (priced apart).
    ``copy_acceptance[j]`` / ``mtp_acceptance[d]``: the run's estimate that
    copy position ``j + 1`` / chain depth ``d + 1`` is accepted when every
    draft before it is."""

    steps: int = 0
    chosen: dict[str, dict[int, int]] = field(default_factory=dict)
    no_drafts: int = 0
    verify_ms: dict[int, float] = field(default_factory=dict)
    head_ms: dict[int, float] = field(default_factory=dict)
    other_ms: float = 0.0
    predicted_ms: float = 0.0
    measured_ms: float = 0.0
    copy_acceptance: tuple[float, ...] = ()
    mtp_acceptance: tuple[float, ...] = ()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot; the engine builds a new one when asked and never changes
    one it handed out (its ``prompt_lookup`` is a copy)."""

    requests_total: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verifies: int = 0
    prefills: int = 0
    # The prefix cache (when on): prompt tokens reused rather than
    # prefilled, the requests given a slot, and those of them that reused any.
    prefix_cache: bool = False
    cached_tokens: int = 0
    admitted: int = 0
    prefix_hits: int = 0
    wall_s: float = 0.0
    mtp_proposed_by_position: tuple[int, ...] = ()
    mtp_accepted_by_position: tuple[int, ...] = ()
    prompt_lookup: LookupStats = field(default_factory=LookupStats)
    window_histogram: dict[int, int] = field(default_factory=dict)
    seq_verifies: int = 0
    verify_tokens: int = 0
    forced_proposed: int = 0
    forced_accepted: int = 0
    grammar_requests: int = 0
    grammar_tokens: int = 0
    grammar_s: float = 0.0
    budget: BudgetStats | None = None  # None under --draft-policy fixed

    @property
    def grammar_us_per_token(self) -> float:
        return 1e6 * self.grammar_s / self.grammar_tokens if self.grammar_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """The share of admitted requests that reused a cached prefix."""
        return self.prefix_hits / self.admitted if self.admitted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_tokens_per_verify(self) -> float:
        """Counts the bonus token: 1.0 means no draft was ever accepted."""
        return self.verify_tokens / self.seq_verifies if self.seq_verifies else 0.0

    @property
    def mtp_proposed(self) -> int:
        return sum(self.mtp_proposed_by_position)

    @property
    def mtp_accepted(self) -> int:
        return sum(self.mtp_accepted_by_position)


@dataclass
class RunCounters:
    """The engine's live counters; only the engine's own thread touches them,
    and other threads read the ``EngineStats`` snapshots they publish."""

    requests_total: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verifies: int = 0
    seq_verifies: int = 0
    verify_tokens: int = 0
    prefills: int = 0
    prefix_cache: bool = False
    cached_tokens: int = 0
    admitted: int = 0
    prefix_hits: int = 0
    mtp_proposed_by_position: list[int] = field(default_factory=list)
    mtp_accepted_by_position: list[int] = field(default_factory=list)
    forced_proposed: int = 0
    forced_accepted: int = 0
    grammar_requests: int = 0
    grammar_tokens: int = 0
    grammar_s: float = 0.0

    def count_mtp(self, proposed: int, accepted: int, first_depth: int = 0) -> None:
        """One verified MTP chain of ``proposed`` drafts, ``accepted`` of them
        kept, its first draft at chain depth ``first_depth + 1`` (a chain
        that goes on after a grammar's forced run starts deeper)."""
        while len(self.mtp_proposed_by_position) < first_depth + proposed:
            self.mtp_proposed_by_position.append(0)
            self.mtp_accepted_by_position.append(0)
        for k in range(proposed):
            self.mtp_proposed_by_position[first_depth + k] += 1
            self.mtp_accepted_by_position[first_depth + k] += k < accepted

    def count_grammar(self, tokens: int, spent_s: float) -> None:
        """One finished constrained request: its emitted tokens and grammar time."""
        self.grammar_requests += 1
        self.grammar_tokens += tokens
        self.grammar_s += spent_s

    def snapshot(
        self,
        running: int,
        waiting: int,
        copies: LookupStats,
        windows: Iterable[int],
        wall_s: float,
        budget: BudgetStats | None = None,
    ) -> EngineStats:
        return EngineStats(
            requests_total=self.requests_total,
            requests_done=self.requests_done,
            requests_failed=self.requests_failed,
            running=running,
            waiting=waiting,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            verifies=self.verifies,
            prefills=self.prefills,
            prefix_cache=self.prefix_cache,
            cached_tokens=self.cached_tokens,
            admitted=self.admitted,
            prefix_hits=self.prefix_hits,
            wall_s=wall_s,
            mtp_proposed_by_position=tuple(self.mtp_proposed_by_position),
            mtp_accepted_by_position=tuple(self.mtp_accepted_by_position),
            prompt_lookup=copies.copy(),
            window_histogram=dict(Counter(windows)),
            seq_verifies=self.seq_verifies,
            verify_tokens=self.verify_tokens,
            forced_proposed=self.forced_proposed,
            forced_accepted=self.forced_accepted,
            grammar_requests=self.grammar_requests,
            grammar_tokens=self.grammar_tokens,
            grammar_s=self.grammar_s,
            budget=budget,
        )
