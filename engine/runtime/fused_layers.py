"""Every decoder layer of a decode or verify forward in one C call
(``kernels/decoder_layers.c``).

Contract: ``FusedLayers.build`` returns ``None`` unless each layer is a plain
Llama-style layer whose four products are packed (no biases, no q/k norms),
its norms and the KV cache are CPU float32, and the kernel library is there.
``run`` then gives, bit for bit, the residual ``DecoderStack`` computes layer
by layer through the same kernels, for a plan whose segments the C attention
takes (``DecoderStack`` decides which plans those are).

Why: a layer is 11 kernel calls, and from Python each costs a ctypes call,
checks and an allocation; over a whole stack that is as much as the products
themselves at one row. Here the table of every layer's weights and
cache addresses is written once, and a forward is one call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from metrale.engine.kernels.binding import LAYER_FIELDS, PackedKernel
from metrale.engine.runtime.arch import ArchSpec
from metrale.engine.runtime.kv_cache import RowPlan, SlotKVCache
from metrale.engine.runtime.packed import PackedWeight
from metrale.engine.runtime.rope import RopeTable

if TYPE_CHECKING:  # llama.py imports this module
    from metrale.engine.runtime.block import BlockWeights


class FusedLayers:
    """The layers of one ``DecoderStack`` as a table for the C side."""

    def __init__(
        self,
        spec: ArchSpec,
        table: torch.Tensor,
        tensors: list[torch.Tensor],
        max_len: int,
        kernel: PackedKernel,
    ) -> None:
        self.spec = spec
        self.table = table  # [layers, LAYER_FIELDS] int64: addresses and formats
        # What the table points into, held here so that the addresses stay valid
        # whatever becomes of the blocks and cache lists they came from.
        self._tensors = tensors
        self.max_len = max_len  # the cache's positions per slot
        self.kernel = kernel

    @staticmethod
    def build(
        spec: ArchSpec, blocks: list[BlockWeights], cache: SlotKVCache, kernel: PackedKernel | None
    ) -> FusedLayers | None:
        if kernel is None or spec.rotary_dim is not None or spec.o_bias:
            return None  # the C layer rotates whole heads and adds no output bias
        hidden, inner = spec.hidden_size, spec.intermediate_size
        # The C side sizes every product from these: a layer of other shapes stays in Python.
        shapes = (
            (spec.q_size + 2 * spec.kv_size, hidden), (hidden, spec.q_size),
            (2 * inner, hidden), (hidden, inner),
        )  # fmt: skip
        rows: list[list[int]] = []
        tensors: list[torch.Tensor] = []
        for layer, w in enumerate(blocks):
            products = [
                p for p in (w.qkv, w.o_proj, w.gate_up, w.down) if isinstance(p, PackedWeight)
            ]
            if [p.shape for p in products] != list(shapes):
                return None  # dense, or not the spec's shapes
            if w.qkv_bias is not None or w.q_norm is not None or w.k_norm is not None:
                return None
            norms = (w.attn_norm, w.mlp_norm)
            if not all(
                n.dtype == torch.float32 and n.device.type == "cpu" and n.is_contiguous()
                and n.shape == (hidden,)
                for n in norms
            ):  # fmt: skip
                return None
            keys, values = cache.keys[layer], cache.values[layer]
            if not kernel.takes_cache(keys, values, spec.num_kv_heads, spec.head_dim):
                return None
            row = [w.attn_norm.data_ptr(), w.mlp_norm.data_ptr()]
            for product in products:
                row.extend(kernel.weight_fields(product.fmt, product.tiles, product.tile_scales))
                tensors.extend([product.tiles, product.tile_scales])
            row.extend([keys.data_ptr(), values.data_ptr()])
            tensors.extend([*norms, keys, values])
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.int64)
        assert table.shape[1] == LAYER_FIELDS
        return FusedLayers(spec, table, tensors, cache.keys[0].shape[2], kernel)

    def run(self, x: torch.Tensor, plan: RowPlan, rope: RopeTable) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` through every layer; returns the new residual."""
        spec = self.spec
        assert plan.segment_table is not None, "plan_rows builds the table"
        return self.kernel.decoder_layers(
            x.clone(),
            self.table,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.intermediate_size,
            spec.rms_norm_eps,
            rope.cos,
            rope.sin,
            plan.positions,
            self.max_len,
            plan.segment_table,
            plan.sliding_window or 0,
            spec.head_dim**-0.5,
        )
