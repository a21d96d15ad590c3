"""Acceptance estimates: the chance a draft is accepted given that every
draft before it was, per key, for the draft budget (``budget.py``).

Contract: a key is ``("copy", position)`` for a prompt-lookup copy and
``("mtp", depth)`` for the MTP chain. ``Rates`` keeps decayed (accepted,
seen) counts per key, each over its parent's estimate (``_parent``: the
position or depth before it), so what one key has seen informs those not
seen yet. Positions and depths count from 1 and 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

Key = tuple[object, ...]


# Copy positions beyond this share one estimate.
COPY_POSITIONS = 8
# What a run believes of a first draft before it has seen one, and how
# firmly every estimate holds to the one it starts from (in drafts).
FIRST_PRIOR = 0.5
RUN_STRENGTH = 2.0
RUN_DECAY = 0.995


def _parent(key: Key) -> Key | None:
    """The estimate a key's own starts from: a depth, or a copy position,
    from the one before it (a chain that has held so far is believed to hold
    on); None: ``FIRST_PRIOR``."""
    position = int(key[1])  # type: ignore[call-overload]
    first = 0 if key[0] == "mtp" else 1
    return (key[0], position - 1) if position > first else None


class Rates:
    """Decayed (accepted, seen) counts per key, each over its parent's estimate
    (module doc)."""

    def __init__(self, decay: float, strength: float) -> None:
        self.decay, self.strength = decay, strength
        self._counts: dict[Key, tuple[float, float]] = {}
        # Moves whenever a rate may: a figure derived from these keeps till it does.
        self.observed = 0

    def rate(self, key: Key) -> float:
        accepted, seen = self._counts.get(key, (0.0, 0.0))
        parent = _parent(key)
        base = self.rate(parent) if parent is not None else FIRST_PRIOR
        return (accepted + self.strength * base) / (seen + self.strength)

    def counts(self, key: Key) -> tuple[float, float]:
        """The decayed (accepted, seen) counts of ``key`` itself."""
        return self._counts.get(key, (0.0, 0.0))

    def observe(self, key: Key, accepted: bool) -> None:
        old_accepted, old_seen = self._counts.get(key, (0.0, 0.0))
        self._counts[key] = (old_accepted * self.decay + accepted, old_seen * self.decay + 1.0)
        self.observed += 1


def copy_key(position: int) -> Key:
    return ("copy", min(position, COPY_POSITIONS))


def copy_keys(drafts: int) -> list[Key]:
    return [copy_key(j) for j in range(1, drafts + 1)]


def accepted_prefix(agreed: Sequence[bool]) -> list[bool]:
    """``agreed`` up to its first False: the drafts a verify would accept."""
    return list(itertools.takewhile(bool, agreed))


def score(rates: Rates, keys: Sequence[Key], proposed: int, accepted: int) -> None:
    """Observes drafts ``1..proposed`` of ``keys`` after a verify that accepted
    the first ``accepted``: each one reached (all before it accepted) counts."""
    for j in range(min(proposed, accepted + 1, len(keys))):
        rates.observe(keys[j], j < accepted)


def cumulative(odds: Iterable[float]) -> list[float]:
    """Expected accepted drafts for 1..n drafts of conditional odds ``odds``."""
    gains, reach, total = [], 1.0, 0.0
    for p in odds:
        reach *= p
        total += reach
        gains.append(total)
    return gains
