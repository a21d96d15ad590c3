"""Per-sequence prompt lookup: an n-gram index over one sequence's history, the
copy window that learns from verifies, and the miss backoff.

Contract: pure Python on token ids (no torch). The engine owns one
``PromptLookupSeq`` per running sequence and drives it in a strict cycle:
``propose``/``propose_with`` marks a copy in flight, and the same engine step
ends it with ``settle(accepted)`` (after the verify) or ``abandon()`` (copy not
used). A proposal never returns an empty list: "no copy" is ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Fallback = Callable[[Sequence[int], int], list[int] | None]
"""``fallback(history, max_len)``: a second source of copies (the shared cache)."""

# Bits per token in an n-gram's index key: the key packs the n tokens into one
# int, exact for ids below 2**21 (every vocabulary in use); larger ids only
# collide, and every hit is re-checked against the tokens anyway. Int keys
# keep the index free of per-entry containers (no tuples for the GC to walk).
_KEY_BITS = 21

# A cooldown longer than this many doublings would never be reached below any
# sane ``miss_backoff``; capping the exponent keeps the shift small.
_MAX_MISS_EXPONENT = 30

# Longest-agreement copies: occurrences of the last token searched, newest
# first, and tokens of agreement counted back at most; the least agreement
# a copy is offered at (the last token alone is an occurrence, not agreement).
LONGEST_CANDIDATES = 32
LONGEST_AGREEMENT = 32
LONGEST_MIN_AGREEMENT = 2


@dataclass(frozen=True)
class PromptLookupConfig:
    """Settings of prompt-lookup copies; each field mirrors a CLI flag.

    ``ngram``: length of the n-gram looked up (``--prompt-lookup-ngram``).
    ``max_drafts``: longest copy and ceiling of the window
    (``--prompt-lookup-max-drafts``). ``max_seqs``: copies are skipped while
    more sequences run (``--prompt-lookup-max-seqs``). ``min_match``: tokens
    that must agree before the match, never fewer than ``ngram``
    (``--prompt-lookup-min-match``). ``miss_backoff``: cap of the cooldown in
    proposal rounds after misses, 0 disables it (``--prompt-lookup-miss-backoff``).
    """

    ngram: int = 4
    max_drafts: int = 8
    max_seqs: int = 8
    min_match: int = 8
    miss_backoff: int = 16

    def __post_init__(self) -> None:
        _check_range("ngram", self.ngram, 1, 64)
        _check_range("max_drafts", self.max_drafts, 1, 256)
        _check_range("max_seqs", self.max_seqs, 1, 1 << 20)
        _check_range("min_match", self.min_match, 1, 4096)
        _check_range("miss_backoff", self.miss_backoff, 0, 1 << 20)

    @property
    def effective_min_match(self) -> int:
        """Tokens that must agree: ``min_match``, but never fewer than ``ngram``."""
        return max(self.min_match, self.ngram)


def _check_range(field: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{field} must be between {low} and {high}, got {value}")


class PromptLookupSeq:
    """Prompt-lookup state of one sequence.

    The index maps each n-gram of the history to the position just after its
    *latest* occurrence, for n-grams that already have a following token (so
    the history's final n-gram never points at itself). ``propose`` indexes only
    the tokens appended since its last call; a shorter history (a rewind) moves
    that mark back and leaves stale entries, which the token-by-token re-check
    of every hit rejects. The history passed in must extend, or be a prefix of,
    the previous one for the index to find every match; proposals stay correct
    whatever is passed, because every hit is re-checked.

    Worked example (ngram 2, min_match 2): history ``[5, 6, 7, 5, 6]`` ends with
    ``(5, 6)``, whose latest earlier occurrence is followed by position 2; the
    copy is ``[7, 5, 6]`` cut to ``max_len``.

    ``longest=True`` (the draft budget's copies, ``--draft-policy auto``):
    the copy follows the earlier occurrence of the last token whose
    preceding tokens agree longest with the history's own, however short
    the agreement beyond the last token itself (``LONGEST_MIN_AGREEMENT``),
    and ``agreement`` says how long it was: the budget prices
    a copy by it (a copy that agrees on more tokens is right more often), so
    the n-gram, ``min_match`` and the miss cooldown, which guard a fixed rule
    against copies that keep failing, do not apply; the fallback is still
    asked whenever the own match agrees on fewer than ``min_match`` tokens.
    Example: in ``[1, 2, 9, 5, 2, 8, 1, 2]`` the last token 2 follows ``1``
    at position 1 and ``5`` at position 4; the first agrees on 2 tokens, so
    the copy is ``[9, 5, 2, ...]`` with ``agreement`` 2 (the
    latest-occurrence rule, ngram 1, would copy ``[8, 1, 2]``).
    """

    def __init__(self, cfg: PromptLookupConfig, longest: bool = False) -> None:
        self._longest = longest
        # Longest-agreement mode: token -> positions just after each of its
        # occurrences, oldest first (``_longest_copy``).
        self._after: dict[int, list[int]] = {}
        self.agreement = 0  # tokens the copy in flight agreed on before it; 0: unknown
        self._ngram = cfg.ngram
        self._min_match = cfg.effective_min_match
        self._max_drafts = cfg.max_drafts
        self._miss_backoff = cfg.miss_backoff
        self._key_mask = (1 << (_KEY_BITS * cfg.ngram)) - 1
        self._index: dict[int, int] = {}  # n-gram key -> position after its latest occurrence
        self._indexed_upto = 0  # positions j < this have their n-gram indexed
        # The key of the n-gram ending at `_indexed_upto`, carried between
        # calls so an appended token costs one shift, not a re-read of n tokens.
        self._tail_key: int | None = None
        self._window = min(2, cfg.max_drafts)
        self._misses = 0
        self._cooldown = 0  # proposal rounds left that propose nothing
        self._in_flight = 0
        self._in_flight_shared = False

    @property
    def window(self) -> int:
        """How many tokens the next copy should propose (the caller's cap)."""
        return self._window

    @property
    def in_flight(self) -> int:
        """Length of the copy awaiting its verify; 0 when none."""
        return self._in_flight

    @property
    def in_flight_shared(self) -> bool:
        """Whether the copy in flight came from the fallback (shared cache)."""
        return self._in_flight_shared

    @property
    def cooldown(self) -> int:
        """Proposal rounds left during which nothing is proposed."""
        return self._cooldown

    def propose(self, history: Sequence[int], max_len: int) -> list[int] | None:
        """A copy of at most ``max_len`` tokens from the history itself, marked
        in flight; ``None`` when there is no qualifying match or during a
        cooldown (which this call then shortens by one round)."""
        return self.propose_with(history, max_len, None)

    def propose_with(
        self, history: Sequence[int], max_len: int, fallback: Fallback | None
    ) -> list[int] | None:
        """Like ``propose``, but asks ``fallback(history, max_len)`` when the
        history has no qualifying match. A fallback copy is clipped to
        ``max_len`` and marked shared. The cooldown applies to both sources.
        ``max_len < 1`` proposes nothing and changes nothing."""
        if self._in_flight:
            raise RuntimeError("prompt lookup: the previous copy was neither settled nor abandoned")
        if max_len < 1:
            return None
        if self._cooldown > 0:
            self._cooldown -= 1
            return None
        self.agreement = 0
        if self._longest:
            copy = self._longest_copy(history, max_len)
            weak = copy is None or self.agreement < self._min_match
        else:
            copy = self._own_copy(history, max_len)
            weak = copy is None
        shared = False
        if weak and fallback is not None:
            found = fallback(history, max_len)
            if found:
                copy, shared = list(found[:max_len]), True
                self.agreement = 0
        if copy is None:
            return None
        self._in_flight, self._in_flight_shared = len(copy), shared
        return copy

    def cut_in_flight(self, length: int) -> None:
        """Records that only the first ``length`` tokens of the copy in flight
        will be verified (e.g. cut to a power of two), so ``settle`` judges the
        window against what was really verified."""
        if not 1 <= length <= self._in_flight:
            raise ValueError(f"cannot cut a copy of {self._in_flight} tokens to {length}")
        self._in_flight = length

    def settle(self, accepted: int) -> int:
        """Ends the copy in flight after its verify accepted ``accepted`` of its
        tokens; returns the copy's length (0, and no change, when none was in
        flight). A copy accepted in full doubles the window up to
        ``max_drafts``; any shortfall halves it down to 1. Nothing accepted is a
        miss: the next ``min(2**(misses-1), miss_backoff)`` proposals propose
        nothing. Any accepted token clears the miss count."""
        proposed = self._in_flight
        if proposed == 0:
            return 0
        accepted = max(0, min(accepted, proposed))
        if accepted == proposed:
            self._window = min(self._window * 2, self._max_drafts)
        else:
            self._window = max(self._window // 2, 1)
        if accepted == 0:
            self._misses = min(self._misses + 1, _MAX_MISS_EXPONENT)
            if self._miss_backoff and not self._longest:
                self._cooldown = min(1 << (self._misses - 1), self._miss_backoff)
        else:
            self._misses = 0
        self._in_flight, self._in_flight_shared = 0, False
        return proposed

    def abandon(self) -> None:
        """Drops the copy in flight unverified; the window is unchanged."""
        self._in_flight, self._in_flight_shared = 0, False

    def _own_copy(self, history: Sequence[int], max_len: int) -> list[int] | None:
        tail_key = self._index_new_tokens(history)
        n, m, end = self._ngram, self._min_match, len(history)
        if tail_key is None or end <= n:
            return None
        after = self._index.get(tail_key)
        # `after < end` rejects entries left behind by a rewind; the slice
        # comparison re-checks min_match tokens (which include the n-gram)
        # against the history as it is now.
        if after is None or after < m or after >= end:
            return None
        if history[after - m : after] != history[end - m :]:
            return None
        return list(history[after : after + max_len])

    def _longest_copy(self, history: Sequence[int], max_len: int) -> list[int] | None:
        """The continuation of the best longest-agreement match (``_longest_match``)."""
        found = self._longest_match(history)
        if found is None:
            return None
        self.agreement, at = found
        return list(history[at : at + max_len])

    def _longest_match(self, history: Sequence[int]) -> tuple[int, int] | None:
        """``(agreement, position)``: of the earlier occurrences of the
        history's last token, the one whose preceding tokens agree longest
        with the history's own (the most recent among equals), searched over
        the latest ``LONGEST_CANDIDATES`` occurrences and ``LONGEST_AGREEMENT``
        tokens back, with the position just after it; None when no
        occurrence agrees on ``LONGEST_MIN_AGREEMENT`` tokens
        (``propose_with`` weighs the agreement against ``min_match`` to ask
        the fallback)."""
        end = len(history)
        after = self._after
        if end < self._indexed_upto:  # a rewind: drop positions past the end
            for kept in after.values():
                while kept and kept[-1] >= end:
                    kept.pop()
            self._indexed_upto = end
        for j in range(max(self._indexed_upto, 1), end):
            after.setdefault(history[j - 1], []).append(j)
        self._indexed_upto = end
        if end < 2:
            return None
        last = history[end - 1]
        positions = after.get(last)
        if not positions:
            return None
        best, best_at = 0, 0
        for j in reversed(positions[-LONGEST_CANDIDATES:]):
            if j >= end or history[j - 1] != last:  # outside the contract: re-checked
                continue
            k = 1
            while k < LONGEST_AGREEMENT and k < j and history[j - 1 - k] == history[end - 1 - k]:
                k += 1
            if k > best:
                best, best_at = k, j
                if k >= LONGEST_AGREEMENT:
                    break
        return (best, best_at) if best >= LONGEST_MIN_AGREEMENT else None

    def _key(self, history: Sequence[int], end: int) -> int:
        """The index key of the n-gram ``history[end - ngram : end]``."""
        key = 0
        for token in history[end - self._ngram : end]:
            key = (key << _KEY_BITS) | token
        return key & self._key_mask

    def _index_new_tokens(self, history: Sequence[int]) -> int | None:
        """Indexes the tokens appended since the last call; returns the key of
        the history's final n-gram (``None`` while it has fewer than n tokens)."""
        n, end = self._ngram, len(history)
        if end < self._indexed_upto:
            # A rewind: positions past the end are no longer indexed; their
            # stale entries stay and fail the bound or the re-check on use.
            self._indexed_upto, self._tail_key = end, None
        if end < n:
            self._indexed_upto = end
            return None
        start = max(self._indexed_upto, n)
        key = self._tail_key
        if key is None or start != self._indexed_upto:
            key = self._key(history, start)
        index, mask = self._index, self._key_mask
        # Position j follows the n-gram ending just before it; a later j
        # overwrites an earlier one, so the latest occurrence wins.
        for j in range(start, end):
            index[key] = j
            key = ((key << _KEY_BITS) | history[j]) & mask
        self._indexed_upto, self._tail_key = end, key
        return key
