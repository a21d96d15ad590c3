"""Run-wide figures, readable at any time by the live view.

Definitions:
- ``verifies``: forward passes of the main model that decoded tokens (prefill
  passes are counted apart in ``prefills``).
- ``mean_tokens_per_verify`` = tokens emitted by verifies / verifies. It
  counts the bonus token (the model's own token after the last accepted
  draft), so plain decoding scores exactly 1.0.
- MTP ``proposed_by_position[i]``/``accepted_by_position[i]``: drafts at chain
  depth ``i + 1`` that were verified / accepted. A draft is only counted at
  depth ``i + 1`` when it was proposed at all.
- Prompt lookup ``copies``/``proposed``/``accepted``: copies verified, tokens
  they proposed, tokens of them accepted; ``shared_*`` the same for copies the
  cross-request cache supplied (also counted in the own figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    """An immutable snapshot; the engine builds a new one when asked."""

    requests_total: int = 0
    requests_done: int = 0
    requests_failed: int = 0
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verifies: int = 0
    prefills: int = 0
    wall_s: float = 0.0
    mtp_proposed_by_position: tuple[int, ...] = ()
    mtp_accepted_by_position: tuple[int, ...] = ()
    copies: int = 0
    copy_proposed: int = 0
    copy_accepted: int = 0
    shared_copies: int = 0
    shared_proposed: int = 0
    shared_accepted: int = 0
    window_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_tokens_per_verify(self) -> float:
        """Counts the bonus token: 1.0 means no draft was ever accepted."""
        return self.generated_tokens / self.verifies if self.verifies else 0.0

    @property
    def mtp_proposed(self) -> int:
        return sum(self.mtp_proposed_by_position)

    @property
    def mtp_accepted(self) -> int:
        return sum(self.mtp_accepted_by_position)
