"""What ``metrale info`` says of a loaded model, beyond its config: the
attention and experts in words, the quantization, the parameters held, the
GGUF block types a converted file had, and the weight bytes a token streams.

Contract: pure descriptions of a spec, a checkpoint folder or a built model;
nothing here loads or changes anything. ``streamed_bytes_per_token(model)``
counts the bytes of the weights one decoded row reads as the runtime holds
them (packed blocks with their float32 scales, or dense tensors): every
layer's projections, norms and routers, the routed experts at the share a
token activates (``experts_per_token / num_experts`` of them, the expected
count over tokens), shared experts whole, and the LM head; the embedding's
one row is left out. A verify of several rows reads the same bytes once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from metrale.engine.load.gguf_convert import TYPES_FILE
from metrale.engine.runtime.arch import ArchSpec
from metrale.engine.runtime.fp8 import BlockFp8
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.moe import MoeWeights
from metrale.engine.runtime.packed import PackedWeight


def describe_attention(spec: ArchSpec) -> str:
    """The attention kind and shapes, as ``metrale info`` shows them."""
    if spec.mla is not None:
        mla = spec.mla
        q = f"q rank {mla.q_lora_rank}" if mla.q_lora_rank else "full-rank q"
        return (
            f"MLA, {spec.num_heads} heads, latent {mla.kv_lora_rank} + rope key "
            f"{mla.qk_rope_head_dim} cached, {q}"
        )
    rotary = spec.rope_dim / spec.head_dim
    gated = "gated GQA" if spec.attn_gate else "GQA"
    text = f"{gated}, {spec.num_heads} query / {spec.num_kv_heads} kv heads of {spec.head_dim}"
    text = text if rotary == 1 else f"{text}, {rotary:.0%} rotary"
    lin = spec.linear
    if lin is None:
        return text
    return (
        f"{text}, in {len(spec.attention_layers)} of {spec.num_layers} layers; the other "
        f"{len(lin.layers)} are gated DeltaNet, {lin.num_k_heads} key / {lin.num_v_heads} "
        f"value heads of {lin.k_head_dim} / {lin.v_head_dim}, conv {lin.conv_kernel}"
    )


def describe_experts(spec: ArchSpec) -> str | None:
    """Routed, shared and active experts; None for a dense model."""
    moe = spec.moe
    if moe is None:
        return None
    shared = moe.num_shared or (1 if moe.shared_size else 0)
    text = (
        f"{moe.num_experts} routed, {shared} shared, {moe.experts_per_token} routed active "
        f"per token ({moe.routing.replace('_', ' ')})"
    )
    if moe.dense_layers:
        count = len(moe.dense_layers)
        text += f"; {count} dense layer{'s' if count > 1 else ''}"
    return text


def describe_quant(quant: BlockFp8 | None) -> str:
    if quant is None:
        return "none"
    rows, cols = quant.block
    return f"block FP8 e4m3, {rows}x{cols} blocks ({quant.method}), dequantized at load"


def count_parameters(module: Any) -> int:
    """Distinct weight elements a runtime object holds (tied tensors once)."""
    seen: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, PackedWeight):
            rows, cols = value.shape
            seen[id(value)] = rows * cols
        elif isinstance(value, torch.Tensor) and value.is_floating_point():  # not token ids
            seen[id(value)] = value.numel()
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif hasattr(value, "__dataclass_fields__"):
            for field_name in value.__dataclass_fields__:
                visit(getattr(value, field_name))

    if isinstance(module, LlamaModel):
        head = module.head
        embed = head.embed.packed if head.embed.packed is not None else head.embed.table
        visit([embed, head.norm] + ([] if module.tied else [head.lm_head]))
        visit(module.stack.blocks)
    else:
        visit(getattr(module, "weights", None))
    return sum(seen.values())


def describe_blocks(folder: Path) -> str | None:
    """``Q5_0 x 166, Q8_0 x 15, ...``: the tensor types of the GGUF file the
    folder was converted from, most tensors first; ``None`` for a folder
    that is not a converted GGUF."""
    file = folder / TYPES_FILE
    if not file.exists():
        return None
    counts: dict[str, int] = {}
    for kind in json.loads(file.read_text()).values():
        counts[kind] = counts.get(kind, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{kind} x {count}" for kind, count in ordered)


def held_bytes(value: Any) -> int:
    """Bytes of the weights in ``value`` as held: a tensor, a packed weight
    (blocks and scales), or a dataclass or list of them."""
    if isinstance(value, PackedWeight):
        if value.parts:  # its tiles are the parts' table
            return held_bytes(value.parts)
        return _tensor_bytes(value.tiles) + _tensor_bytes(value.tile_scales)
    if isinstance(value, torch.Tensor):
        return _tensor_bytes(value) if value.is_floating_point() else 0  # not token ids
    if isinstance(value, list | tuple):
        return sum(held_bytes(item) for item in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(held_bytes(getattr(value, name)) for name in value.__dataclass_fields__)
    return 0


def streamed_bytes_per_token(model: Any) -> int:
    """See the module doc; 0 for a model this runtime does not build."""
    if not isinstance(model, LlamaModel):
        return 0
    total = held_bytes(model.head.norm) + held_bytes(model.head.lm_head)
    moe = model.spec.moe
    for block in model.stack.blocks:
        for name in block.__dataclass_fields__:
            value = getattr(block, name)
            if isinstance(value, MoeWeights) and moe is not None:
                routed = held_bytes(value.experts) * moe.experts_per_token // moe.num_experts
                others = (value.router, value.score_bias, value.shared, value.shared_gate)
                total += routed + sum(held_bytes(v) for v in others)
            else:
                total += held_bytes(value)
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
