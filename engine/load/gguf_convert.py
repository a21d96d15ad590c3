"""A GGUF file of a Llama-family model to a HF-style checkpoint folder.

Contract: ``convert_gguf(gguf_path, out, stamp)`` checks the whole file first
(architecture, metadata, every tensor's name and type), then writes into
``out``: ``config.json``, ``generation_config.json``, the weights
(``model.safetensors``, or shards and their index past ``SHARD_BYTES``),
``packed.safetensors`` for the Q4_1/Q8_0 tensors, the tokenizer with its chat
template, and last the ``stamp`` (``convert_once.STAMP``), so a folder with a
stamp is complete. A file it cannot convert exactly raises ``GgufError``
naming the architecture, the metadata key (``gguf_config.py`` reads the
metadata) or the tensor and its type.

Architectures, as ``general.architecture`` names them: ``llama`` (Llama,
SmolLM, Mistral: llama.cpp writes them all as llama), ``qwen2``, ``qwen3``.
Tensor types: F32, F16 and BF16 are stored as they are; Q4_1 and Q8_0 are
dequantized to float32, which holds them exactly, and also kept in their
blocks in ``packed.safetensors`` (``runtime/packed.py``) for the CPU kernel.
llama.cpp stores a llama model's q/k projections permuted for its
interleaved RoPE; the permutation is undone here (on rows, so it applies to
blocks alike) so the half-split RoPE of HF checkpoints applies. Qwen models
use llama.cpp's half-split (NeoX) RoPE and are stored unpermuted. Llama 3's
RoPE scaling, which llama.cpp stores as the tensor ``rope_freqs.weight``,
becomes ``rope_parameters`` again (``gguf_rope.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metrale.engine.load import gguf_rope
from metrale.engine.load.convert_once import STAMP
from metrale.engine.load.gguf_config import (
    GgufError,
    architecture,
    generation_config,
    model_config,
)
from metrale.engine.runtime.packed import PACKED_FILE, save_packed

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_1")
# Tensors that are settings, not weights: they go into config.json.
CONFIG_TENSORS = (gguf_rope.NAME,)
# A model whose dense weights exceed this is written in shards of at most this
# size, so a conversion never holds more than one shard of float32 in memory.
SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class GgufModel:
    """What the file's metadata says, checked: the folder's two configs and
    how its q/k rows are laid out."""

    arch: str
    config: dict[str, Any]  # config.json
    generation: dict[str, Any]  # generation_config.json
    num_heads: int
    num_kv_heads: int

    @property
    def permuted(self) -> bool:
        """Whether llama.cpp stored q/k rows interleaved (its llama RoPE)."""
        return self.arch == "llama"


def convert_gguf(gguf_path: Path, out: Path, stamp: Mapping[str, Any]) -> None:
    """Writes the HF-style checkpoint of ``gguf_path`` into ``out`` (see module doc)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    model = read_model(reader, gguf_path)
    _write_dense(reader, model, out)
    write_packed(reader, model, out / PACKED_FILE)
    (out / "config.json").write_text(json.dumps(model.config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(model.generation, indent=2))
    write_tokenizer(gguf_path, out)
    (out / STAMP).write_text(json.dumps(dict(stamp), indent=2))


def read_model(reader: Any, gguf_path: Path) -> GgufModel:
    """The checked description of the file; ``GgufError`` before anything is
    written when its architecture, metadata or any tensor cannot be converted."""
    fields = reader.fields
    arch = architecture(fields, gguf_path)
    check_tensors(reader.tensors, gguf_path)
    names = {str(t.name) for t in reader.tensors}
    rope_divisors = next((t.data for t in reader.tensors if t.name == gguf_rope.NAME), None)
    config = model_config(fields, arch, names, gguf_path, rope_divisors)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return GgufModel(arch, config, generation_config(fields), heads, kv_heads)


def check_tensors(tensors: Any, gguf_path: Path) -> None:
    """Refuses, naming the first tensor of each, a tensor type the runtime
    cannot hold exactly, and a tensor name with no HF counterpart."""
    odd: dict[str, str] = {}  # type -> its first tensor
    for tensor in tensors:
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            odd.setdefault(kind, str(tensor.name))
        if tensor.name not in CONFIG_TENSORS:
            hf_name(str(tensor.name))
    if odd:
        first = ", ".join(f"{name} is {kind}" for kind, name in odd.items())
        raise GgufError(
            f"{gguf_path.name}: tensor {first}; metrale reads GGUF tensors stored as "
            f"{', '.join(SUPPORTED_TYPES)} only (use a Q8_0, Q4_1, F16 or BF16 GGUF of "
            "the model, or its checkpoint folder)"
        )


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
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``;
    ``GgufError`` for a tensor with no counterpart (``rope_freqs.weight``,
    expert tensors...), which a conversion could only drop."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[2] in _PARTS
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{parts[1]}.{_PARTS[parts[2]]}.{parts[3]}"
    raise GgufError(
        f"tensor {name} has no counterpart in a HF Llama-family checkpoint "
        "(metrale converts dense Llama and Qwen GGUFs)"
    )


def dense_value(tensor: Any, model: GgufModel) -> torch.Tensor:
    """The tensor as the HF checkpoint stores it: ``[out_features, in_features]``
    or ``[n]``, float32 for blocks, its own dtype for F32/F16/BF16."""
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims innermost first
    kind = tensor.tensor_type.name
    value: np.ndarray
    if kind == "F32":
        value = np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    elif kind == "F16":
        value = np.asarray(tensor.data, dtype=np.float16).reshape(shape)
    elif kind == "BF16":  # raw bytes: two per value, read as int16 and viewed as bfloat16
        value = np.ascontiguousarray(tensor.data).view(np.int16).reshape(shape)
    else:
        value = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    # A copy: the reader's arrays map the file read-only.
    out = torch.from_numpy(np.array(unpermuted(str(tensor.name), value, model)))
    return out.view(torch.bfloat16) if kind == "BF16" else out


def unpermuted(gguf_name: str, rows: np.ndarray, model: GgufModel) -> np.ndarray:
    """``rows`` with llama.cpp's q/k permutation undone, where it was applied."""
    if not model.permuted:
        return rows
    if gguf_name.endswith("attn_q.weight"):
        return unpermute(rows, model.num_heads)
    if gguf_name.endswith("attn_k.weight"):
        return unpermute(rows, model.num_kv_heads)
    return rows


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: within each head, rows were
    interleaved as (pair, half); HF keeps them as (half, pair). Only rows
    move, so it applies to values and to packed blocks alike."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


def _write_dense(reader: Any, model: GgufModel, out: Path) -> None:
    """``model.safetensors``, or shards of at most ``SHARD_BYTES`` and their index."""
    from safetensors.torch import save_file

    shards = _shards(reader.tensors, model)
    if len(shards) == 1:
        weights = {hf_name(str(t.name)): dense_value(t, model) for t in shards[0]}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weights = {hf_name(str(t.name)): dense_value(t, model) for t in shard}
        save_file(weights, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(weights, file))
        total += sum(w.numel() * w.element_size() for w in weights.values())
        del weights
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _shards(tensors: Any, model: GgufModel) -> list[list[Any]]:
    """The tensors in file order, cut where a shard would pass ``SHARD_BYTES``."""
    shards: list[list[Any]] = [[]]
    size = 0
    for tensor in (t for t in tensors if t.name not in CONFIG_TENSORS):
        itemsize = 2 if tensor.tensor_type.name in ("F16", "BF16") else 4
        nbytes = int(tensor.n_elements) * itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


# bytes per block of 32 values: Q4_1 = f16 d, f16 m, 16 bytes of nibbles;
# Q8_0 = f16 d, 32 signed bytes.
_BLOCKS = {"Q4_1": ("q4_1", 20, 4), "Q8_0": ("q8_0", 34, 2)}


def packed_blocks(tensor: Any) -> tuple[str, np.ndarray, np.ndarray] | None:
    """``(format, data [n, row_bytes] uint8, scales [n, row_scales] float32)``
    for a Q4_1/Q8_0 tensor; ``None`` for other types (kept dense only)."""
    if tensor.tensor_type.name not in _BLOCKS:
        return None
    fmt, block_bytes, scale_bytes = _BLOCKS[tensor.tensor_type.name]
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)  # [n, k / 32, block_bytes]
    scales = blocks[:, :, :scale_bytes].copy().view(np.float16).astype(np.float32)
    data = blocks[:, :, scale_bytes:].reshape(rows, -1)
    return fmt, data, scales.reshape(rows, -1)


def write_packed(reader: Any, model: GgufModel, file: Path) -> None:
    """``packed.safetensors`` for the file's Q4_1/Q8_0 tensors, beside the
    dense weights (written first: the packed file records their size)."""
    weights = {}
    for tensor in reader.tensors:
        packed = packed_blocks(tensor)
        if packed is not None:
            fmt, data, scales = packed
            data = unpermuted(str(tensor.name), data, model)
            scales = unpermuted(str(tensor.name), scales, model)
            weights[hf_name(str(tensor.name))] = (
                fmt,
                torch.from_numpy(np.ascontiguousarray(data)),
                torch.from_numpy(np.ascontiguousarray(scales)),
            )
    save_packed(weights, file)


def write_tokenizer(gguf_path: Path, out: Path) -> None:
    """The tokenizer the metadata describes (``tokenizer.ggml.*``) and its chat
    template (``tokenizer.chat_template``), through transformers' GGUF reader."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise GgufError(f"{gguf_path.name}: cannot build its tokenizer: {exc}") from exc
    tokenizer.save_pretrained(str(out))
