"""A HF-style checkpoint folder: its architecture and its tensors.

Contract: ``read_checkpoint(path)`` reads ``config.json`` and the safetensors
index (``model.safetensors`` or shards named by
``model.safetensors.index.json``) without loading any weight. It returns the
``ArchSpec`` the runtime builds from, the transformers config (for RoPE
scalings), the raw config dict (MTP fields that transformers drops) and a
``WeightStore`` that reads one tensor at a time. An architecture outside the
Llama family is refused with a message naming what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

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


class CheckpointError(ValueError):
    """A checkpoint metrale cannot load; the message says why and what is supported."""


@dataclass(frozen=True)
class ArchSpec:
    """The shapes and options of one Llama-family decoder stack."""

    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    context_len: int
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    spec: ArchSpec
    hf_config: Any  # transformers.PretrainedConfig
    raw_config: dict[str, Any]
    weights: WeightStore


class WeightStore:
    """Names -> safetensors file; tensors are read on demand."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    @classmethod
    def open_folder(cls, folder: Path) -> WeightStore:
        """``model.safetensors``, or the shards ``model.safetensors.index.json`` names."""
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            return cls({name: folder / file for name, file in weight_map.items()})
        if single.exists():
            return cls.open_file(single)
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json "
            "(only safetensors weights are read)"
        )

    @classmethod
    def open_file(cls, file: Path) -> WeightStore:
        try:
            with safe_open(str(file), framework="pt") as handle:
                return cls(dict.fromkeys(handle.keys(), file))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {file}: {exc}") from exc

    def names(self) -> list[str]:
        return sorted(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, read from the header only."""
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())


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
    hf_config = _transformers_config(raw, FAMILIES[model_type])
    spec = _arch_spec(hf_config, model_type, FAMILIES[model_type])
    return Checkpoint(path, spec, hf_config, raw, WeightStore.open_folder(path))


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
