"""The slot cache of multi-head latent attention (``mla.py``).

Contract: per layer one tensor ``[num_slots, max_len, kv_lora_rank +
qk_rope_head_dim]``, allocated once: at slot ``s`` position ``p`` the normed
latent ``c`` and the rotated shared rope key ``k_rot`` of the token at position
``p`` of the sequence that owns slot ``s``; never per-head keys or values. The
addressing is ``kv_cache.py``'s: writes and reads go by the forward's
``RowPlan``, nothing records a length (rollback is the caller moving its
``seq_len`` back, and the next forward overwrites the stale positions), and
unwritten positions hold zeros so that masked reads stay finite.
"""

from __future__ import annotations

import torch

from metrale.engine.runtime.kv_cache import RowPlan, zero_filled


class LatentCache:
    """Per-layer ``entries`` ``[num_slots, max_len, kv_lora_rank + qk_rope_head_dim]``:
    the latent in the first ``kv_lora_rank`` columns, the rope key in the last,
    side by side so that absorbed attention reads one window as its keys (and
    the latent columns of it as its values) with no copy. The surface parallels
    ``SlotKVCache``: ``num_slots``, ``max_len``, ``bytes_per_token``,
    ``write``/``read`` by ``RowPlan``."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, max_len, kv_lora_rank + qk_rope_head_dim)
        self.entries = [zero_filled(shape, dtype, device) for _ in range(num_layers)]
        self.kv_lora_rank = kv_lora_rank
        self.num_slots = num_slots
        self.max_len = max_len
        self.bytes_per_token = num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype.itemsize

    def latent(self, layer: int) -> torch.Tensor:
        """``[num_slots, max_len, kv_lora_rank]``, a view."""
        return self.entries[layer][..., : self.kv_lora_rank]

    def rope_key(self, layer: int) -> torch.Tensor:
        """``[num_slots, max_len, qk_rope_head_dim]``, a view."""
        return self.entries[layer][..., self.kv_lora_rank :]

    def write(
        self, layer: int, plan: RowPlan, latent: torch.Tensor, rope_key: torch.Tensor
    ) -> None:
        """Stores ``latent`` ``[num_tokens, kv_lora_rank]`` and ``rope_key``
        ``[num_tokens, qk_rope_head_dim]`` at each row's slot and position: a slice
        copy for one segment, an indexed write for several."""
        rank = self.kv_lora_rank
        entries = self.entries[layer]
        if plan.lone is not None:
            slot, start = plan.lone
            end = start + latent.shape[0]
            entries[slot, start:end, :rank] = latent
            entries[slot, start:end, rank:] = rope_key
            return
        entries[plan.token_slots, plan.positions] = torch.cat((latent, rope_key), dim=-1)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Positions ``0..length-1`` of slot ``source`` into slot ``slot``, every layer."""
        for entries in self.entries:
            entries[slot, :length] = entries[source, :length]

    def read(self, layer: int, plan: RowPlan) -> torch.Tensor:
        """The segments' windows ``[num_segments, ctx_len, kv_lora_rank +
        qk_rope_head_dim]``: a view when the slots are contiguous, a gathered copy
        otherwise."""
        entries = self.entries[layer]
        if plan.slot_range is not None:
            first, end = plan.slot_range
            return entries[first:end, : plan.ctx_len]
        return entries[:, : plan.ctx_len].index_select(0, plan.slot_ids)
