"""The metadata of a Llama-family GGUF, as the two configs of a HF checkpoint.

Contract: ``model_config(fields, arch, tensor_names, gguf_path, rope_divisors)``
returns ``config.json`` as transformers writes it for the model the GGUF's
metadata describes (``{arch}.*`` keys, the tokenizer's special ids, tied
embeddings where the file has no ``output.weight``), and
``generation_config(fields)`` its ``generation_config.json`` (EOS with the
end-of-turn token). A value the runtime cannot honour exactly (a head size
that differs between keys and values, partial rotary, unknown RoPE scaling,
experts outside the MoE architectures) raises ``GgufError`` naming the key;
``architecture(fields)`` checks the architecture and experts alone, before
any tensor is read.

The MoE architectures ``qwen2moe`` and ``qwen3moe`` take their experts from
``{arch}.expert_count``, ``expert_used_count``, ``expert_feed_forward_length``
and (Qwen2-MoE's shared expert) ``expert_shared_feed_forward_length``.
GGUF has no key for whether the top-k routing weights are renormalised;
llama.cpp renormalises them for qwen3moe and not for qwen2moe, as the
released configs do, and so does the config written here
(``{arch}.expert_weights_norm``, where a file has it, wins). A layer whose
tensors hold a dense MLP instead of experts is listed in ``mlp_only_layers``.

The hybrid Qwen3.5/3.6 architectures ``qwen35`` and ``qwen35moe`` become the
text-only ``qwen3_5_text`` / ``qwen3_5_moe_text`` configs: the gated
DeltaNet shapes from ``{arch}.ssm.*``, which layers are linear from the
tensors they hold (a full-attention layer has ``attn_q``), partial rotary
from ``rope.dimension_count`` over the head size, and the MTP layers that
llama.cpp appends to ``block_count`` from ``nextn_predict_layers``
(``main_layers``). llama.cpp tiles their value heads over the key heads
(its ``_LinearAttentionVReorderBase``); the config says so
(``TILED_V_HEADS``), and the runtime reads them in that order. A file from a
llama.cpp older than that reordering cannot be told apart by its metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from metrale.engine.load import gguf_rope
from metrale.engine.runtime.arch import TILED_V_HEADS, CheckpointError

# general.architecture -> (transformers model_type, architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
SUPPORTED_ARCHS = (
    "llama (Llama, SmolLM, Mistral), qwen2, qwen3, qwen2moe, qwen3moe, qwen35, qwen35moe"
)
# MoE architectures -> whether llama.cpp renormalises their top-k weights.
MOE_ARCHS = {"qwen2moe": False, "qwen3moe": True, "qwen35moe": True}
# Gated DeltaNet hybrids (module doc).
HYBRID_ARCHS = ("qwen35", "qwen35moe")


class GgufError(CheckpointError):
    """A GGUF metrale cannot convert exactly; the message names what and why."""


def architecture(fields: Any, gguf_path: Path) -> str:
    """``general.architecture``, refused unless the runtime runs it, or when
    a dense architecture holds experts (``{arch}.expert_count``: Mixtral is
    a llama GGUF)."""
    arch = str(_value(fields, "general.architecture", gguf_path))
    if arch not in ARCHITECTURES:
        raise GgufError(
            f"{gguf_path.name}: GGUF architecture {arch!r} is not supported; "
            f"supported: {SUPPORTED_ARCHS}"
        )
    experts = fields.get(f"{arch}.expert_count")
    if arch not in MOE_ARCHS and experts is not None and experts.contents():
        raise GgufError(
            f"{gguf_path.name}: {arch}.expert_count is {experts.contents()} (a mixture of "
            "experts, such as Mixtral); metrale converts dense GGUF models only"
        )
    return arch


def model_config(
    fields: Any,
    arch: str,
    tensor_names: set[str],
    gguf_path: Path,
    rope_divisors: np.ndarray | None = None,
) -> dict[str, Any]:
    """config.json as transformers writes it for the model the metadata describes
    (``rope_divisors``: ``rope_freqs.weight``, llama3's scaling, when the file has it)."""
    from transformers import AutoConfig

    def need(key: str) -> Any:
        return _value(fields, f"{arch}.{key}", gguf_path)

    def opt(key: str) -> Any:
        field = fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    hybrid = arch in HYBRID_ARCHS
    moe = {}
    if arch in MOE_ARCHS:
        moe = (_hybrid_moe_fields if hybrid else _moe_fields)(fields, arch, tensor_names, gguf_path)
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = _head_dim(opt, hidden // heads, gguf_path, partial_rotary=hybrid)
    model_type, class_name = ARCHITECTURES[arch]
    kv_heads = opt("attention.head_count_kv")
    bos, eos, pad = (_token_id(fields, k) for k in ("bos", "eos", "padding"))
    values: dict[str, Any] = dict(
        vocab_size=int(opt("vocab_size") or _vocab_size(fields, gguf_path)),
        hidden_size=hidden,
        intermediate_size=int(
            opt("feed_forward_length")
            or moe.get("moe_intermediate_size")
            or need("feed_forward_length")
        ),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads if kv_heads is not None else heads),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_parameters=_rope(opt, gguf_path, rope_divisors, head_dim),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        **moe,
    )
    if opt("attention.key_length") is not None:
        values["head_dim"] = head_dim
    if hybrid:
        values.update(_hybrid_fields(need, opt, fields, arch, tensor_names, gguf_path, head_dim))
        values["rope_parameters"]["partial_rotary_factor"] = (
            int(need("rope.dimension_count")) / head_dim
        )
        if arch == "qwen35moe":
            values.pop("intermediate_size")
    if arch == "llama" and "blk.0.attn_q.bias" in tensor_names:
        values["attention_bias"] = True
    if arch == "qwen2moe":
        values["qkv_bias"] = "blk.0.attn_q.bias" in tensor_names
    config = AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if v is not None})
    config.architectures = [class_name]
    out: dict[str, Any] = config.to_dict()
    return out


