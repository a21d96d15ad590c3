"""Standalone MTP heads: a ``<name>.safetensors`` + ``<name>.json`` pair.

Contract: a head has DeepSeek's structure (see ``mtp.py``):
``eh_proj(cat[enorm(embed(t_{p+1})), hnorm(h_p)])``, one decoder block of the
base model's own architecture, a final ``norm``; the embedding and LM head are
the base model's. Tensor names in the safetensors file:

    enorm.weight, hnorm.weight, eh_proj.weight, norm.weight,
    block.<the HF decoder-layer names: input_layernorm.weight, self_attn.q_proj.weight, ...>
    draft_vocab (optional): [n] int64, sorted token ids the head drafts from

The JSON card names the format and what the head fits:
``{"format": "metrale-mtp-head", "version": 1, "layout": "deepseek",
"base_model": ..., "family": ..., "hidden_size": ..., "vocab_size": ...,
"fields": {free-form training facts}}``. Loading checks the card against the
model and refuses a head built for another shape with a message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from metrale.engine.kernels.binding import PackedKernel
from metrale.engine.runtime.arch import ArchSpec, CheckpointError
from metrale.engine.runtime.block import load_block
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.mtp import MtpLayer, MtpWeights
from metrale.engine.runtime.packed import Bf16Source
from metrale.engine.runtime.weights import WeightStore

HEAD_FORMAT = "metrale-mtp-head"
HEAD_VERSION = 1
DRAFT_VOCAB = "draft_vocab"


class MtpHeadError(CheckpointError):
    """A head file that cannot be used: missing, malformed, or for another model."""


def head_paths(path: Path) -> tuple[Path, Path]:
    """``(weights, card)`` for a stem, either file of the pair, or a folder
    holding exactly one pair."""
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            names = ", ".join(f.name for f in found) or "none"
            raise MtpHeadError(
                f"{path} should hold exactly one <name>.safetensors MTP head (found: {names}); "
                "name the file"
            )
        path = found[0]
    stem = path.with_suffix("") if path.suffix in (".safetensors", ".json") else path
    # Appended, not with_suffix: a stem like "llama-3.2-1b" keeps its ".2-1b".
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def head_tensor_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a head for ``spec`` holds, with its shape (for writers and trainers)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "norm.weight": (hidden,),
        "block.input_layernorm.weight": (hidden,),
        "block.post_attention_layernorm.weight": (hidden,),
        "block.self_attn.q_proj.weight": (spec.q_size, hidden),
        "block.self_attn.k_proj.weight": (spec.kv_size, hidden),
        "block.self_attn.v_proj.weight": (spec.kv_size, hidden),
        "block.self_attn.o_proj.weight": (hidden, spec.q_size),
        "block.mlp.gate_proj.weight": (inter, hidden),
        "block.mlp.up_proj.weight": (inter, hidden),
        "block.mlp.down_proj.weight": (hidden, inter),
    }
    if spec.qkv_bias:
        shapes["block.self_attn.q_proj.bias"] = (spec.q_size,)
        shapes["block.self_attn.k_proj.bias"] = (spec.kv_size,)
        shapes["block.self_attn.v_proj.bias"] = (spec.kv_size,)
    if spec.qk_norm:
        shapes["block.self_attn.q_norm.weight"] = (spec.head_dim,)
        shapes["block.self_attn.k_norm.weight"] = (spec.head_dim,)
    return shapes


def save_mtp_head(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    spec: ArchSpec,
    *,
    base_model: str,
    fields: Mapping[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Writes the pair for ``path`` (a stem or either file name); returns both paths."""
    expected = head_tensor_shapes(spec)
    tensors = dict(tensors)
    vocab = tensors.pop(DRAFT_VOCAB, None)
    if vocab is not None:
        _check_draft_vocab(vocab, spec.vocab_size)
        tensors[DRAFT_VOCAB] = vocab
        expected[DRAFT_VOCAB] = tuple(vocab.shape)
    if set(tensors) != set(expected):
        missing, extra = set(expected) - set(tensors), set(tensors) - set(expected)
        raise ValueError(
            f"MTP head tensors differ: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, expected {shape}")
    weights_file, card_file = head_paths(path)
    weights_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(weights_file))
    card = {
        "format": HEAD_FORMAT,
        "version": HEAD_VERSION,
        "layout": "deepseek",
        "base_model": base_model,
        "family": spec.family,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "fields": dict(fields or {}),
    }
    card_file.write_text(json.dumps(card, indent=2) + "\n")
    return weights_file, card_file


