"""release_free_heap: free pages go back to the system, values in use stay."""

from __future__ import annotations

import platform

import pytest
import torch

from metrale.engine.load import heap


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_freed_pages_are_returned_and_live_values_are_kept() -> None:
    kept = torch.arange(1 << 20, dtype=torch.float32)
    freed = [torch.ones(1 << 16) for _ in range(64)]  # heap-sized blocks, then garbage
    del freed
    assert heap.release_free_heap()
    assert torch.equal(kept, torch.arange(1 << 20, dtype=torch.float32))


def test_without_malloc_trim_it_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_libc", lambda: None)
    assert heap.release_free_heap() is False
