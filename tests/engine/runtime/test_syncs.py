"""The sync counter: what it counts, and what it exempts (engine/runtime/syncs.py)."""

from __future__ import annotations

import gc

import torch

from metrale.engine.runtime.syncs import count_syncs, host_buffer, readback


def test_every_host_read_is_counted() -> None:
    t = torch.arange(6)
    with count_syncs() as syncs:
        t.tolist()
        t[0].item()
        t.cpu()
        t.numpy()
        bool(t[0])
        int(t[1])
        float(t[2])
        t.nonzero()
        t[t > 2]
        t.to("cpu")
        torch.tensor([1, 2], device="cpu")
    assert syncs.by_kind == {
        "tolist": 1,
        "item": 1,
        "cpu": 1,
        "numpy": 1,
        "__bool__": 1,
        "__int__": 1,
        "__float__": 1,
        "nonzero": 1,
        "mask_index": 1,
        "to": 1,
        "tensor": 1,
    }
    assert (syncs.readbacks, syncs.uploads) == (10, 1)


def test_ops_on_the_device_and_host_buffers_are_not_counted() -> None:
    t = torch.arange(6)
    host = host_buffer((6,), torch.int64, torch.device("cpu"))
    with count_syncs() as syncs:
        (t * 2 + 1).argmax(dim=0)  # stays "on the device"
        t.to(torch.float32)  # a dtype, not a place
        readback(t, host)
        host.tolist()
        host[2:].tolist()  # a view of the buffer
        host.to("cpu", copy=True)  # an upload from it
    assert syncs.by_kind == {"readback": 1}
    assert host.tolist() == list(range(6))


def test_a_freed_buffers_address_is_not_exempt() -> None:
    buffer = host_buffer((1024,), torch.int64, torch.device("cpu"))
    address = buffer.untyped_storage().data_ptr()
    del buffer
    gc.collect()
    # Whatever now lives at that address is counted like any tensor.
    t = torch.zeros(1024, dtype=torch.int64)
    with count_syncs() as syncs:
        t.tolist()
    assert syncs.by_kind["tolist"] == 1, address