def _moe_fields(fields: Any, arch: str, tensor_names: set[str], gguf_path: Path) -> dict[str, Any]:
    """The config's expert fields (module doc), from ``{arch}.expert_*`` and
    from which layers hold experts."""

    def number(key: str, required: bool = True) -> int | None:
        field = fields.get(f"{arch}.{key}")
        if field is None and required:
            raise GgufError(f"{gguf_path.name}: metadata key {arch}.{key} is missing")
        return None if field is None else int(field.contents())

    norm = fields.get(f"{arch}.expert_weights_norm")
    layers = int(_value(fields, f"{arch}.block_count", gguf_path))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    values: dict[str, Any] = dict(
        num_experts=number("expert_count"),
        num_experts_per_tok=number("expert_used_count"),
        moe_intermediate_size=number("expert_feed_forward_length"),
        norm_topk_prob=bool(norm.contents()) if norm is not None else MOE_ARCHS[arch],
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )
    shared = number("expert_shared_feed_forward_length", required=False)
    if arch == "qwen2moe":
        values["shared_expert_intermediate_size"] = shared or 0
    return values


def main_layers(fields: Any, arch: str, gguf_path: Path) -> int | None:
    """A hybrid file's decoder layers: ``block_count`` less the MTP layers
    llama.cpp appends (``nextn_predict_layers``); None for the others."""
    if arch not in HYBRID_ARCHS:
        return None
    blocks = int(_value(fields, f"{arch}.block_count", gguf_path))
    mtp = fields.get(f"{arch}.nextn_predict_layers")
    return blocks - (int(mtp.contents()) if mtp is not None else 0)


