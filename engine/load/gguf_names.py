"""GGUF tensor names to the keys of a HF checkpoint, experts split one per key.

Contract: ``hf_names(name, shape)`` gives the HF keys a GGUF tensor becomes,
in order: one for a 1-D or 2-D tensor (``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``), and one per expert for the 3-D
expert tensors llama.cpp writes for a MoE (``blk.3.ffn_gate_exps.weight``
``[experts, rows, cols]`` -> ``model.layers.3.mlp.experts.{e}.gate_proj.weight``,
expert ``e`` being slice ``e``). A name with no HF counterpart raises
``GgufError``: a conversion could only drop it.

The names are those of llama.cpp's converter (gguf's ``TensorNameMap``) for
the dense Llama/Qwen layers and for Qwen2-MoE and Qwen3-MoE: the router
``ffn_gate_inp``, the routed experts ``ffn_{gate,up,down}_exps``, and
Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` with its gate
``ffn_gate_inp_shexp`` (a vector in the file, ``[1, hidden]`` in HF).

The hybrid Qwen3.5/3.6 files (``qwen35``, ``qwen35moe``; ``main_layers``
given) add the gated DeltaNet layers (``attn_qkv``, ``attn_gate``,
``ssm_{beta,alpha,conv1d,dt,a,norm,out}``), ``post_attention_norm``, and the
MTP layer llama.cpp appends as the blocks from ``main_layers`` on: its
``nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` are ``mtp.{fc,
pre_fc_norm_embedding, pre_fc_norm_hidden, norm}``, its decoder layer's
tensors ``mtp.layers.{block - main_layers}.*``. How their values differ
from the checkpoint's is ``gguf_convert.hybrid_value``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.engine.load.gguf_config import GgufError

_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Routed experts: one GGUF tensor [experts, rows, cols] per projection.
_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# The hybrid files' own block tensors (module doc).
_HYBRID_PARTS = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# Block tensors named without the usual weight suffix, or with bias alone.
_HYBRID_WHOLE = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
_NEXTN = {
    "eh_proj": "fc",
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "shared_head_norm": "norm",
}
# Zero-centred RMSNorm weights (the norm multiplies by 1 + w): llama.cpp
# stores them with the 1 added (module doc of ``gguf_convert``).
_ZERO_CENTRED = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")
_ZERO_CENTRED_NEXTN = ("enorm", "hnorm", "shared_head_norm")
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Stored as a vector by llama.cpp, a one-row matrix in HF checkpoints.
ONE_ROW = ("ffn_gate_inp_shexp",)


def hf_names(name: str, shape: Sequence[int] = (), main_layers: int | None = None) -> list[str]:
    """See the module doc; ``shape`` is the tensor's as numpy orders it
    (outermost first), needed only to count experts; ``main_layers``: the
    decoder layers of a hybrid file (None for the others)."""
    if name in _TOP:
        return [_TOP[name]]
    parts = name.split(".")
    hybrid = main_layers is not None
    if len(parts) >= 3 and parts[0] == "blk" and parts[1].isdecimal():
        layer, rest = int(parts[1]), ".".join(parts[2:])
        prefix = f"model.layers.{layer}"
        if main_layers is not None and layer >= main_layers:
            prefix = f"mtp.layers.{layer - main_layers}"
            if len(parts) == 5 and parts[2] == "nextn" and parts[3] in _NEXTN:
                return [f"mtp.{_NEXTN[parts[3]]}.{parts[4]}"]
        if hybrid and rest in _HYBRID_WHOLE:
            return [f"{prefix}.{_HYBRID_WHOLE[rest]}"]
        if len(parts) == 4 and parts[3] in ("weight", "bias"):
            kind, suffix = parts[2], parts[3]
            table = {**_PARTS, **_HYBRID_PARTS} if hybrid else _PARTS
            if kind in table:
                return [f"{prefix}.{table[kind]}.{suffix}"]
            if kind in _EXPERTS and len(shape) == 3:
                projection = _EXPERTS[kind]
                return [
                    f"{prefix}.mlp.experts.{e}.{projection}.{suffix}" for e in range(int(shape[0]))
                ]
    raise GgufError(
        f"tensor {name} has no counterpart in a HF checkpoint of the architectures metrale "
        "converts (dense Llama and Qwen, Qwen2-MoE, Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE)"
    )


def zero_centred(name: str) -> bool:
    """Whether a hybrid file's tensor is a zero-centred RMSNorm weight, stored
    by llama.cpp with its 1 added (``gguf_convert.hybrid_value``)."""
    parts = name.split(".")
    if name == "output_norm.weight":
        return True
    if len(parts) == 4 and parts[0] == "blk":
        return parts[2] in _ZERO_CENTRED
    return len(parts) == 5 and parts[2] == "nextn" and parts[3] in _ZERO_CENTRED_NEXTN


def is_one_row(name: str) -> bool:
    """Whether the HF checkpoint holds this GGUF vector as a ``[1, n]`` matrix."""
    parts = name.split(".")
    return len(parts) == 4 and parts[2] in ONE_ROW
