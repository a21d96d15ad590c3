"""GGUF block bytes for tests: gguf's own quantizers where it has them, and
plain K-quant quantizers where it has none (Q4_K, Q5_K, Q6_K).

Contract: ``quantize_blocks(w, kind)`` returns the bytes ``[rows,
row_bytes]`` a GGUF file holds for ``w`` ``[rows, cols]`` float32 in GGUF
type ``kind``: valid blocks whose ``gguf.quants.dequantize`` is close to
``w``, which is all a test needs (they are not llama.cpp's search for the
best scales). ``random_blocks(kind, rows, cols, rng)`` returns random bytes
of ``kind`` with finite float16 scales, every bit pattern of the values and
of the 6-bit scales and mins drawn: the decoders' worst case.

``kernel_weight(w, kind)`` is ``w`` in GGUF type ``kind`` as the packed
kernel holds it: ``(format, data, scales, dense)``, ``dense`` being gguf's
own dequantization. A K-quant's super-blocks need 256 columns; a weight of
fewer (any multiple of 32) is quantized padded with zeros and its blocks
past its columns dropped, which the kernel's blocks of 32 allow.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from metrale.engine.load.gguf_blocks import kernel_blocks

QK_K = 256
# Byte offsets of each type's float16 scales within a block.
HALF_SCALES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def quantize_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    """See the module doc."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == "Q4_K":
        return _k_affine(w, 15)
    if kind == "Q5_K":
        return _k_affine(w, 31)
    if kind == "Q6_K":
        return _q6_k(w)
    return quantize(w, GGMLQuantizationType[kind])


def kernel_weight(
    w: torch.Tensor, kind: str
) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module doc. ``w`` ``[n, k]`` float32, ``k`` a multiple of 32."""
    n, k = w.shape
    values = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    padded = np.zeros((n, -(-k // values) * values), dtype=np.float32)
    padded[:, :k] = w.float().numpy()
    raw = quantize_blocks(padded, kind)
    found = kernel_blocks(kind, raw)
    assert found is not None, kind
    fmt, data, scales = found
    blocks = k // 32
    data = data.reshape(n, -1, data.shape[1] * 32 // padded.shape[1])[:, :blocks].reshape(n, -1)
    scales = scales.reshape(n, -1, scales.shape[1] * 32 // padded.shape[1])[:, :blocks]
    dense = dequantize(raw, GGMLQuantizationType[kind]).reshape(padded.shape)[:, :k]
    return (
        fmt,
        torch.from_numpy(np.ascontiguousarray(data)),
        torch.from_numpy(np.ascontiguousarray(scales.reshape(n, -1))),
        torch.from_numpy(np.ascontiguousarray(dense)),
    )


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """See the module doc."""
    values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows, cols // values, block_bytes), dtype=np.uint8)
    for at in HALF_SCALES[kind]:
        half = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        raw[..., at : at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _levels(x: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` ``[...]`` >= 0 as 6-bit levels of one float16 step per row of the
    last axis: ``(step [..., 1], levels [...])``."""
    step = _f16(x.max(axis=-1, keepdims=True) / top)
    levels = np.where(step > 0, np.rint(x / np.where(step > 0, step, 1)), 0)
    return step, np.clip(levels, 0, top).astype(np.uint8)


def _k_affine(w: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (``top`` 15) or Q5_K (31): value = d * sc * q - dmin * m per sub-block of 32."""
    rows, cols = w.shape
    x = w.reshape(rows, cols // QK_K, 8, 32)
    low = np.minimum(x.min(axis=-1), 0)  # [rows, supers, 8]
    width = x.max(axis=-1) - low
    d, sc = _levels(width / top, 63)
    dmin, mins = _levels(-low, 63)
    scale = (d * sc)[..., None]  # [rows, supers, 8, 1]
    offset = (dmin * mins)[..., None]
    q = np.where(scale > 0, np.rint((x + offset) / np.where(scale > 0, scale, 1)), 0)
    q = np.clip(q, 0, top).astype(np.uint8)  # [rows, supers, 8, 32]
    packed = np.concatenate(
        [
            (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
            (mins[..., :4] & 0x3F) | ((mins[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mins[..., 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )  # [rows, supers, 12]
    nibbles = (q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)  # [rows, supers, 4, 32]
    parts = [_bytes(d), _bytes(dmin), packed]
    if top == 31:  # Q5_K: bit c of byte j is sub-block c's fifth bit of value j
        bits = (q >> 4) & 1  # [rows, supers, 8, 32]
        fifth = np.bitwise_or.reduce(bits << np.arange(8, dtype=np.uint8)[:, None], axis=-2)
        parts.append(fifth)
    parts.append(nibbles.reshape(rows, cols // QK_K, 128))
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: value = d * sc * (q - 32) per 16 values, sc a signed byte."""
    rows, cols = w.shape
    supers = cols // QK_K
    x = w.reshape(rows, supers, 16, 16)
    d, sc = _levels(np.abs(x).max(axis=-1) / 31, 127)  # [rows, supers, 1], [rows, supers, 16]
    scale = (d * sc)[..., None]
    q = np.where(scale > 0, np.rint(x / np.where(scale > 0, scale, 1)), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(rows, supers, 2, 128)
    # Value 128 h + 64 s + i: low nibble in byte 64 h + i of ql, shifted by 4 s;
    # value 128 h + 32 t + j: high 2 bits in byte 32 h + j of qh, shifted by 2 t.
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # [rows, supers, 2, 64]
    high = (q >> 4).reshape(rows, supers, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(high << shifts, axis=-2)  # [rows, supers, 2, 32]
    parts = [
        ql.reshape(rows, supers, 128),
        qh.reshape(rows, supers, 64),
        sc.astype(np.int8).view(np.uint8),
        _bytes(d),
    ]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _bytes(half: np.ndarray) -> np.ndarray:
    """Float16 values ``[rows, supers, 1]`` as their bytes ``[rows, supers, 2]``."""
    return half.astype(np.float16).view(np.uint8)
