"""Handing the C heap's free pages back to the system between load phases.

Contract: ``release_free_heap()`` asks glibc's allocator to return every
whole free page it holds (``malloc_trim(0)``, which also releases free pages
in the middle of the heap, not only at its top) and returns whether it could;
where the C library is not glibc it does nothing and returns ``False``. It
frees nothing that is in use, so it changes no value, only the resident size.

Why: loading leaves garbage that glibc keeps resident. Parsing
``tokenizer.json`` (``tokenizers``, in Rust, on the same allocator) touches
memory it frees again, and decoding a packed weight into its tiles frees
the row-major copy it read. Once a freed block of some megabytes was mapped,
glibc raises its mmap threshold, so later blocks of that size come from the
heap, and what they free stays resident in holes that weights of other sizes
do not reuse. A one-line job's peak RSS is its loaded model plus that
garbage; returning it between phases keeps the peak at what the model holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_free_heap() -> bool:
    """Returns the allocator's free pages to the system (module doc)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
