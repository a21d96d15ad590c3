"""A HF-style checkpoint folder: its architecture and its tensors.

Contract: ``read_checkpoint(path)`` reads ``config.json`` and the safetensors
index (``model.safetensors`` or shards named by
``model.safetensors.index.json``) without loading any weight. It returns the
``ArchSpec`` the runtime builds from, the transformers config (for RoPE
scalings), the raw config dict (MTP fields that transformers drops) and a
``WeightStore`` that reads one tensor at a time. An architecture outside the
Llama family is refused with a message naming what is supported; so is a
quantization other than block FP8, or a tensor the config does not account
for (``load/quant.py``). ``quant`` is the block FP8 the store dequantizes,
``None`` for a plain checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.engine.load.file_checks import AGAIN
from metrale.engine.load.plain_config import plain_config
from metrale.engine.load.quant import check_tensors, read_quant
from metrale.engine.runtime.arch import (
    TILED_V_HEADS,
    ArchSpec,
    CheckpointError,
    LinearAttnSpec,
    MlaSpec,
    MoeSpec,
)
from metrale.engine.runtime.fp8 import BlockFp8
from metrale.engine.runtime.weights import WeightStore

# model_type -> the transformers config class that reads its config.json. MiMo
# is a Qwen2 base with MTP layers that transformers has no class for.
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mimo": "qwen2",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "glm4_moe": "glm4_moe",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe_lite": "glm4_moe_lite",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
}
SUPPORTED = (
    "Llama, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3, MiMo, Qwen2-MoE, Qwen3-MoE, "
    "GLM-4.5 (glm4_moe), DeepSeek-V3/R1 (deepseek_v3), GLM-4.7-Flash (glm4_moe_lite), "
    "Qwen3.5/3.6 (qwen3_5, qwen3_5_moe and their _text exports), Qwen3-Next (qwen3_next)"
)
# Families whose attention is multi-head latent attention.
_MLA = ("deepseek_v3", "glm4_moe_lite")
# Families that route by softmax (Qwen) and by grouped sigmoid (DeepSeek, GLM).
_SOFTMAX_MOE = ("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text")
_SIGMOID_MOE = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")
# Gated DeltaNet hybrids, by transformers family: every layer_types entry is
# linear_attention or full_attention, and the full layers are gated.
_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Released layouts that nest the language model (module doc).
_NESTED = ("qwen3_5", "qwen3_5_moe")
_LANGUAGE_PREFIX = "model.language_model."


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    spec: ArchSpec
    hf_config: Any  # transformers.PretrainedConfig
    raw_config: dict[str, Any]
    weights: WeightStore
    quant: BlockFp8 | None = None


def read_checkpoint(path: Path) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} is not a checkpoint folder: config.json is missing")
    raw = _config(config_file)
    model_type = str(raw.get("model_type", ""))
    if model_type not in FAMILIES:
        refuse_unsupported_layers(raw, None)
        archs = ", ".join(raw.get("architectures") or []) or "unknown"
        raise CheckpointError(
            f"unsupported architecture {model_type or '?'} ({archs}); supported: {SUPPORTED}"
        )
    family = FAMILIES[model_type]
    quant = read_quant(raw)
    if model_type in _NESTED:
        raw = language_config(raw)
    refuse_unsupported_layers(raw, family)
    hf_config = family_config(raw, family)
    spec = _arch_spec(hf_config, model_type, family)
    weights = WeightStore.open_folder(path, quant)
    check_tensors(weights.headers(), quant)
    if model_type in _NESTED:
        weights = weights.renamed(_language_name)
    return Checkpoint(path, spec, hf_config, raw, weights, quant)


def _config(config_file: Path) -> dict[str, Any]:
    """``config.json`` as a dict; a file that is not a JSON object is refused
    naming it, before anything else is read."""
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file} is not JSON ({exc}); {AGAIN}") from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{config_file} is not UTF-8 text; {AGAIN}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object; {AGAIN}")
    return raw


def language_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A released Qwen3.5 config read as its language model's: ``text_config``
    over the top level's other fields (quantization, MTP counts, tied
    embeddings), without the vision parts."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"model_type {raw.get('model_type')} needs a text_config object")
    skip = ("text_config", "vision_config", "architectures", "model_type")
    outer = {k: v for k, v in raw.items() if k not in skip}
    return {**outer, **text}


def _language_name(name: str) -> str | None:
    """A released Qwen3.5 tensor's name in the flat layout; None for the vision tower."""
    if name.startswith(_LANGUAGE_PREFIX):
        return "model." + name[len(_LANGUAGE_PREFIX) :]
    if name.startswith("model.visual."):
        return None
    return name


