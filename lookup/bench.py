"""Speed of prompt lookup against the naive scan, measured in one process.

Run: ``python -m metrale.lookup.bench`` (``make bench-lookup``). For histories
of 1k, 10k and 100k tokens it prints the time of indexing the whole history
once, of one propose-after-append step (the engine's steady state), and of the
same step done as HF transformers' prompt-lookup candidate generator does it:
a vectorised scan of the whole history for the final n-gram, from the left
(numpy stands in for torch, which ``metrale.lookup`` never imports). Targets:
the step at 100k within 1.5x of the step at 1k, and at least 100x faster than
the scan at 100k. Figures are ratios against the peer in the same run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metrale.lookup.prompt_lookup import PromptLookupConfig, PromptLookupSeq
from metrale.lookup.shared import ScopeKey, SharedLookup, SharedLookupConfig

SIZES = (1_000, 10_000, 100_000)
MAX_LEN = 8
STEPS = 2_000  # propose-after-append steps in one timed block
ROUNDS = 5  # blocks per size; the fastest counts
SCAN_STEPS = 60  # the scan is slow; fewer steps give a stable mean
HF_MAX_NGRAM = 2  # transformers' `max_matching_ngram_size` default
VOCAB = 32_000


def token_stream(length: int, seed: int = 0) -> list[int]:
    """Tokens where about half the text re-copies an earlier run of 16-64
    tokens, as code edits and summaries do, so lookups find matches."""
    rng = random.Random(seed)
    out: list[int] = [rng.randrange(VOCAB) for _ in range(64)]
    while len(out) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(out) - 16)
            out.extend(out[start : start + rng.randrange(16, 65)])
        else:
            out.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(4, 32)))
    return out[:length]


def best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def time_indexing(history: list[int], cfg: PromptLookupConfig) -> float:
    """Seconds to index a whole history and propose once."""

    def run() -> float:
        seq = PromptLookupSeq(cfg)
        start = time.perf_counter()
        seq.propose(history, MAX_LEN)
        return time.perf_counter() - start

    return best_of(3, run)


def indexed_seq(stream: list[int], size: int, cfg: PromptLookupConfig) -> PromptLookupSeq:
    seq = PromptLookupSeq(cfg)
    seq.propose(stream[:size], MAX_LEN)
    seq.abandon()
    return seq


def time_steps(
    seq: PromptLookupSeq, stream: list[int], size: int, block: int
) -> tuple[float, float]:
    """Mean seconds of one append + propose on a sequence that indexed
    ``stream[:size]`` (steps ``block`` onwards), and the fraction of steps that
    found a copy."""
    history = stream[: size + block * STEPS]
    found = 0
    start = time.perf_counter()
    for token in stream[size + block * STEPS : size + (block + 1) * STEPS]:
        history.append(token)
        if seq.propose(history, MAX_LEN) is not None:
            found += 1
            seq.abandon()
    return (time.perf_counter() - start) / STEPS, found / STEPS


def best_steps(stream: list[int], cfg: PromptLookupConfig) -> dict[int, tuple[float, float]]:
    """Per size, the fastest of ``ROUNDS`` blocks of steps. The sizes take
    turns, so load from other processes falls on all of them alike."""
    seqs = {size: indexed_seq(stream, size, cfg) for size in SIZES}
    best: dict[int, tuple[float, float]] = {}
    for block in range(ROUNDS):
        for size in SIZES:
            step_s, found = time_steps(seqs[size], stream, size, block)
            if size not in best or step_s < best[size][0]:
                best[size] = (step_s, found)
    return best


def hf_style_scan(ids: Any, max_ngram: int, num_tokens: int) -> Any:
    """The naive peer: for n from ``max_ngram`` down to 1, compare every window
    of the history with its final n-gram and copy after the first (leftmost)
    match that has a following token."""
    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    end = len(ids)
    for n in range(max_ngram, 0, -1):
        windows = sliding_window_view(ids, n)  # [end - n + 1, n]
        hits = np.nonzero((windows == ids[end - n :]).all(axis=1))[0]  # [num_hits]
        for hit in hits:
            start = int(hit) + n
            if start < end:
                return ids[start : min(start + num_tokens, end)]
    return None


def time_scan_steps(stream: list[int], size: int) -> float:
    import numpy as np

    ids = np.asarray(stream[: size + SCAN_STEPS], dtype=np.int64)  # [size + SCAN_STEPS]
    start = time.perf_counter()
    for end in range(size + 1, size + SCAN_STEPS + 1):
        hf_style_scan(ids[:end], HF_MAX_NGRAM, MAX_LEN)
    return (time.perf_counter() - start) / SCAN_STEPS


@dataclass(frozen=True)
class Row:
    size: int
    index_s: float
    step_s: float
    found: float
    scan_step_s: float


def measure() -> list[Row]:
    cfg = PromptLookupConfig()
    stream = token_stream(max(SIZES) + ROUNDS * STEPS + SCAN_STEPS)
    steps = best_steps(stream, cfg)
    rows = []
    for size in SIZES:
        step_s, found = steps[size]
        rows.append(
            Row(
                size=size,
                index_s=time_indexing(stream[:size], cfg),
                step_s=step_s,
                found=found,
                scan_step_s=time_scan_steps(stream, size),
            )
        )
    return rows


def shared_cache_figures() -> tuple[float, float]:
    """(tokens inserted per second, seconds per propose) for one 100k-token scope."""
    cache = SharedLookup(SharedLookupConfig(cache_mb=1.0, scopes=1))
    scope = ScopeKey("bench", "bench", "", "tenant")
    stream = token_stream(100_000, seed=1)
    start = time.perf_counter()
    for offset in range(0, len(stream), 2_000):
        cache.insert(scope, stream[offset : offset + 2_000])
    insert_s = time.perf_counter() - start
    probes = [stream[end - 64 : end] for end in range(1_000, len(stream), 97)]
    start = time.perf_counter()
    for history in probes:
        cache.propose(scope, history, MAX_LEN)
    propose_s = (time.perf_counter() - start) / len(probes)
    return len(stream) / insert_s, propose_s


def main() -> None:
    rows = measure()
    print("prompt lookup (ngram 4, min_match 8, copies of up to 8 tokens)")
    print(
        f"{'history':>8} {'index':>10} {'step':>9} {'found':>6} {'naive scan':>11} {'scan/step':>10}"
    )
    for row in rows:
        print(
            f"{row.size:>8} {row.index_s * 1e3:>8.2f}ms {row.step_s * 1e6:>7.2f}us "
            f"{row.found:>6.0%} {row.scan_step_s * 1e6:>9.1f}us {row.scan_step_s / row.step_s:>9.0f}x"
        )
    growth = rows[-1].step_s / rows[0].step_s
    speedup = rows[-1].scan_step_s / rows[-1].step_s
    print(f"step at {rows[-1].size} / step at {rows[0].size}: {growth:.2f}x (target <= 1.5x)")
    print(f"naive scan / step at {rows[-1].size}: {speedup:.0f}x (target >= 100x)")
    tokens_per_s, propose_s = shared_cache_figures()
    print(
        f"shared cache, one 1 MB scope: insert {tokens_per_s / 1e3:.0f}k tokens/s, "
        f"propose {propose_s * 1e6:.1f}us"
    )


if __name__ == "__main__":
    main()