def _check_draft_vocab(vocab: torch.Tensor, vocab_size: int) -> None:
    if vocab.dtype != torch.int64 or vocab.dim() != 1 or vocab.numel() == 0:
        raise ValueError(f"{DRAFT_VOCAB} must be a non-empty 1-D int64 tensor of token ids")
    if not bool((vocab[1:] > vocab[:-1]).all()) or vocab[0] < 0 or vocab[-1] >= vocab_size:
        raise ValueError(f"{DRAFT_VOCAB} must hold distinct ascending ids below {vocab_size}")


def read_card(path: Path) -> dict[str, Any]:
    _, card_file = head_paths(path)
    if not card_file.exists():
        raise MtpHeadError(f"MTP head card {card_file} is missing")
    try:
        card: dict[str, Any] = json.loads(card_file.read_text())
    except (OSError, ValueError) as exc:
        raise MtpHeadError(f"MTP head card {card_file} cannot be read: {exc}") from exc
    if (
        not isinstance(card, dict)
        or card.get("format") != HEAD_FORMAT
        or card.get("version") != HEAD_VERSION
    ):
        raise MtpHeadError(f"{card_file} is not a {HEAD_FORMAT} v{HEAD_VERSION} card")
    return card


def load_mtp_head(path: Path, model: LlamaModel, kernel: PackedKernel | None = None) -> MtpLayer:
    """The head at ``path`` as an ``MtpModule`` sharing ``model``'s embedding and LM head.
    With a ``kernel``, its bfloat16 linear weights run packed (exact, half the bytes)."""
    weights_file = head_paths(path)[0]
    card = read_card(path)
    spec = model.spec
    for key, want in (
        ("family", spec.family),
        ("hidden_size", spec.hidden_size),
        ("vocab_size", spec.vocab_size),
    ):
        if card.get(key) != want:
            raise MtpHeadError(
                f"MTP head {weights_file.name} was built for {key}={card.get(key)}, "
                f"this model has {want} (base model of the head: {card.get('base_model')})"
            )
    try:
        store = WeightStore.open_file(weights_file)
        for name, shape in head_tensor_shapes(spec).items():
            got = store.shape(name)
            if got != shape:
                # Same width and vocabulary, yet another block (heads, MLP width, biases).
                raise MtpHeadError(f"{name} has shape {got}, this model needs {shape}")
    except CheckpointError as exc:
        raise MtpHeadError(
            f"MTP head {weights_file}: {exc} (base model of the head: {card.get('base_model')})"
        ) from exc
    packed = Bf16Source(store, kernel) if kernel else None

    def get(name: str) -> torch.Tensor:
        return store.get(name).to(device=model.device, dtype=model.dtype)

    weights = MtpWeights(
        token_norm=get("enorm.weight"),
        hidden_norm=get("hnorm.weight"),
        proj=(packed.get("eh_proj.weight") if packed else None) or get("eh_proj.weight"),
        final_norm=get("norm.weight"),
        hidden_first=False,
        block=load_block(store, "block.", spec, model.dtype, model.device, packed=packed),
        draft_vocab=_draft_vocab(store, weights_file, spec.vocab_size),
    )
    return MtpLayer(model, weights)


def _draft_vocab(store: WeightStore, file: Path, vocab_size: int) -> torch.Tensor | None:
    if DRAFT_VOCAB not in store:
        return None
    vocab = store.get(DRAFT_VOCAB)
    try:
        _check_draft_vocab(vocab, vocab_size)
    except ValueError as exc:
        raise MtpHeadError(f"MTP head {file.name}: {exc}") from exc
    return vocab