def family_config(raw: dict[str, Any], family: str) -> Any:
    """The config as the runtime reads it: a complete dense config.json read
    as written (``plain_config.py``), else transformers' class for the family,
    which fills in its defaults."""
    plain = plain_config(raw, family)
    return plain if plain is not None else transformers_config(raw, family)


def transformers_config(raw: dict[str, Any], family: str) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(family, **fields)


def refuse_unsupported_layers(raw: dict[str, Any], family: str | None) -> None:
    """Refuses, naming the config field, layer kinds the runtime cannot run
    exactly: linear-attention layers outside the gated DeltaNet family (whose
    recurrence metrale does not know), and sliding-window layers mixed with
    full ones."""
    kinds = set(raw.get("layer_types") or ())
    known = {"full_attention", "linear_attention"} if family in _HYBRIDS else {"full_attention"}
    if "linear_attention" in kinds - known:
        raise CheckpointError(
            f"layer_types has linear_attention layers in model_type {raw.get('model_type')}; "
            "metrale runs linear attention only as the gated DeltaNet of Qwen3.5/3.6 and "
            "Qwen3-Next"
        )
    if kinds - known:
        raise CheckpointError(
            f"layer_types has {', '.join(sorted(kinds - known))} layers; "
            "metrale runs full-attention layers (and Qwen3.5's linear ones) only"
        )


