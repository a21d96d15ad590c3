"""The device step's forward: static shapes over the first slots, captured as CUDA graphs.

Contract: a static forward runs slots ``0..B-1`` (a *batch bucket*), each
fed ``W`` tokens (the *verify width*) at positions ``starts[b]..starts[b]+W-1``,
reading ``ctx`` cache positions; ``B``, ``W`` and ``ctx`` are Python ints
(the shape), ``tokens`` ``[B, W]`` and ``starts`` ``[B]`` live on the device
and are never read on the host. The output has one row per token, slot-major:
row ``b * W + r``.

Why it is harmless to pad: a row attends only to positions up to its own, so
the rows past a slot's real width (and every row of a slot that is not
decoding) change nothing a real row reads. They do write the cache at their
positions: a decoding slot's padded rows land past its length, where its next
verify writes first; a slot that is not decoding is pointed past ``max_len``,
into the ``headroom`` positions every cache keeps for this
(``LlamaModel(headroom=...)``), so a prompt another chunk is still filling is
never touched. The caller owns that choice of ``starts``.

Attention reads ``cache[0:B, :, :ctx]`` as a view (slots are the batch, so
nothing is gathered) under one mask built from ``starts`` per forward and
shared by every layer (``RowPlan.mask``); a row that may read nothing (none
does, but a caller's padding might) is given position 0 so its softmax stays
finite. The layers run in torch ops (``DecoderStack.torch_ops``), never the
C attention and layer kernels, on the CPU as on a GPU, so tests on the CPU
check the code a GPU runs (a packed weight, CPU only, still multiplies in
its own kernel).

CUDA graphs (``GraphCache``): on CUDA each (function, shape) is captured on
first use, in one memory pool shared by every graph, and replayed after;
inputs are copied into the graph's own buffers and the outputs are the
graph's buffers, valid until the same graph runs again. At most
``max_graphs`` shapes are kept (the oldest is dropped). A model whose step
is not capturable (MoE routing counts tokens per expert on the host) runs
eagerly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from metrale.engine.runtime.kv_cache import RowPlan

# Verify widths a static forward is built for.
WIDTHS = (1, 2, 4, 8, 16)
# Cache positions past ``max_len`` every slot keeps for padded rows: the
# widest static verify (the loader gives every model this much).
HEADROOM = WIDTHS[-1]
# Context buckets grow by doubling from this, so a run captures few shapes.
MIN_CTX = 256
# Captured graphs kept at once (the oldest is dropped).
MAX_GRAPHS = 24

StepFn = Callable[..., tuple[torch.Tensor, ...]]


def bucket(n: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` (ascending) holding ``n``; ``ValueError`` past the last."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{n} exceeds the largest static size {sizes[-1]}")


def batch_buckets(num_slots: int) -> tuple[int, ...]:
    """Powers of two below ``num_slots``, then ``num_slots`` itself."""
    sizes, size = [], 1
    while size < num_slots:
        sizes.append(size)
        size *= 2
    return (*sizes, num_slots)


def ctx_bucket(needed: int, limit: int) -> int:
    """Cache positions a forward reads: ``needed`` rounded up to a power of
    two from ``MIN_CTX``, at most ``limit`` (the cache's length)."""
    size = MIN_CTX
    while size < needed:
        size *= 2
    return min(size, limit)


def static_plan(
    starts: torch.Tensor,  # [B] int64 on the device
    width: int,
    ctx: int,
    sliding_window: int | None,
) -> RowPlan:
    """The ``RowPlan`` of a static forward (module doc), built on the device
    with no host read."""
    batch, device = int(starts.shape[0]), starts.device
    rows = torch.arange(width, device=device)
    query_pos = starts[:, None] + rows  # [B, W]
    key_pos = torch.arange(ctx, device=device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, W, ctx]
    if sliding_window is not None:
        allowed &= (query_pos[:, :, None] - key_pos[None, None, :]) < sliding_window
    allowed[:, :, 0] |= ~allowed.any(dim=-1)  # a row that reads nothing reads position 0
    slots = torch.arange(batch, device=device)
    return RowPlan(
        token_ids=torch.empty(0, dtype=torch.int64, device=device),  # the caller embeds
        positions=query_pos.reshape(-1),
        token_slots=slots[:, None]
        .expand(batch, width)
        .reshape(-1),  # no host read, unlike repeat_interleave
        slot_ids=slots,
        slot_range=(0, batch),
        num_segments=batch,
        max_rows=width,
        ctx_len=ctx,
        pad_index=None,
        mask=allowed.unsqueeze(1),  # [B, 1, W, ctx]
        last_rows=(slots + 1) * width - 1,
        sliding_window=sliding_window,
    )


class GraphCache:
    """Captured CUDA graphs by key, in one pool (module doc); eager elsewhere."""

    def __init__(self, device: torch.device, enabled: bool, max_graphs: int = MAX_GRAPHS) -> None:
        self.enabled = enabled and device.type == "cuda"
        self.max_graphs = max_graphs
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def captured(self) -> list[Hashable]:
        """The keys of the graphs held, oldest first."""
        return list(self._graphs)

    def run(self, key: Hashable, fn: StepFn, *inputs: Any) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)``, through the graph captured for ``key`` on CUDA; the
        tensors among ``inputs`` are copied in, anything else (a shape) is
        part of ``key`` and passed as it is."""
        if not self.enabled:
            return fn(*inputs)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(fn, inputs)
            self._graphs[key] = captured
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        for buffer, value in zip(captured.inputs, inputs, strict=True):
            if isinstance(value, torch.Tensor):
                buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.outputs

    def _capture(self, fn: StepFn, inputs: Sequence[Any]) -> _Captured:
        buffers = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in inputs)
        # Warm-up on a side stream, as torch.cuda.graphs asks, then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*buffers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a reader of the stats) is
        # not an error during the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn(*buffers)
        return _Captured(graph, buffers, outputs)


class _Captured:
    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        inputs: tuple[Any, ...],
        outputs: tuple[torch.Tensor, ...],
    ) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
