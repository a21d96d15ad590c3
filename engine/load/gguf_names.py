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
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Stored as a vector by llama.cpp, a one-row matrix in HF checkpoints.
ONE_ROW = ("ffn_gate_inp_shexp",)


def hf_names(name: str, shape: Sequence[int] = ()) -> list[str]:
    """See the module doc; ``shape`` is the tensor's as numpy orders it
    (outermost first), needed only to count experts."""
    if name in _TOP:
        return [_TOP[name]]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias"):
        layer, kind, suffix = parts[1], parts[2], parts[3]
        if kind in _PARTS:
            return [f"model.layers.{layer}.{_PARTS[kind]}.{suffix}"]
        if kind in _EXPERTS and len(shape) == 3:
            projection = _EXPERTS[kind]
            return [
                f"model.layers.{layer}.mlp.experts.{e}.{projection}.{suffix}"
                for e in range(int(shape[0]))
            ]
    raise GgufError(
        f"tensor {name} has no counterpart in a HF checkpoint of the architectures metrale "
        "converts (dense Llama and Qwen, Qwen2-MoE and Qwen3-MoE)"
    )


def is_one_row(name: str) -> bool:
    """Whether the HF checkpoint holds this GGUF vector as a ``[1, n]`` matrix."""
    parts = name.split(".")
    return len(parts) == 4 and parts[2] in ONE_ROW
