"""GGUF files of tiny checkpoints, written the way llama.cpp's converter writes them.

Contract: ``write_gguf(checkpoint, path, qtype)`` writes the tiny checkpoint
at ``checkpoint`` (``tests/support/checkpoints.py``) as a GGUF file, independently
of metrale's reader: tensor names from gguf's own ``TensorNameMap``, a llama
model's q/k rows permuted as llama.cpp's ``LlamaModel.permute`` does (Qwen's
are not), 2-D weights in ``qtype`` and norms in F32, llama3 RoPE scaling as
llama.cpp's ``rope_freqs.weight`` divisors, hyperparameters through
``GGUFWriter``'s keys, and the byte tokenizer as ``tokenizer.ggml.*``
metadata: ``gpt2`` model, tokens in the byte-level spelling, the specials
marked control, scores, BOS/EOS/EOT/padding ids and the chat template.

``qtype`` is a ``GGMLQuantizationType`` name. The block types metrale reads
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and F32, F16, BF16 hold the
real values (``tests/support/gguf_quants.py``); others (Q2_K, IQ4_NL...) get
zero bytes of the right size, enough for a reader that refuses them by
type. ``mix`` gives some tensors another type, by a part of their HF name
(``{"v_proj": "Q8_0"}``), as llama.cpp's Q4_K_M mixes types. ``dequantized_twin(checkpoint, out, qtype)`` copies the checkpoint
with each 2-D weight replaced by what ``qtype`` holds of it, so a GGUF and
its twin describe the same model exactly.

A MoE checkpoint (``tests/support/moe_checkpoints.py``, every layer's MLP
made of experts, as llama.cpp runs them) is written as llama.cpp's
converter writes ``qwen2moe`` and ``qwen3moe``: each projection's experts
stacked into one ``[experts, rows, cols]`` tensor (``ffn_*_exps``), the
expert counts and sizes as ``{arch}.expert_*`` keys, and Qwen2-MoE's shared
expert gate as a vector.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.support.checkpoints import CHAT_TEMPLATE, SPECIAL_TOKENS
from tests.support.gguf_quants import quantize_blocks

ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
}
CONTROL, NORMAL = 3, 1  # gguf.TokenType values
IM_END = "<|im_end|>"


def write_gguf(
    checkpoint: Path, path: Path, qtype: str = "F32", mix: Mapping[str, str] | None = None
) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    family = config["model_type"]
    arch = ARCHS[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _write_hyperparameters(writer, config)
    _write_tokenizer(writer, checkpoint)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    weights = load_file(str(checkpoint / "model.safetensors"))
    for name, value in sorted(_stack_experts(weights).items()):
        weight = value.float().numpy()  # [out, in], [experts, out, in] or [n]
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            weight = llama_cpp_permute(weight, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(-1)  # llama.cpp's loader takes it as a vector
        kind = GGMLQuantizationType[type_of(name, qtype, mix)]
        if weight.ndim == 1 or kind == GGMLQuantizationType.F32 or kept_float(name):
            writer.add_tensor(gguf_name, weight)
        else:
            writer.add_tensor(gguf_name, _stored(weight, kind), raw_dtype=kind)
    if config["rope_parameters"]["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_rope_freqs(config: dict) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's ``LlamaModel`` writes llama3 scaling:
    one divisor per frequency, float32 ``[head_dim / 2]``."""
    rope = config["rope_parameters"]
    dim = config["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            divisors.append(1.0)
        elif wavelen > old_context_len / low:
            divisors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: per head, rows (half, pair) -> (pair, half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def dequantized_twin(
    checkpoint: Path, out: Path, qtype: str, mix: Mapping[str, str] | None = None
) -> Path:
    """A copy of ``checkpoint`` whose 2-D weights are ``qtype``'s values of them
    (row permutations commute with blocks along rows, so the twin of the
    permuted GGUF tensor is the dequantized unpermuted one)."""
    shutil.copytree(checkpoint, out)
    weights = load_file(str(out / "model.safetensors"))
    for name, value in weights.items():
        kind = GGMLQuantizationType[type_of(name, qtype, mix)]
        if value.dim() == 2 and not kept_float(name) and kind != GGMLQuantizationType.F32:
            held = dequantize(_stored(value.float().numpy(), kind), kind).reshape(value.shape)
            weights[name] = torch.from_numpy(np.ascontiguousarray(held, dtype=np.float32))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def type_of(name: str, qtype: str, mix: Mapping[str, str] | None) -> str:
    """``mix``'s type for the first of its keys ``name`` contains, else ``qtype``."""
    return next((kind for part, kind in (mix or {}).items() if part in name), qtype)


def kept_float(name: str) -> bool:
    """Routers, which llama.cpp never quantizes, and the shared expert's gate."""
    return name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))


def _stored(weight: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """The bytes a GGUF stores for ``weight`` (``[..., rows, row_bytes]`` uint8)."""
    rows = weight.reshape(-1, weight.shape[-1])
    try:
        held = quantize_blocks(rows, kind.name)
    except NotImplementedError:  # no quantizer (Q2_K, the i-quants...): bytes only
        return np.zeros(quant_shape_to_byte_shape(weight.shape, kind), dtype=np.uint8)
    return held.reshape(*weight.shape[:-1], -1)


def _stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mlp.experts.{e}.{proj}.weight`` -> ``mlp.experts.{proj}.weight``
    ``[experts, rows, cols]``, as llama.cpp's converter merges them."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in weights.items():
        prefix, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            out[name] = value
            continue
        number, _, projection = rest.partition(".")
        experts.setdefault(f"{prefix}.mlp.experts.{projection}", {})[int(number)] = value
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _write_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if config["model_type"] in ("qwen3", "qwen3_moe"):  # llama.cpp writes Qwen3's head size
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config["model_type"] in ("qwen2_moe", "qwen3_moe"):
        writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config["model_type"] == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path) -> None:
    """The checkpoint's byte-level tokenizer as llama.cpp stores a ``gpt2`` one."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if t in SPECIAL_TOKENS else NORMAL for t in tokens])
    # The vocabulary has no merges (every byte is a token); the scores stand in
    # for the empty merge list, which GGUF cannot store as an array.
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_eot_token_id(vocab[IM_END])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
