"""The shapes and options a decoder stack is built from, and the error for one
metrale cannot run.

Contract: an ``ArchSpec`` is plain data, checked for consistency when built;
``load/checkpoint.py`` fills it from a checkpoint's config, and the runtime
builds its forward from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass


class CheckpointError(ValueError):
    """A checkpoint metrale cannot load; the message says why and what is supported."""


@dataclass(frozen=True)
class ArchSpec:
    """The shapes and options of one Llama-family decoder stack."""

    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    context_len: int
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
