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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.engine.load.quant import check_tensors, read_quant
from metrale.engine.runtime.arch import ArchSpec, CheckpointError
from metrale.engine.runtime.fp8 import BlockFp8
from metrale.engine.runtime.weights import WeightStore

# model_type -> the family whose block it uses. MiMo is a Qwen2 base with MTP
# layers that transformers has no class for.
FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mimo": "qwen2",
}
SUPPORTED = "Llama, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3, MiMo"


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
    raw: dict[str, Any] = json.loads(config_file.read_text())
    model_type = str(raw.get("model_type", ""))
    if model_type not in FAMILIES:
        archs = ", ".join(raw.get("architectures") or []) or "unknown"
        raise CheckpointError(
            f"unsupported architecture {model_type or '?'} ({archs}); supported: {SUPPORTED}"
        )
    quant = read_quant(raw)
    hf_config = _transformers_config(raw, FAMILIES[model_type])
    spec = _arch_spec(hf_config, model_type, FAMILIES[model_type])
    weights = WeightStore.open_folder(path, quant)
    check_tensors(weights.headers(), quant)
    return Checkpoint(path, spec, hf_config, raw, weights, quant)


def _transformers_config(raw: dict[str, Any], family: str) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(family, **fields)


def _arch_spec(config: Any, model_type: str, family: str) -> ArchSpec:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported (only SwiGLU with silu)")
    if getattr(config, "mlp_bias", False):
        raise CheckpointError("mlp_bias=True is not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    window = _sliding_window(config, family)
    return ArchSpec(
        model_type=model_type,
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.rms_norm_eps),
        tie_embeddings=bool(config.tie_word_embeddings),
        context_len=int(config.max_position_embeddings),
        qkv_bias=family == "qwen2" or bool(getattr(config, "attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=window,
    )


def _sliding_window(config: Any, family: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if family == "mistral":
        return int(window) if window else None
    if family in ("qwen2", "qwen3") and getattr(config, "use_sliding_window", False):
        raise CheckpointError(
            "Qwen sliding-window attention (use_sliding_window=true) is not supported"
        )
    return None
