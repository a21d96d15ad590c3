"""A GGUF tensor's quantized blocks in the row-major layout of the packed kernel.

Contract: ``kernel_blocks(kind, raw)`` takes a tensor's raw bytes ``[n,
row_bytes]`` (uint8, as ``GGUFReader`` maps them) of GGUF type ``kind`` and
returns ``(format, data [n, blocks * block_bytes] uint8, scales [n, blocks *
block_scales] float32)`` in the layout ``runtime/packed.py`` reads (blocks
of 32 columns, each row's blocks in turn), or ``None`` for a type the kernel
does not hold. The kernel's decode of the result equals gguf's own
``dequantize`` of ``raw``, bit for bit (``kernels/packed_columns.h`` states
each format's arithmetic; a test checks every type on random blocks).

Per 32-value block: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 keep their values and
their float16 scales widened to float32. The K-quants' 256-value
super-blocks are split into blocks of 32 with float32 scales: a Q4_K or Q5_K
block's value is gguf's ``(d * sc) * q - dmin * m``, which is ``D * q + M``
with ``D = d * sc`` and ``M = -(dmin * m)`` rounded once (both products are
exact in float32, and a difference is the sum with the negation), so they
become Q4_1 and Q5_1 blocks; a Q6_K block keeps two scales ``d * sc``, one
per 16 values (format ``q6_k``). What that costs: float32 scales take more
bytes than the file's, e.g. 0.75 bytes a value for Q4_K against 0.5625 in
the file (``STORED_BYTES_PER_VALUE``).
"""

from __future__ import annotations

import numpy as np

QK = 32  # values in a kernel block
QK_K = 256  # values in a K-quant super-block

# GGUF type -> (kernel format, bytes of one GGUF block, values in it)
KERNEL_TYPES = {
    "Q4_0": ("q4_0", 18, QK),
    "Q4_1": ("q4_1", 20, QK),
    "Q5_0": ("q5_0", 22, QK),
    "Q5_1": ("q5_1", 24, QK),
    "Q8_0": ("q8_0", 34, QK),
    "Q4_K": ("q4_1", 144, QK_K),
    "Q5_K": ("q5_1", 176, QK_K),
    "Q6_K": ("q6_k", 210, QK_K),
}
# Bytes a value takes in the kernel's layout (data and float32 scales).
STORED_BYTES_PER_VALUE = {
    "q4_0": (16 + 4) / QK,
    "q4_1": (16 + 8) / QK,
    "q5_0": (20 + 4) / QK,
    "q5_1": (20 + 8) / QK,
    "q6_k": (24 + 8) / QK,
    "q8_0": (32 + 4) / QK,
    "bf16": 2.0,
}


def kernel_blocks(kind: str, raw: np.ndarray) -> tuple[str, np.ndarray, np.ndarray] | None:
    """See the module doc. ``raw`` ``[n, row_bytes]`` uint8."""
    if kind not in KERNEL_TYPES:
        return None
    fmt, block_bytes, _ = KERNEL_TYPES[kind]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, block_bytes)
    data, scales = _SPLITTERS[kind](blocks)  # [n, blocks of 32, bytes], [n, blocks of 32, scales]
    return fmt, data.reshape(rows, -1), scales.astype(np.float32).reshape(rows, -1)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as float32 ``[n, blocks, 1]``."""
    return blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(values: np.ndarray) -> np.ndarray:
    """``[..., 32]`` 4-bit values -> ``[..., 16]`` bytes, value j low and j + 16 high."""
    return values[..., :16] | (values[..., 16:] << 4)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b[..., 2:18], _half(b, 0)


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b[..., 4:20], np.concatenate([_half(b, 0), _half(b, 2)], axis=-1)


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # GGUF: d, then the fifth bits (a little-endian uint32: bit j is value j's), then nibbles.
    return np.concatenate([b[..., 6:22], b[..., 2:6]], axis=-1), _half(b, 0)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scales = np.concatenate([_half(b, 0), _half(b, 2)], axis=-1)
    return np.concatenate([b[..., 8:24], b[..., 4:8]], axis=-1), scales


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b[..., 2:34], _half(b, 0)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the 8 sub-blocks' 6-bit scales and mins
    (``[n, supers, 8]`` each), unpacked as gguf's ``Q4_K.get_scale_min``."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    low = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scale, low


def _k_affine(b: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales ``D = d * sc`` and ``M = -(dmin * m)`` per sub-block of a
    Q4_K/Q5_K super-block ``[n, supers, bytes]``, and ``values`` ``[n,
    supers, 8, 32]`` regrouped as ``[n, supers * 8, ...]``."""
    rows, supers = b.shape[:2]
    scale, low = _k_scale_min(b[..., 4:16])
    d = _half(b, 0) * scale.astype(np.float32)  # [n, supers, 8]
    m = -(_half(b, 2) * low.astype(np.float32))
    scales = np.stack([d, m], axis=-1).reshape(rows, supers * 8, 2)
    return values.reshape(rows, supers * 8, 32), scales


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, supers = b.shape[:2]
    qs = b[..., 16:144].reshape(rows, supers, 4, 1, 32)
    shift = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    values = ((qs >> shift) & 0x0F).reshape(rows, supers, 8, 32)  # sub-block 2i + low/high
    values, scales = _k_affine(b, values)
    return _nibbles(values), scales


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, supers = b.shape[:2]
    qs = b[..., 48:176].reshape(rows, supers, 4, 1, 32)
    shift = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = ((qs >> shift) & 0x0F).reshape(rows, supers, 8, 32)
    qh = b[..., 16:48].reshape(rows, supers, 1, 32)  # bit c of byte j: value j of sub-block c
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    values, scales = _k_affine(b, low)
    fifth = np.packbits(high.reshape(rows, supers * 8, 32), axis=-1, bitorder="little")
    return np.concatenate([_nibbles(values), fifth], axis=-1), scales


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Value 128 h + 32 t + j (h < 2, t < 4, j < 32): low nibble from byte
    # 64 h + 32 (t % 2) + j of ql, shifted by 4 (t // 2); high 2 bits from
    # byte 32 h + j of qh, shifted by 2 t; scale sc[v // 16] times d.
    rows, supers = b.shape[:2]
    ql = b[..., 0:128].reshape(rows, supers, 2, 1, 2, 32)  # [h, (t // 2), t % 2, j]
    shift = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1, 1)
    low = ((ql >> shift) & 0x0F).reshape(rows, supers * 8, 32)
    qh = b[..., 128:192].reshape(rows, supers, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    high = high.reshape(rows, supers * 8, 8, 4)  # [block, byte i, column 4 i + (0..3)]
    twos = np.bitwise_or.reduce(high << np.array([0, 2, 4, 6], dtype=np.uint8), axis=-1)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, supers, 16]
    scales = (_half(b, 208) * sc).reshape(rows, supers * 8, 2)
    return np.concatenate([_nibbles(low), twos], axis=-1), scales


_SPLITTERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
