"""Tiny random checkpoints of the MoE families, written by transformers' own classes.

Contract: ``write_moe_checkpoint(path, family, **overrides)`` builds the
family's config with tiny shapes, instantiates transformers' model class,
re-draws every parameter and buffer from a seeded generator (norms around 1,
routers and correction biases random, so a runtime that skips one is caught),
and saves it with ``save_pretrained``: the public per-expert keys
(``mlp.experts.{e}.gate_proj.weight`` ...), exactly what a hub checkpoint
holds. The byte tokenizer and generation config of
``tests.support.checkpoints`` are added, so metrale and transformers both load
the folder offline.

``write_with_mtp(path, family, num_layers)`` adds ``num_layers`` MTP layers in
the DeepSeek layout, drawn in transformers' own ``MtpModel`` and written under
the public keys a hub checkpoint uses, and returns the folder with
transformers' model and ``MtpModel`` of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import EOS_ID, TINY_VOCAB, write_byte_tokenizer

COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": EOS_ID,
    "eos_token_id": EOS_ID,
}
# Each family's own fields: dense layers mixed with MoE ones, shared experts,
# grouped routing, partial rotary, q/k norms and biases where the family has them.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "qwen2_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "shared_expert_intermediate_size": 48,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
    },
    "glm4_moe": {
        "head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    },
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "rope_interleave": True,
    },
    "glm4_moe_lite": {
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.8,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 20,
        "rope_interleave": True,
    },
}
CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
}


def moe_config(family: str, **overrides: Any) -> Any:
    import transformers

    config_class = getattr(transformers, CLASSES[family][0])
    fields = {**COMMON, **FAMILY_CONFIGS[family], **overrides}
    rotary = fields.pop("partial_rotary_factor", None)
    config = config_class(**fields)
    if rotary is not None:
        config.rope_parameters = {**(config.rope_parameters or {}), "partial_rotary_factor": rotary}
    return config


def redraw(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Every parameter and buffer of ``model`` drawn anew from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, tensor in sorted(tensors, key=lambda item: item[0]):
            if not tensor.is_floating_point() or "rotary" in name or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=gen)
            value = 1.0 + 0.1 * noise if "norm" in name else std * noise
            tensor.copy_(value.to(tensor.dtype))


def write_moe_checkpoint(path: Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Writes a tiny random checkpoint of ``family`` into ``path`` and returns it."""
    import transformers

    model_class = getattr(transformers, CLASSES[family][1])
    torch.manual_seed(seed)
    model = model_class(moe_config(family, **overrides)).float().eval()
    redraw(model, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS_ID, "eos_token_id": [EOS_ID, EOS_ID + 2]})
    )
    write_byte_tokenizer(path)
    return path


def public_mtp_tensors(
    mtp: Any, layer: int, expert_size: int, index: int = 0
) -> dict[str, torch.Tensor]:
    """``MtpModel``'s layer ``index`` under the public checkpoint keys of ``layer``."""
    out: dict[str, torch.Tensor] = {}
    at, own = f"model.layers.{layer}.", f"layers.{index}."
    for name, tensor in mtp.state_dict().items():
        if not name.startswith(own):
            continue  # the embedding and head are the main model's
        name = name.removeprefix(own).removeprefix("mtp_block.")
        name = name.replace("post_norm.", "shared_head.norm.")
        if name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 * size, hidden], gate first
            for e, both in enumerate(tensor):
                out[f"{at}mlp.experts.{e}.gate_proj.weight"] = both[:expert_size].clone()
                out[f"{at}mlp.experts.{e}.up_proj.weight"] = both[expert_size:].clone()
        elif name.endswith("mlp.experts.down_proj"):  # [experts, hidden, size]
            for e, down in enumerate(tensor):
                out[f"{at}mlp.experts.{e}.down_proj.weight"] = down.clone()
        else:
            out[at + name] = tensor.clone()
    return out


def write_with_mtp(path: Path, family: str, num_layers: int) -> tuple[Path, Any, Any]:
    """A checkpoint with ``num_layers`` MTP layers, and transformers' model and MtpModel of it."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    path = write_moe_checkpoint(path, family, num_nextn_predict_layers=num_layers)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    mtp = MtpModel(model, num_layers).float().eval()
    model.load_state_dict(saved)  # MtpModel's init re-draws the embedding and head it shares
    shared = {id(t) for t in (*model.parameters(), *model.buffers())}
    redraw_own(mtp, shared, seed=1)
    weights = load_file(str(path / "model.safetensors"))
    layer, size = model.config.num_hidden_layers, model.config.moe_intermediate_size
    for index in range(num_layers):
        weights.update(public_mtp_tensors(mtp, layer + index, size, index))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = (path / "config.json").read_text()
    announced = f'"num_nextn_predict_layers": {num_layers}'
    assert announced in config, "the config announces the layers"
    return path, model, mtp


def redraw_own(mtp: Any, shared: set[int], seed: int) -> None:
    """Redraws the MTP layer's own tensors, leaving those it shares with the model."""
    own = torch.nn.Module()
    own.layers = mtp.layers
    redraw(own, seed)
    assert all(id(t) not in shared for t in own.parameters())
