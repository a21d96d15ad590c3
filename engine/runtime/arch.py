"""The shapes and options a decoder stack is built from, and the error for one
metrale cannot run.

Contract: an ``ArchSpec`` is plain data, checked for consistency when built;
``load/checkpoint.py`` fills it from a checkpoint's config, and the runtime
builds its forward from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Routing = Literal["softmax", "sigmoid_grouped"]


class CheckpointError(ValueError):
    """A checkpoint metrale cannot load; the message says why and what is supported."""


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP, as the MoE configs define it.

    ``routing``: ``"softmax"`` (Qwen2/3-MoE: softmax over every expert, top-k,
    renormalised when ``norm_topk_prob``) or ``"sigmoid_grouped"``
    (DeepSeek-V3, GLM-4.5: sigmoid scores, a per-expert correction bias used
    for the choice only, the best ``topk_groups`` of ``num_groups`` groups by
    the sum of each group's two best, top-k within them, renormalised when
    ``norm_topk_prob``, times ``routed_scaling_factor``). Shared experts run on
    every token: ``num_shared`` of ``expert_size`` each (DeepSeek/GLM, fused
    into one MLP of ``num_shared * expert_size``) or one of ``shared_size``
    (Qwen2-MoE), optionally scaled by ``sigmoid(shared_gate(x))``.
    ``dense_layers`` run the dense MLP of ``ArchSpec.intermediate_size``.
    """

    num_experts: int
    experts_per_token: int
    expert_size: int
    routing: Routing
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    num_shared: int = 0
    shared_size: int = 0
    shared_gate: bool = False
    dense_layers: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"num_experts_per_tok ({self.experts_per_token}) must be in "
                f"[1, {self.num_experts}] (the number of routed experts)"
            )
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise CheckpointError(
                f"n_group ({self.num_groups}) must divide the {self.num_experts} experts "
                f"and topk_group ({self.topk_groups}) be in [1, n_group]"
            )

    @property
    def shared_width(self) -> int:
        """Intermediate size of the shared-expert MLP; 0 when there is none."""
        return self.shared_size or self.num_shared * self.expert_size


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): queries from
    ``q_lora_rank`` (or a plain projection when None), keys and values from a
    compressed ``kv_lora_rank`` latent plus one shared rotary key of
    ``qk_rope_head_dim``. ``rope_interleave``: the rotary dims are stored as
    interleaved pairs. ``softmax_scale`` already holds YaRN's mscale factor."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# The config key, metrale's own, that a converted GGUF's folder sets when its
# linear layers' value heads are tiled (``LinearAttnSpec.tiled_v_heads``).
TILED_V_HEADS = "linear_value_heads_tiled"


@dataclass(frozen=True)
class LinearAttnSpec:
    """Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next), mixed with full attention.

    ``layers``: the indices of the linear-attention layers; the others are
    gated full attention. Each linear layer keeps, per slot, a recurrent state
    ``[num_v_heads, k_head_dim, v_head_dim]`` in float32 and the last
    ``conv_kernel - 1`` inputs of its causal conv1d over the q/k/v channels
    (``linear_state.py``). Value head ``h`` reads key head
    ``h // (num_v_heads // num_k_heads)``, or ``h % num_k_heads`` where
    ``tiled_v_heads`` (a GGUF: llama.cpp reorders the value heads so, and the
    whole layer reads them in that order; ``linear_state.keys_for_values``). ``fused_projections``: Qwen3-Next's
    ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head, instead of
    Qwen3.5's separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    """

    layers: frozenset[int]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    fused_projections: bool
    tiled_v_heads: bool = False

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise CheckpointError(
                f"linear_num_value_heads ({self.num_v_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 1:
            raise CheckpointError(
                f"linear_conv_kernel_dim must be at least 1, got {self.conv_kernel}"
            )

    @property
    def key_size(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_size(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the conv1d: q, k and v side by side."""
        return 2 * self.key_size + self.value_size

    @property
    def state_numbers(self) -> int:
        """float32 numbers one layer's recurrent state holds per slot."""
        return self.num_v_heads * self.k_head_dim * self.v_head_dim

    @property
    def row_numbers(self) -> int:
        """Numbers one layer keeps per verify row until the next forward
        commits the accepted prefix: the conv input, the normalised key, the
        value, the decay and beta (``linear_state.py``)."""
        return self.conv_channels + self.key_size + self.value_size + 2 * self.num_v_heads


@dataclass(frozen=True)
class ArchSpec:
    """The shapes and options of one decoder stack: Llama-style attention (GQA,
    optionally with partial rotary) or MLA (``mla``), a dense SwiGLU MLP or a
    mixture of experts (``moe``), and optionally gated DeltaNet layers in
    between (``linear``). ``attn_gate``: ``q_proj`` emits per head a query and
    a gate, and the attention output is multiplied by ``sigmoid(gate)``.
    ``norm_offset``: added to every RMSNorm weight but the gated one (1.0 for
    the zero-centred norms of Qwen3-Next and Qwen3.5)."""

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
    # Rotary dims per head (GLM-4.5's partial_rotary_factor); None: all of head_dim.
    rotary_dim: int | None = None
    o_bias: bool = False  # GLM-4.5 with attention_bias: only q/k/v carry biases
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None
    linear: LinearAttnSpec | None = None
    attn_gate: bool = False
    norm_offset: float = 0.0
    # The hidden rows a forward returns, which the MTP layers take, are the
    # final-normed ones (Qwen3-Next, Qwen3.5) rather than the final residual.
    hidden_normed: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def rope_dim(self) -> int:
        """Rotary dims per head: MLA's rope head, the partial rotary, or all."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    @property
    def kv_width(self) -> int:
        """Numbers one layer's cache holds per position: keys and values of
        every kv head, or MLA's latent and rope key."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.kv_size

    @property
    def attention_layers(self) -> list[int]:
        """The layers that attend over the KV cache, in order."""
        linear = self.linear.layers if self.linear is not None else frozenset()
        return [i for i in range(self.num_layers) if i not in linear]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
