"""Per-sequence prompt lookup: an n-gram index over one sequence's history, the
copy window that learns from verifies, and the miss backoff.

Contract: pure Python on token ids (no torch). The engine owns one
``PromptLookupSeq`` per running sequence and drives it in a strict cycle:
``propose``/``propose_with`` marks a copy in flight, and the same engine step
ends it with ``settle(accepted)`` (after the verify) or ``abandon()`` (copy not
used). A proposal never returns an empty list: "no copy" is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        _check_range("--prompt-lookup-ngram", self.ngram, 1, 64)
        _check_range("--prompt-lookup-max-drafts", self.max_drafts, 1, 256)
        _check_range("--prompt-lookup-max-seqs", self.max_seqs, 1, 1 << 20)
        _check_range("--prompt-lookup-min-match", self.min_match, 1, 4096)
        _check_range("--prompt-lookup-miss-backoff", self.miss_backoff, 0, 1 << 20)

    @property
    def effective_min_match(self) -> int:
        """Tokens that must agree: ``min_match``, but never fewer than ``ngram``."""
        return max(self.min_match, self.ngram)


def _check_range(flag: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{flag} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{flag} must be between {low} and {high}, got {value}")
