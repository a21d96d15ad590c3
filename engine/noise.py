"""Counter-based noise for sampling: uniform bits as a pure function of a key.

Contract: every value here is a pure function of its integer inputs, computed
with int64 tensor ops that never overflow (each product stays below 2^63), so
the CPU, CUDA and a captured CUDA graph give the same bits, and nothing is
read back to the host. There is no generator state: the noise of a sampled
token is addressed by ``(request key, position, index)``, where the request
key folds the request's seed and its stream (the choice index of ``n``) into
32 bits (``request_key``, also in plain Python for the host to upload).

The mixer is ``lowbias32`` (C. Wellons' hash-prospector): a bijection on 32
bits with low avalanche bias. A key is absorbed one 32-bit word at a time
(``k = mix(k ^ word)``), after a distinct odd constant so that zero inputs
do not map to zero; the keys of a row and of an index within it are salted
apart, so no two roles share a stream.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x21F0AAAD, 0xD35A2D97
# Salts that keep each use of the mixer apart.
_SEED_LO, _SEED_HI, _STREAM, _POSITION = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F
SALT_BLOCK, SALT_TOKEN = 0x165667B1, 0xD3A2646C


def mix32(x: int) -> int:
    """``lowbias32`` of one 32-bit integer (the host's twin of ``mix``)."""
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    x ^= x >> 15
    return x


def request_key(seed: int, stream: int = 0) -> int:
    """A request's 32-bit noise key from its seed (any integer, taken modulo
    2^64) and its stream (the choice index; 0 for a single choice)."""
    seed %= 1 << 64
    key = mix32((seed & MASK32) ^ _SEED_LO)
    key = mix32(key ^ (seed >> 32) ^ _SEED_HI)
    return mix32(key ^ (stream & MASK32) ^ _STREAM)


def mix(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` elementwise on int64 values in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 15)


def row_keys(
    request_keys: torch.Tensor,  # [N] int64 in [0, 2^32): request_key of each row's request
    positions: torch.Tensor,  # [N] int64: the position of the token each row samples
) -> torch.Tensor:  # [N] int64 in [0, 2^32)
    """The key of one sampled token: its request's key and its position."""
    return mix(request_keys ^ mix((positions & MASK32) ^ _POSITION))


def uniform_bits(
    keys: torch.Tensor,  # [N] int64 row keys
    index: torch.Tensor,  # [N, M] or [M] int64 indices within the row
    salt: int,
) -> torch.Tensor:  # [N, M] int64 in [0, 2^32)
    """32 uniform bits for each ``(row key, index)`` under ``salt``: two
    rounds, so rows whose keys differ in few bits share no pattern."""
    salted = mix(keys ^ salt)[:, None]  # [N, 1]
    return mix(mix(salted ^ index) ^ salted)


def exponentials(bits: torch.Tensor) -> torch.Tensor:  # bits: [...] int64 in [0, 2^32)
    """Exp(1) variates, float64, from 32 uniform bits: ``-log(u)`` with
    ``u = (bits + 1/2) / 2^32`` in the open interval (0, 1), so every value is
    finite and positive."""
    u = (bits.to(torch.float64) + 0.5) * 2.0**-32
    return -torch.log(u)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for ``x`` in ``[0, 2^32)``: the low 31 bits of
    ``c`` multiply within int64, and its top bit adds ``x << 31``, of which
    only ``x``'s lowest bit survives the modulus."""
    y = x * (c & 0x7FFFFFFF)
    if c >> 31:
        y = y + ((x & 1) << 31)
    return y & MASK32
