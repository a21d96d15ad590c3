"""Counters of verified prompt-lookup copies.

Definitions (the same in every report): ``copies`` counts copies that were
verified (settled), not abandoned ones; ``proposed`` the tokens those copies
proposed; ``accepted`` the tokens of them the verify accepted, never more than
proposed. The bonus token a verify always gains is not counted here.
``shared_*`` count the copies the cross-request cache supplied; they are also
counted in the own figures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CopyCounts:
    """``copies``/``proposed``/``accepted`` of one source (see module docstring)."""

    copies: int = 0
    proposed: int = 0
    accepted: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        """Adds one settled copy; ``proposed < 1`` means no copy and is ignored."""
        if proposed < 1:
            return
        self.copies += 1
        self.proposed += proposed
        self.accepted += max(0, min(accepted, proposed))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens; 0.0 before any copy."""
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class LookupStats:
    """Run-wide counters of all copies, and of the shared cache's among them."""

    copies: int = 0
    proposed: int = 0
    accepted: int = 0
    shared_copies: int = 0
    shared_proposed: int = 0
    shared_accepted: int = 0

    def record(self, proposed: int, accepted: int, shared: bool) -> None:
        """Adds one settled copy (the value ``PromptLookupSeq.settle`` returned
        and the accepted count); ``proposed < 1`` means no copy and is ignored."""
        if proposed < 1:
            return
        accepted = max(0, min(accepted, proposed))
        self.copies += 1
        self.proposed += proposed
        self.accepted += accepted
        if shared:
            self.shared_copies += 1
            self.shared_proposed += proposed
            self.shared_accepted += accepted
