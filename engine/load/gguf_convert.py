"""A GGUF file of a Llama-family model to a HF-style checkpoint folder.

Contract: ``convert_gguf(gguf_path, out, stamp)`` checks the whole file first
(architecture, metadata, every tensor's name and type), then writes into
``out``: ``config.json``, ``generation_config.json``, the weights
(``model.safetensors``, or shards and their index past ``SHARD_BYTES``),
``packed.safetensors`` for the quantized tensors, the tokenizer with its chat
template, ``gguf_types.json`` (each tensor's GGUF type, for ``metrale
info``), and last the ``stamp`` (``convert_once.STAMP``), so a folder with a
stamp is complete. A file it cannot convert exactly raises ``GgufError``
naming the architecture, the metadata key (``gguf_config.py`` reads the
metadata) or the tensor and its type.

Architectures, as ``general.architecture`` names them: ``llama`` (Llama,
SmolLM, Mistral: llama.cpp writes them all as llama), ``qwen2``, ``qwen3``,
the MoE ``qwen2moe`` and ``qwen3moe``, whose expert tensors are split
into the per-expert keys of a HF checkpoint (``gguf_names.py``), and the
gated DeltaNet hybrids ``qwen35`` and ``qwen35moe`` with their MTP layer.
llama.cpp changes three kinds of their values, undone here
(``hybrid_value``): zero-centred RMSNorm weights are stored with the 1
added (``(w + 1) - 1`` then ``1 + w`` in the runtime gives back the stored
float exactly), ``A_log`` as ``-exp(A_log)`` (its log is taken in float64:
the runtime's ``-exp`` of it is the stored value to within a rounding), and
the conv1d without its middle axis. These are float tensors in llama.cpp's
files; a block type there is refused.
Tensor types: F32, F16 and BF16 are stored as they are; the block types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are dequantized to float32,
which holds them exactly, and also kept in blocks in ``packed.safetensors``
(``runtime/packed.py``, in the kernel's layout: ``gguf_blocks.py``) for the
CPU kernel. Any other type (Q2_K, Q3_K, the IQ and TQ types...) is refused,
naming it and a tensor that has it.
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
from metrale.engine.load.gguf_blocks import KERNEL_TYPES, kernel_blocks
from metrale.engine.load.gguf_config import (
    GgufError,
    architecture,
    generation_config,
    main_layers,
    model_config,
)
from metrale.engine.load.gguf_names import hf_names, is_one_row, zero_centred
from metrale.engine.runtime.packed import PACKED_FILE, save_packed

SUPPORTED_TYPES = ("F32", "F16", "BF16", *KERNEL_TYPES)
# Each tensor's GGUF type, as the file stores it: what `metrale info` lists.
TYPES_FILE = "gguf_types.json"
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
    main_layers: int | None = None  # a hybrid file's decoder layers (``gguf_names``)

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
    types = {str(t.name): t.tensor_type.name for t in reader.tensors}
    (out / TYPES_FILE).write_text(json.dumps(types, indent=1))
    (out / STAMP).write_text(json.dumps(dict(stamp), indent=2))


def read_model(reader: Any, gguf_path: Path) -> GgufModel:
    """The checked description of the file; ``GgufError`` before anything is
    written when its architecture, metadata or any tensor cannot be converted."""
    fields = reader.fields
    arch = architecture(fields, gguf_path)
    main = main_layers(fields, arch, gguf_path)
    check_tensors(reader.tensors, gguf_path, main)
    names = {str(t.name) for t in reader.tensors}
    rope_divisors = next((t.data for t in reader.tensors if t.name == gguf_rope.NAME), None)
    config = model_config(fields, arch, names, gguf_path, rope_divisors)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return GgufModel(arch, config, generation_config(fields), heads, kv_heads, main)


def check_tensors(tensors: Any, gguf_path: Path, main: int | None = None) -> None:
    """Refuses, naming the first tensor of each, a tensor type the runtime
    cannot hold exactly, and a tensor name with no HF counterpart
    (``main``: a hybrid file's decoder layers)."""
    odd: dict[str, str] = {}  # type -> its first tensor
    for tensor in tensors:
        kind, name = tensor.tensor_type.name, str(tensor.name)
        if kind not in SUPPORTED_TYPES:
            odd.setdefault(kind, name)
        if name not in CONFIG_TENSORS:
            hf_names(name, numpy_shape(tensor), main)
        if main is not None and _changed(name) and kind not in ("F32", "F16"):
            raise GgufError(
                f"{gguf_path.name}: tensor {name} is {kind}; metrale reads it as F32 or "
                "F16, as llama.cpp writes it"
            )
    if odd:
        first = ", ".join(f"{name} is {kind}" for kind, name in odd.items())
        raise GgufError(
            f"{gguf_path.name}: tensor {first}; metrale reads GGUF tensors stored as "
            f"{', '.join(SUPPORTED_TYPES)} only (use a Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 "
            "GGUF of the model, or its checkpoint folder)"
        )


def numpy_shape(tensor: Any) -> list[int]:
    """A GGUF tensor's shape outermost first (GGUF lists dims innermost first)."""
    return [int(d) for d in reversed(tensor.shape)]


def dense_values(tensor: Any, model: GgufModel) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors a GGUF tensor becomes (one per expert for an expert
    tensor), as the HF checkpoint stores them: ``[out_features,
    in_features]`` or ``[n]``, float32 for blocks, their own dtype for
    F32/F16/BF16."""
    from gguf.quants import dequantize

    name, shape = str(tensor.name), numpy_shape(tensor)
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
    if is_one_row(name):
        value = value.reshape(1, -1)
    if model.main_layers is not None:
        value = hybrid_value(name, value)
    names = hf_names(name, shape, model.main_layers)
    parts = [value] if len(names) == 1 else list(value)  # [experts, rows, cols]: one per expert
    out = []
    for hf, part in zip(names, parts, strict=True):
        # A copy: the reader's arrays map the file read-only.
        held = torch.from_numpy(np.array(unpermuted(name, part, model)))
        out.append((hf, held.view(torch.bfloat16) if kind == "BF16" else held))
    return out


def _changed(name: str) -> bool:
    """Whether ``hybrid_value`` changes a hybrid file's tensor."""
    return zero_centred(name) or name.endswith(".ssm_a") or ".ssm_conv1d." in name


def hybrid_value(name: str, value: np.ndarray) -> np.ndarray:
    """A hybrid file's tensor as the checkpoint holds it (module doc)."""
    if zero_centred(name):
        return value.astype(np.float32) - np.float32(1.0)
    if name.endswith(".ssm_a"):
        return np.log(-value.astype(np.float64)).astype(np.float32)
    if ".ssm_conv1d." in name:  # [channels, kernel] -> [channels, 1, kernel]
        return value.reshape(value.shape[0], 1, value.shape[-1])
    return value


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
        weights = {k: v for t in shards[0] for k, v in dense_values(t, model)}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        weights = {k: v for t in shard for k, v in dense_values(t, model)}
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


def packed_blocks(tensor: Any) -> tuple[str, np.ndarray, np.ndarray] | None:
    """``(format, data [n, row_bytes] uint8, scales [n, row_scales] float32)``
    of a quantized tensor in the kernel's layout (``gguf_blocks.py``), rows
    outermost first (an expert tensor's experts one after the other);
    ``None`` for F32/F16/BF16 (kept dense only)."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    return kernel_blocks(tensor.tensor_type.name, raw.reshape(-1, raw.shape[-1]))


def write_packed(reader: Any, model: GgufModel, file: Path) -> None:
    """``packed.safetensors`` for the file's quantized tensors, if it has
    any, beside the dense weights (written first: the packed file records
    their size)."""
    weights = {}
    for tensor in reader.tensors:
        packed = packed_blocks(tensor)
        if packed is None:
            continue
        fmt, data, scales = packed
        name = str(tensor.name)
        names = hf_names(name, numpy_shape(tensor), model.main_layers)
        rows = data.shape[0] // len(names)  # an expert tensor's rows: its experts in turn
        for i, hf in enumerate(names):
            part = slice(i * rows, (i + 1) * rows)
            weights[hf] = (
                fmt,
                torch.from_numpy(np.ascontiguousarray(unpermuted(name, data[part], model))),
                torch.from_numpy(np.ascontiguousarray(unpermuted(name, scales[part], model))),
            )
    if weights:  # an F32/F16/BF16 file has none: no packed file, as for a plain folder
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
