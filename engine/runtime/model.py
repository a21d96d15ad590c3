"""The seams between the engine and a model runtime.

Contract: the engine sees token ids, slots and positions only, never text.
A model owns a KV cache of ``num_slots`` fixed slots, each ``max_len``
positions long. A forward takes *segments*: runs of tokens that each belong to
one slot and start at that slot's current length. Segments of one forward may
belong to different slots at different positions (prefill chunks, single
decode tokens, verify rows of 2..K tokens); a slot appears at most once per
forward. The forward writes the segments' keys and values at their positions
and attends each token to positions ``[0, its own position]`` of its slot.

Nothing in the cache records a length: rollback after a verify is the caller
moving its own ``seq_len`` back, and the next forward on that slot overwrites
the stale positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Segment:
    """Tokens of one slot fed in one forward, at positions ``start..start+len``."""

    slot: int
    start: int
    token_ids: Sequence[int]

    def __post_init__(self) -> None:
        assert self.slot >= 0, "slot must be non-negative"
        assert self.start >= 0, "start must be non-negative"
        assert len(self.token_ids) > 0, "a segment holds at least one token"


LogitRows = Literal["all", "last"]
# An MTP module's forward may also be asked for the rows of an index tensor
# (1-D int64, in its order): the drafter reads rows of a feed besides its last.
MtpLogitRows = LogitRows | torch.Tensor


@dataclass
class ForwardOutput:
    """What one forward returns, rows in segment order.

    ``logits`` has one row per token when asked for ``"all"``, or one row per
    segment (its last token) when asked for ``"last"``. ``hidden`` always has
    one row per token: the final hidden states *before* the final norm, which
    is what the MTP layouts take as ``h_t``.
    """

    logits: torch.Tensor  # [num_tokens or num_segments, vocab] float32
    hidden: torch.Tensor  # [num_tokens, hidden_size]


class Model(Protocol):
    """A causal LM forward over slot-addressed KV cache (see module doc)."""

    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int:
        """Positions per slot: no segment may end beyond it."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def forward(self, segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput: ...


@runtime_checkable
class CopiesPrefixes(Protocol):
    """A model or MTP module whose slots can start from another slot's prefix
    (``engine/prefix_cache.py``); a ``Model`` without it reuses nothing."""

    @property
    def copies_prefixes(self) -> bool: ...

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Cache positions ``0..length-1`` of slot ``source`` into slot ``slot``."""
        ...


class MtpModule(Protocol):
    """One multi-token-prediction module with its own slot KV cache.

    At position ``p`` it takes the main model's hidden state ``h_p`` (pre-norm,
    which predicts token ``p+1``) and the id of token ``p+1``, and predicts
    token ``p+2``. Its segments therefore carry the *next* tokens: a segment
    ``Segment(slot, start, next_ids)`` with ``hidden`` rows ``h_start..`` feeds
    positions ``start..start+len`` of the module's own cache. Applied again on
    its own output hidden state and its own draft, it gives a chain.
    """

    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    def forward(
        self,
        segments: Sequence[Segment],
        hidden: torch.Tensor,  # [num_tokens, hidden_size], rows in segment order
        logits: MtpLogitRows = "all",
    ) -> ForwardOutput: ...
