"""What `metrale bench` reports: figures per configuration and workload, and
output differences.

Outputs are compared in one of two modes (``Compare``). ``exact``: token for
token, and the first differing request is a ``Mismatch``, a failure of the
bench. ``divergence``: for dtypes whose last bits depend on the matmul's
shape (bfloat16 on CUDA: a verify of width 4 and a decode of width 1 are
different matmuls), a greedy output may leave the reference's at a near-tie
without anything being wrong; each request's first differing token and the
mean common prefix are reported (``Divergence``), never failed.
``compare_mode`` picks the mode ``auto`` means: divergence on CUDA in any
dtype but float32, exact everywhere else.

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
Compare = Literal["exact", "divergence"]
COMPARE_MODES = ("auto", "exact", "divergence")


@dataclass(frozen=True)
class Mismatch:
    """The first request (in workload order) whose output differs from the
    reference; ``position`` is the index of the first differing output token."""

    request_id: str
    position: int
    expected: tuple[int, ...]
    got: tuple[int, ...]


@dataclass(frozen=True)
class Divergence:
    """How far each request's output follows the reference (``divergence``
    mode). ``first_diff``: per request in workload order, the index of its
    first output token that differs from the reference's, ``None`` when the
    two are equal (length included); an output that stops early, or runs on,
    differs where the shorter one ends. ``mean_common_prefix``: output tokens
    the two agree on before that index (an equal output: all of them),
    averaged over the requests; ``mean_length``: the reference's output
    tokens, averaged the same way, so the two read as a share."""

    first_diff: tuple[tuple[str, int | None], ...]
    mean_common_prefix: float
    mean_length: float

    @property
    def num_diverged(self) -> int:
        return sum(1 for _, at in self.first_diff if at is not None)


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
    mismatch: Mismatch | None = None  # exact mode only
    divergence: Divergence | None = None  # divergence mode only

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
        position = first_difference(expected, got)
        if position is not None:
            return Mismatch(request_id, position, expected, got)
    return None


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """The index of the first output token where ``got`` leaves ``expected``
    (where the shorter ends, when one is a prefix of the other); None: equal."""
    if tuple(expected) == tuple(got):
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )


def divergence(
    reference: dict[str, tuple[int, ...]], outputs: dict[str, tuple[int, ...]], order: Sequence[str]
) -> Divergence:
    """Each request's first difference from the reference and the mean
    common prefix over ``order`` (see ``Divergence``)."""
    first = tuple(
        (request_id, first_difference(reference[request_id], outputs.get(request_id, ())))
        for request_id in order
    )
    common = [len(reference[rid]) if at is None else at for rid, at in first]
    lengths = [len(reference[rid]) for rid in order]
    count = max(len(order), 1)
    return Divergence(first, sum(common) / count, sum(lengths) / count)


def least_common(found: Sequence[Divergence]) -> Divergence | None:
    """Of several runs' divergences, the one with the shortest mean common
    prefix (the first such run on a tie): the figure no run falls below."""
    return min(found, key=lambda d: d.mean_common_prefix) if found else None


def compare_mode(requested: str, device_type: str, dtype: str) -> Compare:
    """What ``--compare`` means on a device and dtype: ``auto`` is
    ``divergence`` on CUDA in any dtype but float32, else ``exact``."""
    if requested not in COMPARE_MODES:
        raise ValueError(f"compare must be one of {', '.join(COMPARE_MODES)}, got {requested!r}")
    if requested == "auto":
        return "divergence" if device_type == "cuda" and dtype != "float32" else "exact"
    return "divergence" if requested == "divergence" else "exact"
