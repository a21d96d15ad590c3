"""The engine step: one pass of admitted prefill, drafts, verify and drafting.

Contract: the ``Engine`` (``engine.py``) owns the loop and the ``Queues``;
a ``Step`` owns how a step runs on its path. Two implementations, each read
top to bottom in its own file: ``HostStep`` (``host.py``: the verify's
acceptance on the host, the MTP head through ``spec/mtp.py``) and
``DeviceStep`` (``device.py``: one upload, acceptance and the MTP chain on
the model's device, one readback, ``device_verify.py``). Both draft through
a ``DraftPolicy`` (``spec/policy.py``) and share the per-sequence
bookkeeping of ``books.py``, so a sequence's emitted tokens, counters and
finish do not depend on the path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from metrale.engine.api import Request
from metrale.engine.sequence import SeqState


@dataclass
class Queues:
    """The requests of a run by phase, and what the run knows of its end.

    ``waiting`` were pulled from the stream and wait for a slot;
    ``prefilling`` hold a slot and read their prompts; ``decoding`` verify a
    step at a time (a finished sequence stays there until the step's finish
    phase takes it out)."""

    waiting: deque[Request] = field(default_factory=deque)
    prefilling: list[SeqState] = field(default_factory=list)
    decoding: list[SeqState] = field(default_factory=list)
    stream_done: bool = False  # the request stream has ended: nothing will join
    attached: int = 0  # hold a slot and wait to copy a prompt prefix (``prefix_cache.py``)
    free_slots: int = 0  # slots no request holds, after this step's admission

    def running(self) -> int:
        """Decoding sequences that have not finished."""
        return sum(1 for s in self.decoding if not s.finished)

    def draining(self) -> bool:
        """The batch only thins from here: a slot is free, the stream has
        ended, and no request waits for a slot, reads its prompt or waits to
        copy a prefix."""
        joining = self.waiting or self.prefilling or self.attached
        return self.free_slots > 0 and self.stream_done and not joining


@dataclass
class StepTimes:
    """What the current step spent, in seconds on the policy's clock, and the
    tokens each slot's verify produced after its forced run (the accepted
    drafts and the bonus token)."""

    began: float = 0.0
    prefill_s: float = 0.0
    verify_s: float = 0.0
    verify_rows: int = 0
    head_s: float = 0.0  # the MTP head's forwards after the verify
    produced: dict[int, list[int]] = field(default_factory=dict)


class Step(Protocol):
    """One engine step on one path (module doc)."""

    name: str  # "host" or "device"

    def admit(self, seq: SeqState, queues: Queues) -> None:
        """Puts a sequence that was just given a slot in its first phase."""
        ...

    def run(self, queues: Queues, times: StepTimes) -> list[SeqState]:
        """Prefills one chunk and runs one verify over the decoding sequences;
        returns the sequences whose prefill finished them (the engine's finish
        phase collects the decoding ones that finished)."""
        ...

    def rejection(self, request: Request) -> str | None:
        """Why this path cannot run ``request``; None when it can."""
        ...
