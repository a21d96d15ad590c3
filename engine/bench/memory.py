"""Peak memory of one benchmark run, measured inside the running process.

Contract: ``PeakMemory.measure()`` wraps one run and gives the bytes the run
needed beyond an idle process: on CUDA, the allocator's own high-water mark
(``torch.cuda.max_memory_allocated``, which includes the weights and caches
allocated on the device); on the CPU, the resident-set high-water above the
process's resident size just before the run, sampled every few milliseconds
from ``/proc/self/statm``. Before the CPU run starts, garbage is collected and
freed heap is returned to the OS (``malloc_trim``), so memory an earlier run
freed is not counted as already there. A short spike between two samples can
be missed; ``None`` means the platform offers neither figure.

The caller adds what the configuration holds before any run (weights,
preallocated KV slots), which an RSS delta cannot see.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from metrale.engine.load.heap import release_free_heap

SAMPLE_S = 0.005
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM = "/proc/self/statm"


def resident_bytes() -> int | None:
    """The process's resident set size now, or None off Linux."""
    try:
        with open(_STATM, encoding="ascii") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Moves every object alive now (the loaded models, imported modules) out
    of the collector's reach while the bench runs, so the full collection
    before each run scans only what runs created: a second instead of
    milliseconds with transformers imported."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _trim_heap() -> None:
    gc.collect()
    release_free_heap()  # not glibc: nothing to trim


class PeakMemory:
    """Measures one run at a time; ``peak_bytes`` holds the last run's figure."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    @contextmanager
    def measure(self) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        _trim_heap()
        base = resident_bytes()
        if base is None:
            self.peak_bytes = None
            yield
            return
        high = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_S):
                now = resident_bytes()
                if now is not None and now > high[0]:
                    high[0] = now

        sampler = threading.Thread(target=sample, name="bench-rss", daemon=True)
        sampler.start()
        try:
            yield
        finally:
            stop.set()
            sampler.join()
            end = resident_bytes() or base
            self.peak_bytes = max(high[0], end) - base

    @property
    def counts_resident_state(self) -> bool:
        """True when the figure already includes weights and caches (CUDA)."""
        return self.device.type == "cuda"