def _hybrid_fields(
    need: Any,
    opt: Any,
    fields: Any,
    arch: str,
    tensor_names: set[str],
    gguf_path: Path,
    head_dim: int,
) -> dict[str, Any]:
    """The gated DeltaNet and MTP fields of a hybrid file's config (module doc)."""
    main = main_layers(fields, arch, gguf_path)
    assert main is not None
    value_heads = int(need("ssm.time_step_rank"))
    values: dict[str, Any] = dict(
        num_hidden_layers=main,
        layer_types=[
            "full_attention" if f"blk.{i}.attn_q.weight" in tensor_names else "linear_attention"
            for i in range(main)
        ],
        linear_conv_kernel_dim=int(need("ssm.conv_kernel")),
        linear_key_head_dim=int(need("ssm.state_size")),
        linear_num_key_heads=int(need("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(need("ssm.inner_size")) // value_heads,
        head_dim=head_dim,
        mtp_num_hidden_layers=int(need("block_count")) - main,
    )
    values[TILED_V_HEADS] = True
    return values


def _hybrid_moe_fields(
    fields: Any, arch: str, tensor_names: set[str], gguf_path: Path
) -> dict[str, Any]:
    """A ``qwen35moe`` file's expert fields: every layer routes, with a shared expert."""

    def need(key: str) -> int:
        return int(_value(fields, f"{arch}.{key}", gguf_path))

    return dict(
        num_experts=need("expert_count"),
        num_experts_per_tok=need("expert_used_count"),
        moe_intermediate_size=need("expert_feed_forward_length"),
        shared_expert_intermediate_size=need("expert_shared_feed_forward_length"),
    )


def _head_dim(opt: Any, default: int, gguf_path: Path, partial_rotary: bool = False) -> int:
    """``attention.key_length`` (else hidden / heads), refused where values
    or the rotary part differ from it: the runtime's layout needs them equal
    (the hybrids rotate part of each head: ``partial_rotary``)."""
    head_dim = int(opt("attention.key_length") or default)
    keys = (
        ("attention.value_length",)
        if partial_rotary
        else ("attention.value_length", "rope.dimension_count")
    )
    for key in keys:
        value = opt(key)
        if value is not None and int(value) != head_dim:
            raise GgufError(
                f"{gguf_path.name}: {key} is {value}, not the head size {head_dim}; "
                "metrale converts models whose heads are fully rotary and of one size"
            )
    return head_dim


def _rope(opt: Any, gguf_path: Path, divisors: np.ndarray | None, head_dim: int) -> dict[str, Any]:
    """``rope_parameters`` from ``rope.freq_base`` and ``rope.scaling.*``, or
    from the divisors of llama3 scaling (``gguf_rope.py``)."""
    theta = float(opt("rope.freq_base") or 10000.0)
    kind = opt("rope.scaling.type") or "none"
    if divisors is not None and kind == "none":
        try:
            return gguf_rope.llama3_parameters(divisors, theta, head_dim)
        except ValueError as exc:
            raise GgufError(
                f"{gguf_path.name}: {gguf_rope.NAME} holds RoPE divisors that no llama3 "
                f"scaling gives ({exc})"
            ) from exc
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(opt("rope.scaling.factor") or 1.0)
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if kind == "yarn":
        original = opt("rope.scaling.original_context_length")
        if original is None:
            raise GgufError(f"{gguf_path.name}: yarn RoPE without original_context_length")
        return {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": int(original),
        }
    raise GgufError(
        f"{gguf_path.name}: rope.scaling.type {kind!r} is not supported (none, linear, yarn)"
    )


def generation_config(fields: Any) -> dict[str, Any]:
    """generation_config.json: BOS, EOS (with the end-of-turn token when the
    file names another one) and padding, as the tokenizer metadata gives them."""
    found = (_token_id(fields, "eos"), _token_id(fields, "eot"))
    eos = list(dict.fromkeys(i for i in found if i is not None))
    values = {
        "bos_token_id": _token_id(fields, "bos"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": _token_id(fields, "padding"),
    }
    return {key: value for key, value in values.items() if value is not None}


def _vocab_size(fields: Any, gguf_path: Path) -> int:
    """Tokens in the vocabulary, where the architecture's key does not say."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GgufError(f"{gguf_path.name}: the file has no tokenizer (tokenizer.ggml.tokens)")
    return len(tokens.data)


def _token_id(fields: Any, kind: str) -> int | None:
    field = fields.get(f"tokenizer.ggml.{kind}_token_id")
    return None if field is None else int(field.contents())


def _value(fields: Any, key: str, gguf_path: Path) -> Any:
    field = fields.get(key)
    if field is None:
        raise GgufError(f"{gguf_path.name}: metadata key {key} is missing")
    return field.contents()
