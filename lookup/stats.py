"""Counters of verified prompt-lookup copies: one type, nested wherever copies
are counted (per request, per run, per shared cache).

Definitions (the same in every report): ``copies`` counts copies that were
verified (settled), not abandoned ones; ``proposed`` the tokens those copies
proposed; ``accepted`` the tokens of them the verify accepted, never more than
proposed. The bonus token a verify always gains is not counted here.
``LookupStats.shared`` counts the copies the cross-request cache supplied;
they are also counted in ``LookupStats.total``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class CopyCounts:
    """``copies``/``proposed``/``accepted`` of one source (see module docstring)."""

    copies: int = 0
    proposed: int = 0
    accepted: int = 0

    def observe(self, proposed: int, accepted: int) -> None:
        """Adds one settled copy; ``proposed < 1`` means no copy and is ignored."""
        if proposed < 1:
            return
        self.copies += 1
        self.proposed += proposed
        self.accepted += max(0, min(accepted, proposed))

    def minus(self, other: CopyCounts) -> CopyCounts:
        """The counts of copies here that are not in ``other`` (a part of these)."""
        return CopyCounts(
            self.copies - other.copies,
            self.proposed - other.proposed,
            self.accepted - other.accepted,
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens; 0.0 before any copy."""
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class LookupStats:
    """All copies (``total``), the shared cache's among them (``shared``), and
    so those from the sequence's own history (``own``)."""

    total: CopyCounts = field(default_factory=CopyCounts)
    shared: CopyCounts = field(default_factory=CopyCounts)

    def observe(self, proposed: int, accepted: int, shared: bool) -> None:
        """Adds one settled copy (the value ``PromptLookupSeq.settle`` returned
        and the accepted count); ``proposed < 1`` means no copy and is ignored."""
        self.total.observe(proposed, accepted)
        if shared:
            self.shared.observe(proposed, accepted)

    @property
    def own(self) -> CopyCounts:
        return self.total.minus(self.shared)

    def copy(self) -> LookupStats:
        """An independent copy, for a snapshot that must not move with these."""
        return LookupStats(replace(self.total), replace(self.shared))
