"""One decoder block's weights as the runtime holds them, and the slot cache its
attention reads.

Contract: ``load_block(store, prefix, spec, ...)`` reads the block under
``prefix`` (``model.layers.{i}.``, or an MTP module's) in the public key names:
attention (GQA with q/k/v fused, gated attention whose ``q_proj`` also emits
the gate, MLA, or a gated DeltaNet layer, ``deltanet.py``), and the MLP (dense
SwiGLU with gate/up fused, or a mixture of experts). Which MLP a block has is read from
its keys, and for a main-model layer checked against the config's choice of
dense layers, so a checkpoint whose weights disagree with its config is
refused rather than run wrong. ``make_cache`` builds the cache the spec's
attention reads, for its attention layers only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from metrale.engine.runtime.arch import ArchSpec, CheckpointError
from metrale.engine.runtime.deltanet import DeltaNetWeights, load_deltanet
from metrale.engine.runtime.kv_cache import SlotKVCache
from metrale.engine.runtime.latent_cache import LatentCache
from metrale.engine.runtime.mla import MlaWeights, load_mla_weights
from metrale.engine.runtime.moe import MoeWeights, load_moe
from metrale.engine.runtime.ops import Weight
from metrale.engine.runtime.packed import PackedSource, PackedWeight
from metrale.engine.runtime.weights import WeightStore


@dataclass
class BlockWeights:
    """One decoder layer, with q/k/v and gate/up fused. A MoE layer holds
    ``moe`` and no dense ``gate_up``/``down``; an MLA layer holds ``mla`` and
    a gated DeltaNet layer ``linear``, and neither holds the GQA projections.
    Under gated attention ``qkv`` starts with ``q_proj`` as stored: per head,
    the query and then its gate."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Weight | None  # [q_size (x2 when gated) + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: Weight | None  # [hidden, q_size]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Weight | None  # [2 * intermediate, hidden]
    down: Weight | None  # [hidden, intermediate]
    o_bias: torch.Tensor | None = None  # [hidden]
    moe: MoeWeights | None = None
    mla: MlaWeights | None = None
    linear: DeltaNetWeights | None = None


def load_block(
    store: WeightStore,
    prefix: str,
    spec: ArchSpec,
    dtype: torch.dtype,
    device: torch.device,
    norm_offset: float | None = None,
    packed: PackedSource | None = None,
    layer: int | None = None,
) -> BlockWeights:
    """Reads ``{prefix}input_layernorm...`` etc. ``norm_offset`` is added to every
    norm weight (1.0 for zero-centred norms such as Qwen3-Next's; None: the
    spec's). Linear weights ``packed`` holds are taken from it. ``layer``: the
    main model's layer index, checked against the config's dense layers and
    telling a linear-attention layer (None for an MTP block, always full
    attention)."""
    offset = spec.norm_offset if norm_offset is None else norm_offset

    def get(name: str) -> torch.Tensor:
        return store.get(prefix + name).to(device=device, dtype=dtype)

    def weight(*names: str) -> Weight:
        """One linear weight, or several stacked along their rows (fused)."""
        found = [packed.get(prefix + n) if packed else None for n in names]
        parts = [w for w in found if w is not None]
        if len(parts) == len(names) and len({w.shape[1] for w in parts}) == 1:
            return PackedWeight.stack(parts)  # in several formats, as parts
        return torch.cat([get(n) for n in names])  # some part is dense

    def norm(name: str) -> torch.Tensor:
        return (store.get(prefix + name).float() + offset).to(device=device, dtype=dtype)

    moe = _moe(store, prefix, spec, layer, weight, get, device)
    linear_layers = spec.linear.layers if spec.linear is not None else frozenset()
    if layer is not None and layer in linear_layers:
        assert spec.linear is not None
        return BlockWeights(
            attn_norm=norm("input_layernorm.weight"),
            qkv=None,
            qkv_bias=None,
            q_norm=None,
            k_norm=None,
            o_proj=None,
            mlp_norm=norm("post_attention_layernorm.weight"),
            gate_up=None if moe else weight(*_DENSE),
            down=None if moe else weight(_DOWN),
            moe=moe,
            linear=load_deltanet(store, prefix, spec.linear, dtype, device),
        )
    attn = "self_attn."
    bias = None
    if spec.qkv_bias:
        bias = torch.cat([get(f"{attn}{p}_proj.bias") for p in "qkv"])
    mla = None
    if spec.mla is not None:
        mla = load_mla_weights(store, prefix, spec.mla, spec.num_heads, dtype, device)
    return BlockWeights(
        attn_norm=norm("input_layernorm.weight"),
        qkv=None if mla else weight(*(f"{attn}{p}_proj.weight" for p in "qkv")),
        qkv_bias=bias,
        q_norm=norm(f"{attn}q_norm.weight") if spec.qk_norm else None,
        k_norm=norm(f"{attn}k_norm.weight") if spec.qk_norm else None,
        o_proj=None if mla else weight(f"{attn}o_proj.weight"),
        mlp_norm=norm("post_attention_layernorm.weight"),
        gate_up=None if moe else weight(*_DENSE),
        down=None if moe else weight(_DOWN),
        o_bias=get(f"{attn}o_proj.bias") if spec.o_bias else None,
        moe=moe,
        mla=mla,
    )


_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_DOWN = "mlp.down_proj.weight"


def _moe(
    store: WeightStore,
    prefix: str,
    spec: ArchSpec,
    layer: int | None,
    weight: Callable[..., Weight],
    get: Callable[[str], torch.Tensor],
    device: torch.device,
) -> MoeWeights | None:
    if not _is_moe_layer(store, prefix, spec, layer):
        return None
    assert spec.moe is not None
    return load_moe(store, prefix, spec.moe, weight, get, device)


KVCache = SlotKVCache | LatentCache


def make_cache(
    spec: ArchSpec,
    num_layers: int,
    num_slots: int,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """The slot cache the spec's attention reads: keys and values per kv head,
    or MLA's latent and rope key."""
    if spec.mla is not None:
        mla = spec.mla
        return LatentCache(
            num_layers, num_slots, max_len, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype, device
        )
    return SlotKVCache(
        num_layers, num_slots, spec.num_kv_heads, max_len, spec.head_dim, dtype, device
    )


def _is_moe_layer(store: WeightStore, prefix: str, spec: ArchSpec, layer: int | None) -> bool:
    """Whether ``prefix`` holds a MoE block, by its keys; for a main-model
    ``layer`` the config's choice of dense layers must agree with them."""
    has_experts = f"{prefix}mlp.gate.weight" in store
    if has_experts and spec.moe is None:
        raise CheckpointError(f"{prefix}mlp holds experts but the config declares none")
    if not has_experts and f"{prefix}mlp.gate_proj.weight" not in store:
        raise CheckpointError(f"{prefix}mlp is neither a dense SwiGLU MLP nor a MoE block")
    if spec.moe is not None and layer is not None and layer < spec.num_layers:
        expected = layer not in spec.moe.dense_layers
        if expected != has_experts:
            kind = "a MoE block" if expected else "a dense MLP"
            raise CheckpointError(
                f"{prefix}mlp: the config makes layer {layer} {kind}, the weights do not"
            )
    return has_experts
