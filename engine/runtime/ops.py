"""The operations every runtime block shares: RMSNorm and linear products over
dense or packed weights.

Contract: ``rms_norm`` matches transformers' RMSNorm (normalise in float32,
cast back, then scale); ``linear(x, w, b)`` is ``x @ w.T + b`` for a dense or
packed (``packed.py``) weight, by the fastest exact path for the row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.engine.runtime.packed import PackedWeight

# A linear weight: a dense tensor, or packed for the CPU kernel (packed.py).
Weight = torch.Tensor | PackedWeight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def as_dense(weight: Weight) -> torch.Tensor:
    """The weight as a tensor (a packed one decoded to float32)."""
    return weight.dense() if isinstance(weight, PackedWeight) else weight


# Up to this many rows, ``w @ x.T`` beats ``x @ w.T`` in float32 on the CPU:
# the kernel then streams the weight once along its rows instead of once per
# tile of rows. In bfloat16 it is slower than F.linear, so it is float32-only.
SKINNY_ROWS = 16
# Weights this large (an LM head) are read faster by two threads than by one.
GEMV_SPLIT_NUMEL = 1 << 22


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``, ``weight`` ``[out, in]``."""
    if isinstance(weight, PackedWeight):
        out = weight.matmul(x)
        return out if bias is None else out.add_(bias)
    if x.shape[0] > SKINNY_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1 and weight.numel() >= GEMV_SPLIT_NUMEL:
        # A one-column product runs as a matrix-vector product on one thread;
        # two columns take the threaded matrix path, so the row goes in twice.
        out = torch.mm(weight, x.repeat(2, 1).t())[:, :1].t().contiguous()  # [1, out]
    else:
        out = torch.mm(weight, x.t()).t().contiguous()  # [rows, out]
    return out if bias is None else out.add_(bias)