def _arch_spec(config: Any, model_type: str, family: str) -> ArchSpec:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only SwiGLU with silu)")
    if getattr(config, "mlp_bias", False):
        raise CheckpointError("mlp_bias=True is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mla = _mla_spec(config) if family in _MLA else None
    if mla is not None:
        head_dim = mla.qk_head_dim
    attention_bias = bool(getattr(config, "attention_bias", False))
    glm = family == "glm4_moe"
    hybrid = family in _HYBRIDS
    if hybrid and attention_bias:
        raise CheckpointError("attention_bias=true is not supported for the Qwen3.5 family")
    return ArchSpec(
        model_type=model_type,
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        # Qwen3.5-MoE has no dense layer, and no dense width.
        intermediate_size=int(getattr(config, "intermediate_size", 0) or 0),
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_embeddings=bool(config.tie_word_embeddings),
        context_len=int(config.max_position_embeddings),
        qkv_bias=family in ("qwen2", "qwen2_moe") or (attention_bias and mla is None),
        qk_norm=family in ("qwen3", "qwen3_moe") or hybrid or (glm and bool(config.use_qk_norm)),
        sliding_window=_sliding_window(config, family),
        rotary_dim=None if mla else _rotary_dim(config, head_dim),
        # Llama and Mistral put attention_bias on o_proj too; GLM-4.5 on q/k/v only.
        o_bias=attention_bias and family in ("llama", "mistral"),
        moe=_moe_spec(config, family),
        mla=mla,
        linear=_linear_spec(config, family) if hybrid else None,
        attn_gate=hybrid,
        norm_offset=1.0 if hybrid else 0.0,
        hidden_normed=hybrid,
    )


def _linear_spec(config: Any, family: str) -> LinearAttnSpec:
    """The gated DeltaNet layers: which layers, and their heads."""
    kinds = list(getattr(config, "layer_types", None) or ())
    if len(kinds) != int(config.num_hidden_layers):
        raise CheckpointError(
            f"layer_types names {len(kinds)} layers, num_hidden_layers is "
            f"{config.num_hidden_layers}"
        )
    dtype = str(getattr(config, "mamba_ssm_dtype", "float32") or "float32")
    if dtype != "float32":
        raise CheckpointError(
            f"mamba_ssm_dtype {dtype!r} is not supported: metrale keeps the linear "
            "layers' state in float32, as the released models do"
        )
    return LinearAttnSpec(
        layers=frozenset(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        num_k_heads=int(config.linear_num_key_heads),
        num_v_heads=int(config.linear_num_value_heads),
        k_head_dim=int(config.linear_key_head_dim),
        v_head_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim),
        fused_projections=family == "qwen3_next",
        tiled_v_heads=bool(getattr(config, TILED_V_HEADS, False)),
    )


def _mla_spec(config: Any) -> MlaSpec:
    """MLA's shapes; the softmax scale carries YaRN's ``mscale_all_dim`` factor
    squared, as DeepSeek's attention applies it."""
    qk_head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    scale = qk_head_dim**-0.5
    params = getattr(config, "rope_parameters", None) or {}
    all_dim = (
        params.get("mscale_all_dim", 0) if params.get("rope_type", "default") != "default" else 0
    )
    if all_dim and float(params["factor"]) > 1:
        mscale = 0.1 * float(all_dim) * math.log(float(params["factor"])) + 1.0
        scale *= mscale * mscale
    q_rank = getattr(config, "q_lora_rank", None)
    return MlaSpec(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=int(config.kv_lora_rank),
        qk_nope_head_dim=int(config.qk_nope_head_dim),
        qk_rope_head_dim=int(config.qk_rope_head_dim),
        v_head_dim=int(config.v_head_dim),
        rope_interleave=bool(getattr(config, "rope_interleave", False)),
        softmax_scale=scale,
    )


def _rotary_dim(config: Any, head_dim: int) -> int | None:
    """GLM-4.5's rotary dims per head (``partial_rotary_factor``); None: all."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if factor is None or float(factor) >= 1.0:
        return None
    dim = int(head_dim * float(factor))
    if dim % 2 or dim <= 0:
        raise CheckpointError(
            f"partial_rotary_factor {factor} gives {dim} rotary dims of {head_dim}: not a "
            "positive even number"
        )
    return dim


def _moe_spec(config: Any, family: str) -> MoeSpec | None:
    num_layers = int(config.num_hidden_layers)
    if family in _SOFTMAX_MOE:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        only = set(getattr(config, "mlp_only_layers", None) or ())
        # Qwen2-MoE and the hybrids: one shared expert scaled by sigmoid(gate(x)).
        shared = family in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
        return MoeSpec(
            num_experts=int(config.num_experts),
            experts_per_token=int(config.num_experts_per_tok),
            expert_size=int(config.moe_intermediate_size),
            routing="softmax",
            # Qwen3.5-MoE's router always renormalises its top-k.
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            shared_size=int(config.shared_expert_intermediate_size) if shared else 0,
            shared_gate=shared,
            dense_layers=frozenset(i for i in range(num_layers) if i in only or (i + 1) % step),
        )
    if family in _SIGMOID_MOE:
        _check_routing(config)
        kinds = getattr(config, "mlp_layer_types", None)
        if kinds is not None:  # GLM-4.7-Flash names each layer's MLP
            dense = frozenset(i for i, kind in enumerate(kinds) if kind == "dense")
        else:
            dense = frozenset(range(int(getattr(config, "first_k_dense_replace", 0) or 0)))
        return MoeSpec(
            num_experts=int(config.n_routed_experts),
            experts_per_token=int(config.num_experts_per_tok),
            expert_size=int(config.moe_intermediate_size),
            routing="sigmoid_grouped",
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
            num_groups=int(getattr(config, "n_group", 1) or 1),
            topk_groups=int(getattr(config, "topk_group", 1) or 1),
            num_shared=int(getattr(config, "n_shared_experts", 0) or 0),
            dense_layers=dense,
        )
    return None


def _check_routing(config: Any) -> None:
    """DeepSeek-V3-style routing only: sigmoid scores chosen by ``noaux_tc``."""
    scoring = getattr(config, "scoring_func", "sigmoid")
    if scoring not in (None, "sigmoid"):
        raise CheckpointError(f"scoring_func {scoring!r} is not supported (only sigmoid)")
    method = getattr(config, "topk_method", "noaux_tc")
    if method not in (None, "noaux_tc"):
        raise CheckpointError(f"topk_method {method!r} is not supported (only noaux_tc)")


def _sliding_window(config: Any, family: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if family == "mistral":
        return int(window) if window else None
    if getattr(config, "use_sliding_window", False):
        raise CheckpointError(
            "use_sliding_window=true: Qwen sliding-window attention is not supported"
        )
    return None
