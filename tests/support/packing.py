"""Packed weights for tests: GGUF-style Q4_1/Q8_0 quantizers and a packer for
tiny checkpoints.

Contract: ``quantize(w, fmt)`` returns ``(data, scales, dense)`` in the
layout ``metrale.engine.runtime.packed`` reads, where ``dense`` is the float32 value
gguf's reference dequantizer gives (computed here in torch with the same two
roundings, independently of the C kernel under test). ``pack_checkpoint``
rewrites a tiny single-file checkpoint so that its linear weights are those
dense values and writes the matching ``packed.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from metrale.engine.runtime.packed import PACKED_FILE, save_packed

BLOCK = 32


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[n, k]`` float32, ``k`` a multiple of 32."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q4_1":
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = _f16((high - low) / 15)
        m = _f16(low)
        q = ((blocks - m) / d.clamp_min(1e-8)).round().clamp(0, 15).to(torch.uint8)
        data = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
        dense = (q.float() * d) + m  # two roundings, as gguf's numpy code
        scales = torch.cat([d, m], -1).reshape(n, -1)
        return data, scales, dense.reshape(n, k)
    if fmt == "q8_0":
        d = _f16(blocks.abs().amax(-1, keepdim=True) / 127)
        q = (blocks / d.clamp_min(1e-8)).round().clamp(-127, 127).to(torch.int8)
        dense = q.float() * d
        return q.view(torch.uint8).reshape(n, k), d.reshape(n, -1), dense.reshape(n, k)
    if fmt == "bf16":
        value = w.to(torch.bfloat16)
        return value.view(torch.uint8).reshape(n, 2 * k), torch.zeros(n, 0), value.float()
    raise ValueError(fmt)


def _f16(x: torch.Tensor) -> torch.Tensor:
    """Rounded to float16 and back, as GGUF stores block scales."""
    return x.half().float()


def gguf_blocks(data: torch.Tensor, scales: torch.Tensor, fmt: str) -> np.ndarray:
    """The raw GGUF bytes ``[n, row_bytes]`` of a quantized weight, scales first
    in each block, for gguf's own dequantizer to read."""
    n = data.shape[0]
    num_blocks = scales.shape[1] // (2 if fmt == "q4_1" else 1)
    halves = scales.reshape(n, num_blocks, -1).numpy().astype(np.float16).view(np.uint8)
    values = data.reshape(n, num_blocks, -1).numpy()
    return np.concatenate([halves, values], axis=-1).reshape(n, -1)


def pack_checkpoint(path: Path, fmt: str = "q4_1", head_fmt: str = "q8_0") -> list[str]:
    """Quantizes the projections (``fmt``) and the embedding/LM head
    (``head_fmt``) of the single-file checkpoint at ``path``; returns the
    names packed."""
    weights = load_file(str(path / "model.safetensors"))
    packed = {}
    for name, value in weights.items():
        is_head = name in ("model.embed_tokens.weight", "lm_head.weight")
        if not (is_head or name.endswith("proj.weight")) or value.shape[-1] % BLOCK:
            continue
        kind = head_fmt if is_head else fmt
        data, scales, dense = quantize(value, kind)
        weights[name] = dense
        packed[name] = (kind, data, scales)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_packed(packed, path / PACKED_FILE)
    return sorted(packed)
