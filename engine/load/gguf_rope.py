"""Llama 3's RoPE scaling, read back from the divisors llama.cpp stores.

Contract: llama.cpp writes a llama3-scaled model's RoPE as a tensor,
``rope_freqs.weight`` (``[head_dim / 2]`` float32, the divisor of each
frequency), and no scaling metadata. ``llama3_parameters(divisors, theta,
head_dim)`` returns the ``rope_parameters`` (``rope_type: llama3``) whose
divisors, computed as llama.cpp and transformers compute them, equal the
stored ones to ``RTOL``; otherwise it raises ``ValueError`` saying why.

Why they can be read back: frequency ``i`` (wavelength ``w``) is divided by 1
where ``w`` is below ``L / h``, by ``factor`` where it is above ``L / l``, and
in between by ``1 / ((1 - s) / factor + s)`` with ``s = (L / w - l) / (h - l)``,
a line in ``1 / w``. So ``factor`` is the largest divisor, and two or more
smoothed divisors give the line's slope ``L / (h - l)`` and intercept
``-l / (h - l)``. Only these two ratios shape the divisors, so ``l = 1`` is
taken (Llama 3's own value) and ``h`` and ``L`` follow, each rounded to the
nearest integer when within ``1e-3`` of it (Llama 3.x: 4 and 8192), which
gives back the checkpoint's own parameters.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

RTOL = 1e-5
NAME = "rope_freqs.weight"


def llama3_parameters(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    stored = np.asarray(divisors, dtype=np.float64).reshape(-1)  # [head_dim / 2]
    inv_wavelen = _frequencies(theta, head_dim) / (2 * math.pi)  # [head_dim / 2]
    factor = float(stored.max())
    smoothed = (stored > 1 + RTOL) & (stored < factor * (1 - RTOL))
    if stored.shape != inv_wavelen.shape or factor <= 1 or smoothed.sum() < 2:
        raise ValueError(f"{int(smoothed.sum())} smoothed divisors of {stored.size}")
    s = (1 / stored[smoothed] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[smoothed], s, 1)
    low = 1.0
    high = _rounded(low - low / intercept)
    original = _rounded(slope * (high - low))
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": _rounded(factor),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": round(original),
    }
    if not np.allclose(llama3_divisors(params, head_dim), stored, rtol=RTOL, atol=0):
        raise ValueError("no llama3 parameters give them")
    return params


def llama3_divisors(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """``[head_dim / 2]``: what ``rope_freqs.weight`` holds for ``params``."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / _frequencies(params["rope_theta"], head_dim)
    smooth = (original / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between)
    )


def _frequencies(theta: float, head_dim: int) -> np.ndarray:
    """As llama.cpp's converter computes them, in float32."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.float32(theta) ** exponents).astype(np.float64)


def _rounded(value: float) -> float:
    nearest = round(value)
    return float(nearest) if abs(value - nearest) < 1e-3 else float(value)
