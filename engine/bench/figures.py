"""What `metrale bench` reports: figures per configuration and workload, and
output differences.

Figures (``Figures``): tokens/s = generated tokens / median wall time;
``ratio`` = tokens/s over transformers greedy at the same batch size;
``mean_tokens_per_verify`` is the engine's (accepted drafts + the bonus
token per sequence verify, so plain decoding scores 1.0; metrale only);
``passes_per_token`` = forward passes of the main model (prefill included,
one batched pass counts once) per generated token; ``peak_mb`` is described in
``bench_memory`` plus the weights and preallocated caches the configuration
holds (on CPU; CUDA's figure includes them already).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Side = Literal["transformers", "metrale"]


@dataclass(frozen=True)
class Mismatch:
    """The first request (in workload order) whose output differs from the
    reference; ``position`` is the index of the first differing output token."""

    request_id: str
    position: int
    expected: tuple[int, ...]
    got: tuple[int, ...]


@dataclass(frozen=True)
class Figures:
    """One configuration on one workload (see the module doc for definitions).
    ``available`` is False when it could not run (``note`` says why)."""

    key: str
    label: str
    side: Side
    batch: int
    available: bool = True
    note: str = ""
    wall_s: tuple[float, ...] = ()
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    ratio: float | None = None
    mean_tokens_per_verify: float | None = None
    passes_per_token: float | None = None
    copies: int | None = None
    copy_proposed: int | None = None
    copy_accepted: int | None = None
    mtp_acceptance: tuple[float, ...] = ()  # accepted / proposed at chain depth 1, 2, ...
    peak_mb: float | None = None
    mismatch: Mismatch | None = None

    @property
    def is_failure(self) -> bool:
        """A difference from the reference, except transformers' own batched run."""
        return self.mismatch is not None and not (self.side == "transformers" and self.batch > 1)


@dataclass(frozen=True)
class WorkloadReport:
    """``num_requests``: what the batched configurations decoded;
    ``single_requests``: what the batch-1 ones decoded (None: the same)."""

    name: str
    num_requests: int
    figures: tuple[Figures, ...]
    single_requests: int | None = None

    @property
    def failures(self) -> tuple[Figures, ...]:
        return tuple(f for f in self.figures if f.is_failure)


def first_mismatch(
    reference: dict[str, tuple[int, ...]], outputs: dict[str, tuple[int, ...]], order: Sequence[str]
) -> Mismatch | None:
    """The first request of ``order`` whose output differs from the reference."""
    for request_id in order:
        expected, got = reference[request_id], outputs.get(request_id, ())
        if expected != got:
            position = next(
                (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                min(len(expected), len(got)),
            )
            return Mismatch(request_id, position, expected, got)
    return None
