"""Slots x positions of the KV cache, from a memory budget.

Contract: ``size_kv_cache`` is a pure function of its numbers. The cache is
preallocated slot-major (``kv_cache.py``, ``latent_cache.py``): ``num_slots``
slots of ``max_len`` positions each, every position holding
``bytes_per_position`` bytes across the main model's layers and one layer per
MTP module (``kv_bytes_per_position``). The result always fits:
``num_slots * max_len * bytes_per_position <= budget_bytes``.

A slot of a model with gated DeltaNet layers also holds ``slot_bytes`` that
do not grow with its length: the layers' recurrent states, conv windows and
a full verify's pending rows (``linear_state.py``). Below, a slot's cost is
``(max_len + headroom) * bytes_per_position + slot_bytes``.

A slot also keeps ``headroom`` positions past ``max_len``, where the device
step's padded verify rows write (``static_step.py``; the loader asks for
``static_step.HEADROOM``, 16): they come out of the same budget, so below a
slot costs ``(max_len + headroom) * bytes_per_position``.

The rule (docs/models.md states it too, beside ``--kv-cache-gb``):

- **a ``max_len`` that was asked for is kept, and the batch shrinks**:
  ``num_slots = min(max_slots, budget // ((max_len + headroom) * bytes_per_position))``.
  Fewer than one slot is an error naming the budget and the minimum (one
  slot of ``max_len``).
- **otherwise the batch is kept, and positions shrink**: ``num_slots =
  max_slots`` and ``max_len = min(context_len, budget // (max_slots *
  bytes_per_position) - headroom)``. Fewer than ``MIN_POSITIONS`` per slot is an error
  naming the budget and the minimum (``max_slots`` slots of
  ``MIN_POSITIONS``).

Why two cases. An explicit ``max_len`` is a promise about requests, as
vLLM's ``--max-model-len`` is: every request of that length must run, so
memory decides how many run at once, never how long one may be (vLLM too
keeps ``--max-model-len`` and derives its concurrency from memory). Without
one, the model's context length is only a ceiling nobody asked for: a batch
generator's throughput is its batch, and holding 16 slots of a 32k context
for prompts of a few thousand tokens would trade away most of the batch for
lengths no request uses. A request longer than the slots then becomes an
error record naming this limit (the engine's, and `generate`'s per line),
not a smaller batch for everyone.

Worked example (MiMo-7B in bfloat16: 36 layers + 1 MTP module, 8 kv heads
of 128, so ``37 * 2 * 1024 * 2`` = 151,552 bytes per position; context
32,768; ``max_slots`` 16; a budget of 20 GiB = 21,474,836,480 bytes):

- no ``max_len``: 16 slots of ``21,474,836,480 // (16 * 151,552)`` = 8,856
  positions;
- ``max_len`` 32,768: ``21,474,836,480 // (32,768 * 151,552)`` = 4 slots of
  32,768 positions;
- ``max_len`` 4,096: 34 slots fit, so ``max_slots``: 16 slots of 4,096.

With the loader's headroom of 16 the first is 16 slots of 8,840 positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

GIB = 2**30
# The fewest positions a slot can have: one prompt token and one output token.
MIN_POSITIONS = 2

PositionsFrom = Literal["max_len", "context", "budget"]


@dataclass(frozen=True)
class KvSizing:
    """The cache's shape and why it is so. ``positions_from``: ``"max_len"``
    (asked for), ``"context"`` (the model's context length) or ``"budget"``
    (what the budget holds at ``num_slots``); ``slots_cut``: the budget held
    fewer than the slots asked for. ``budget_bytes`` is None when no budget
    applied (the CPU default: the slots asked for, at full length)."""

    num_slots: int
    max_len: int
    bytes_per_position: int  # per slot position: main model + MTP modules
    positions_from: PositionsFrom
    slots_cut: bool = False
    budget_bytes: int | None = None
    headroom: int = 0  # positions past max_len each slot also keeps
    slot_bytes: int = 0  # per slot, whatever its length: linear layers' states

    @property
    def cache_bytes(self) -> int:
        """What the caches take: every slot, every position, every stack,
        and every slot's fixed state."""
        per_slot = (self.max_len + self.headroom) * self.bytes_per_position + self.slot_bytes
        return self.num_slots * per_slot

    def describe(self, budget: str | None = None) -> str:
        """Why the cache has this shape, in a clause a message can quote:
        ``"16 slots of 8,856 positions, what a KV cache of 20 GiB holds at 16
        slots"``, ``"4 slots of 32,768 positions, as max_len sets; the most
        slots a KV cache of 20 GiB holds"``. ``budget`` says where the budget
        came from (default: its size in GiB)."""
        plural = "s" if self.num_slots != 1 else ""
        shape = f"{self.num_slots} slot{plural} of {self.max_len:,} positions"
        where = budget or (None if self.budget_bytes is None else f"{gib(self.budget_bytes)} GiB")
        if self.positions_from == "budget":
            return f"{shape}, what a KV cache of {where} holds at {self.num_slots} slot{plural}"
        origin = "as max_len sets" if self.positions_from == "max_len" else "the model's context"
        text = f"{shape}, {origin}"
        if self.slots_cut:
            return f"{text}; the most slots a KV cache of {where} holds"
        return text if where is None else f"{text}, in a KV cache of {where}"


def kv_bytes_per_position(num_layers: int, num_mtp: int, kv_width: int, itemsize: int) -> int:
    """Bytes one slot position takes in every cache: the main model's
    ``num_layers`` layers and one layer per MTP module (each module owns a
    1-layer cache of the main model's shape), each holding ``kv_width``
    numbers (``ArchSpec.kv_width``: keys and values of every kv head, or
    MLA's latent and rope key) of ``itemsize`` bytes."""
    return (num_layers + num_mtp) * kv_width * itemsize


def size_kv_cache(
    budget_bytes: int,
    bytes_per_position: int,
    max_slots: int,
    context_len: int,
    max_len: int | None = None,
    headroom: int = 0,
    slot_bytes: int = 0,
) -> KvSizing:
    """Slots and positions per slot within ``budget_bytes`` (module doc's
    rule). Raises ``ValueError`` naming the budget and the minimum when even
    that does not fit.

    >>> s = size_kv_cache(1000, 10, max_slots=4, context_len=512)
    >>> s.num_slots, s.max_len  # the batch kept: 1000 // (4 * 10) positions
    (4, 25)
    >>> s = size_kv_cache(1000, 10, max_slots=4, context_len=512, max_len=40)
    >>> s.num_slots, s.max_len  # max_len kept: 1000 // (40 * 10) slots
    (2, 40)
    """
    assert bytes_per_position > 0 and max_slots >= 1 and context_len >= MIN_POSITIONS
    assert max_len is None or MIN_POSITIONS <= max_len <= context_len, "max_len within context"
    if max_len is not None:
        one_slot = (max_len + headroom) * bytes_per_position + slot_bytes
        fits = budget_bytes // one_slot
        if fits < 1:
            most = max(0, budget_bytes - slot_bytes) // bytes_per_position
            raise ValueError(
                f"a KV cache of {gib(budget_bytes)} GiB holds no slot of {max_len:,} positions: "
                f"the minimum is {gib(one_slot, up=True)} GiB (one slot); raise the budget "
                f"or lower max_len (at most {most:,} fits)"
            )
        slots = min(max_slots, fits)
        return KvSizing(
            slots,
            max_len,
            bytes_per_position,
            "max_len",
            slots < max_slots,
            budget_bytes,
            headroom,
            slot_bytes,
        )
    positions_bytes = budget_bytes - max_slots * slot_bytes
    fits = max(positions_bytes, 0) // (max_slots * bytes_per_position) - headroom
    if fits < MIN_POSITIONS:
        least = max_slots * ((MIN_POSITIONS + headroom) * bytes_per_position + slot_bytes)
        raise ValueError(
            f"a KV cache of {gib(budget_bytes)} GiB holds {fits} positions per slot for "
            f"{max_slots} slots: the minimum is {gib(least, up=True)} GiB ({max_slots} slots of "
            f"{MIN_POSITIONS}); raise the budget or use fewer slots"
        )
    kept = min(fits, context_len)
    source: PositionsFrom = "context" if fits >= context_len else "budget"
    return KvSizing(
        max_slots, kept, bytes_per_position, source, False, budget_bytes, headroom, slot_bytes
    )


def gib(num_bytes: int, up: bool = False) -> str:
    """Bytes in GiB to three significant digits: ``"2"``, ``"0.25"``,
    ``"113"``, ``"0.00146"``; ``up`` rounds up (a minimum must not read as
    less than what is needed)."""
    if num_bytes <= 0:
        return "0"
    value = Fraction(num_bytes, GIB)
    digits = 2 - math.floor(math.log10(value))  # decimals that keep three significant
    scaled = value * Fraction(10) ** digits
    whole = math.ceil(scaled) if up else math.floor(scaled + Fraction(1, 2))  # half up
    rounded = Fraction(whole) / Fraction(10) ** digits
    text = f"{float(rounded):.{max(digits, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
