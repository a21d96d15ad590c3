"""GGUF files of the tiny hybrid checkpoints, written as llama.cpp's converter writes them.

Contract: ``write_hybrid_gguf(checkpoint, path, qtype, mix)`` writes a
text-only Qwen3.5 / Qwen3.5-MoE checkpoint (``hybrid_checkpoints.py``,
``qwen3_5_text`` or ``qwen3_5_moe_text``) as llama.cpp's ``Qwen3_5TextModel``
/ ``Qwen3_5MoeTextModel`` write ``qwen35`` / ``qwen35moe``, independently of
metrale's reader:

- names from gguf's own ``TensorNameMap``; the MTP layer appended as block
  ``num_hidden_layers`` (``mtp.fc`` -> ``nextn.eh_proj``,
  ``pre_fc_norm_embedding`` -> ``nextn.enorm``, ``pre_fc_norm_hidden`` ->
  ``nextn.hnorm``, ``norm`` -> ``nextn.shared_head_norm``, its decoder
  layer's tensors as that block's), ``block_count`` counting it and
  ``nextn_predict_layers`` saying so;
- the values as its ``modify_tensors`` changes them: every ``*norm.weight``
  but the DeltaNet's gated norm with 1 added, ``A_log`` as ``-exp(A_log)``,
  ``dt_bias`` as ``ssm_dt.bias``, the conv1d squeezed to ``[channels,
  kernel]``, and, where value heads outnumber key heads, the value heads of
  every linear-attention tensor reordered from grouped by key head to tiled
  (``_LinearAttentionVReorderBase``: rows of ``in_proj_qkv``'s value part,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, the entries of ``A_log`` and
  ``dt_bias``, the conv1d's value channels and ``out_proj``'s columns);
- experts stacked ``[experts, rows, cols]``; 2-D weights in ``qtype`` (or
  ``mix``'s type, by a part of the HF name), and F32 for vectors, norms,
  the conv1d and the routers, as its ``prepare_tensors`` forces;
- the ``{arch}.ssm.*`` keys, ``full_attention_interval``, partial rotary
  as ``rope.dimension_count`` and the MRoPE sections, padded to four, as
  ``rope.dimension_sections``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES
from safetensors.torch import load_file

from tests.support.gguf_files import _stack_experts, _stored, _write_tokenizer, type_of

ARCHS = {"qwen3_5_text": gguf.MODEL_ARCH.QWEN35, "qwen3_5_moe_text": gguf.MODEL_ARCH.QWEN35MOE}
NEXTN = {
    "fc": MODEL_TENSOR.NEXTN_EH_PROJ,
    "pre_fc_norm_embedding": MODEL_TENSOR.NEXTN_ENORM,
    "pre_fc_norm_hidden": MODEL_TENSOR.NEXTN_HNORM,
    "norm": MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM,
}


def write_hybrid_gguf(
    checkpoint: Path, path: Path, qtype: str = "F32", mix: Mapping[str, str] | None = None
) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["model_type"]]
    layers, mtp = config["num_hidden_layers"], config.get("mtp_num_hidden_layers", 0)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _hyperparameters(writer, config, layers + mtp)
    _write_tokenizer(writer, checkpoint)
    names = gguf.get_tensor_name_map(arch, layers + mtp)
    weights = {k: v.float() for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    for name, value in sorted(_stack_experts(weights).items()):
        gguf_name, weight = _llama_cpp_tensor(name, value, config, names, layers)
        kind = GGMLQuantizationType[type_of(name, qtype, mix)]
        forced = name.endswith(("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight"))
        if weight.ndim == 1 or "conv1d" in name or forced or kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, weight)
        else:
            writer.add_tensor(gguf_name, _stored(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_tensor(
    name: str, value: torch.Tensor, config: dict, names: gguf.TensorNameMap, layers: int
) -> tuple[str, np.ndarray]:
    """The GGUF name and value llama.cpp writes for the checkpoint's ``name``."""
    if "linear_attn." in name:
        value = _tiled(name, value, config)
    if name.endswith(".A_log"):
        value = -torch.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    if name.endswith("shared_expert_gate.weight"):
        value = value.reshape(-1)  # llama.cpp's loader takes it as a vector
    if name.startswith("mtp."):
        parts = name.split(".")
        if parts[1] in NEXTN:  # mtp.fc.weight -> blk.{layers}.nextn.eh_proj.weight
            base = TENSOR_NAMES[NEXTN[parts[1]]].format(bid=layers)
            return f"{base}.{parts[2]}", value.numpy()
        name = f"model.layers.{layers + int(parts[2])}." + ".".join(parts[3:])
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert gguf_name is not None, name
    return gguf_name, value.numpy()


def _tiled(name: str, value: torch.Tensor, config: dict) -> torch.Tensor:
    """``value`` with its value heads reordered from grouped to tiled (module doc)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if nk == nv:
        return value
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]

    def reorder(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(t.shape)
        split = [*shape[:dim], nk, nv // nk, head_dim, *shape[dim + 1 :]]
        return t.reshape(split).transpose(dim, dim + 1).contiguous().reshape(shape)

    qk = 2 * nk * dk
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([value[:qk], reorder(value[qk:], 0, dv)])
    if name.endswith("in_proj_z.weight"):
        return reorder(value, 0, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return reorder(value, 0, 1)
    if name.endswith("out_proj.weight"):
        return reorder(value, 1, dv)
    return value


def _hyperparameters(writer: gguf.GGUFWriter, config: dict, blocks: int) -> None:
    head_dim = config["head_dim"]
    rope = config["rope_parameters"]
    writer.add_block_count(blocks)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    if "intermediate_size" in config and config["model_type"] == "qwen3_5_text":
        writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    sections = list(rope.get("mrope_section") or [11, 11, 10])  # its default where none
    writer.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    if blocks > config["num_hidden_layers"]:
        writer.add_nextn_predict_layers(blocks - config["num_hidden_layers"])
    if config["model_type"] == "qwen3_5_moe_text":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
