"""Counting host-device syncs, and the one readback a device step makes.

Contract: ``count_syncs()`` is a context manager that, while it is open,
counts every call that would make the host wait for a device on CUDA:
``Tensor.tolist``, ``.item``, ``.cpu``, ``.numpy``, ``.to`` onto the CPU,
``bool()``/``int()``/``float()`` of a tensor, ``nonzero`` and indexing by a
boolean mask (both size their output on the host), and ``torch.tensor`` /
``torch.as_tensor`` given a ``device`` (a blocking host-to-device build).
What it cannot see (an op whose kernel syncs inside, a pageable upload by
``.to(device)``) the prepared GPU check counts with torch's sync debug mode.
It counts on the CPU too, where nothing waits, so a test there proves what
the same code does on a GPU. ``readback(src, dst)`` is the device step's one
sanctioned read: it copies ``src`` into the pinned host buffer ``dst``
(non-blocking, then one event sync on CUDA) and counts as one readback;
reading ``dst`` afterwards is free (it is registered as host memory for the
counter). Counting is off outside the context and costs nothing then.

The patching is process-wide and not thread-safe: it is for tests and the
prepared GPU check, never for production runs.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

# Tensor methods that read a tensor's values on the host.
_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")
# Constructors that build a tensor from host values, blocking when on a device.
_BUILDS = ("tensor", "as_tensor")


@dataclass
class SyncCounts:
    """What ran while ``count_syncs`` was open."""

    by_kind: Counter[str] = field(default_factory=Counter)

    @property
    def readbacks(self) -> int:
        """Device-to-host reads: sanctioned readbacks plus every stray read."""
        return sum(n for kind, n in self.by_kind.items() if kind not in _BUILDS)

    @property
    def uploads(self) -> int:
        """Blocking host-to-device tensor builds."""
        return sum(self.by_kind[kind] for kind in _BUILDS)


_active: SyncCounts | None = None
# Storages of host buffers (``host_buffer``, a readback's target): reading
# them, or any view of them, is not a sync.
_host_buffers: set[int] = set()


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _register(buffer: torch.Tensor) -> None:
    """Exempts ``buffer``'s storage while it lives (a later tensor may reuse
    the address once it is freed)."""
    key = _storage(buffer)
    _host_buffers.add(key)
    weakref.finalize(buffer.untyped_storage(), _host_buffers.discard, key)


def readback(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copies ``src`` (any device) into the host buffer ``dst`` of the same
    shape and returns ``dst`` once the copy is complete: the step's one
    device-to-host read (module doc)."""
    if _active is not None:
        _active.by_kind["readback"] += 1
    _register(dst)
    dst.copy_(src, non_blocking=src.device.type == "cuda")
    if src.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    return dst


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for ``readback`` or uploads: pinned when ``device`` is
    CUDA, so copies to and from it can run without blocking."""
    buffer = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
    _register(buffer)
    return buffer


def _names_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``.to(...)`` call names the CPU as its target."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


@contextmanager
def count_syncs() -> Iterator[SyncCounts]:
    """Counts syncs while open (module doc); nested use is refused."""
    global _active
    assert _active is None, "count_syncs is not reentrant"
    counts = SyncCounts()
    saved: list[tuple[Any, str, Any]] = []

    def wrap_read(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _storage(self) not in _host_buffers:
                counts.by_kind[name] += 1
            return original(self, *args, **kwargs)

        saved.append((torch.Tensor, name, original))
        setattr(torch.Tensor, name, counted)

    def wrap_build(name: str) -> None:
        original: Callable[..., torch.Tensor] = getattr(torch, name)

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.get("device") is not None:
                counts.by_kind[name] += 1
            return original(*args, **kwargs)

        saved.append((torch, name, original))
        setattr(torch, name, counted)

    def wrap_to() -> None:
        original = torch.Tensor.to

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            moved = original(self, *args, **kwargs)
            to_host = moved.device.type == "cpu" and self.device.type != "cpu"
            on_cpu = self.device.type == "cpu" and moved.device.type == "cpu"
            # A device tensor coming to the host reads it; on the CPU (the dry
            # run) any .to that is not an upload from a host buffer stands for one.
            if to_host or (
                on_cpu and _storage(self) not in _host_buffers and _names_cpu(args, kwargs)
            ):
                counts.by_kind["to"] += 1
            return moved

        saved.append((torch.Tensor, "to", original))
        setattr(torch.Tensor, "to", counted)  # noqa: B010 (a method is replaced)

    def wrap_getitem() -> None:
        original = torch.Tensor.__getitem__

        def counted(self: torch.Tensor, index: Any) -> Any:
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                counts.by_kind["mask_index"] += 1
            return original(self, index)

        saved.append((torch.Tensor, "__getitem__", original))
        setattr(torch.Tensor, "__getitem__", counted)  # noqa: B010 (a method is replaced)

    for name in _READS:
        wrap_read(name)
    for name in _BUILDS:
        wrap_build(name)
    wrap_to()
    wrap_getitem()
    _active = counts
    try:
        yield counts
    finally:
        _active = None
        for owner, name, original in saved:
            setattr(owner, name, original)
