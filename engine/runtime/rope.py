"""Rotary position embeddings as one table, gathered by position.

Contract: ``RopeTable(config, max_len)`` holds ``cos``/``sin`` for every
position ``0..max_len-1`` (``[max_len, head_dim]``, in the model's dtype),
computed once at load exactly the way transformers computes them on the fly
(float32 ``position * inv_freq``, then cos/sin, times the scaling's attention
factor, then cast). A forward gathers the rows of its tokens' positions, so
rows of different slots at different positions cost one index op.

Scalings: whatever ``config.rope_parameters`` declares among ``default``,
``linear``, ``llama3``, ``yarn``, ``longrope`` (frequencies chosen for
``max_len``) and ``proportional``. ``dynamic`` NTK scaling changes the
frequencies with the sequence length mid-sequence, which a shared table cannot
express; it is refused with a message.
"""

from __future__ import annotations

from typing import Any

import torch

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def rope_type_of(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or {}
    return str(params.get("rope_type", "default"))


def inverse_frequencies(config: Any, head_dim: int, max_len: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` for the config."""
    rope_type = rope_type_of(config)
    if rope_type not in SUPPORTED_ROPE:
        raise ValueError(
            f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    if rope_type == "default":
        base = float(config.rope_parameters["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), seq_len=max_len)
    return inv_freq.float(), float(factor)


class RopeTable:
    """cos/sin rows for positions ``0..max_len-1`` (see module doc)."""

    def __init__(
        self,
        config: Any,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        headroom: int = 0,
    ) -> None:
        """``headroom``: rows past ``max_len`` for the device step's padded
        rows; the frequencies stay those of ``max_len``."""
        inv_freq, factor = inverse_frequencies(config, head_dim, max_len)
        positions = torch.arange(max_len + headroom, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_len, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos = (angles.cos() * factor).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * factor).to(device=device, dtype=dtype)
        self.max_len = max_len

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows ``[num_tokens, 1, head_dim]`` for ``positions`` ``[num_tokens]``,
        shaped to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[num_tokens, heads, head_dim]`` by the half-split convention
    (``x * cos + rotate_half(x) * sin``), the layout HF checkpoints use."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
