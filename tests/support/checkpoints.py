"""Tiny random checkpoints, written the way real ones are laid out on disk.

Contract: ``write_tiny_checkpoint`` writes a HF-style folder (``config.json``,
``model.safetensors`` or shards + ``model.safetensors.index.json``, a
byte-level tokenizer with a chat template, ``generation_config.json``) that
both transformers and metrale load offline. Weights are random but seeded, so
the same arguments always give the same bytes. Norm weights and biases are
random too (not ones/zeros) so a runtime that skips them is caught.

MTP layouts add the keys and config fields public checkpoints use:

- ``"deepseek"``: ``model.layers.{num_layers + i}.{enorm,hnorm,eh_proj,
  shared_head.norm}`` + a decoder block; config ``num_nextn_predict_layers``.
- ``"mimo"``: ``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,
  input_proj,final_layernorm}`` + a decoder block; config ``model_type`` is
  ``"mimo"`` (transformers has no class for it) and ``num_nextn_predict_layers``.
- ``"qwen3_next"``: ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,
  layers.0,norm}``; config ``mtp_num_hidden_layers``. Its norms are
  zero-centred (the weight stored is ``scale - 1``), as in Qwen3-Next.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.runtime.llama import LlamaModel

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MTP_LAYOUTS = ("deepseek", "mimo", "qwen3_next")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# 256 byte tokens + the specials.
TINY_VOCAB = 256 + len(SPECIAL_TOKENS)
EOS_ID = 256
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE without merges: every byte is one token (ids 0..255)."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order ids by byte value.
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(byte_chars)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tiny_config(
    family: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_embeddings: bool,
    max_position_embeddings: int,
    rope_parameters: dict[str, Any] | None,
) -> dict[str, Any]:
    """The config.json of a tiny model of ``family`` as transformers writes it."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    fields: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
    )
    if family == "mistral":
        fields["sliding_window"] = None
    config = AutoConfig.for_model(family, **fields)
    config.architectures = [ARCHITECTURES[family]]
    out: dict[str, Any] = config.to_dict()
    return out


def _decoder_block(prefix: str, family: str, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of one decoder layer of ``family``."""
    hidden = cfg["hidden_size"]
    head_dim = cfg["head_dim"]
    q_out = cfg["num_attention_heads"] * head_dim
    kv_out = cfg["num_key_value_heads"] * head_dim
    inter = cfg["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}input_layernorm.weight": (hidden,),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
        f"{prefix}self_attn.q_proj.weight": (q_out, hidden),
        f"{prefix}self_attn.k_proj.weight": (kv_out, hidden),
        f"{prefix}self_attn.v_proj.weight": (kv_out, hidden),
        f"{prefix}self_attn.o_proj.weight": (hidden, q_out),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
    }
    if family == "qwen2":
        shapes[f"{prefix}self_attn.q_proj.bias"] = (q_out,)
        shapes[f"{prefix}self_attn.k_proj.bias"] = (kv_out,)
        shapes[f"{prefix}self_attn.v_proj.bias"] = (kv_out,)
    if family == "qwen3":
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    return shapes


def _mtp_shapes(
    layout: str, family: str, cfg: dict[str, Any], num_mtp: int
) -> dict[str, tuple[int, ...]]:
    hidden = cfg["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(num_mtp):
        if layout == "deepseek":
            p = f"model.layers.{cfg['num_hidden_layers'] + i}."
            shapes[f"{p}enorm.weight"] = (hidden,)
            shapes[f"{p}hnorm.weight"] = (hidden,)
            shapes[f"{p}eh_proj.weight"] = (hidden, 2 * hidden)
            shapes[f"{p}shared_head.norm.weight"] = (hidden,)
        elif layout == "mimo":
            p = f"model.mtp_layers.{i}."
            shapes[f"{p}token_layernorm.weight"] = (hidden,)
            shapes[f"{p}hidden_layernorm.weight"] = (hidden,)
            shapes[f"{p}input_proj.weight"] = (hidden, 2 * hidden)
            shapes[f"{p}final_layernorm.weight"] = (hidden,)
        elif layout == "qwen3_next":
            assert num_mtp == 1, "Qwen3-Next ships one MTP module"
            p = "mtp.layers.0."
            shapes["mtp.fc.weight"] = (hidden, 2 * hidden)
            shapes["mtp.pre_fc_norm_embedding.weight"] = (hidden,)
            shapes["mtp.pre_fc_norm_hidden.weight"] = (hidden,)
            shapes["mtp.norm.weight"] = (hidden,)
        else:
            raise ValueError(f"unknown MTP layout {layout!r}; expected one of {MTP_LAYOUTS}")
        shapes.update(_decoder_block(p, family, cfg))
    return shapes


def random_weights(
    shapes: dict[str, tuple[int, ...]], *, seed: int, std: float, zero_centred: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Seeded weights: matrices ~ N(0, std), norms ~ 1 + N(0, 0.1), biases ~ N(0, std).

    Norm weights under a prefix in ``zero_centred`` are stored minus one.
    """
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        noise = torch.randn(shape, generator=gen)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
            if name.startswith(zero_centred):
                value = value - 1.0
        else:
            value = std * noise
        out[name] = value.contiguous()
    return out


def write_tiny_checkpoint(
    path: Path,
    family: str = "llama",
    *,
    mtp_layout: str | None = None,
    num_mtp_layers: int = 1,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_embeddings: bool = False,
    max_position_embeddings: int = 512,
    rope_parameters: dict[str, Any] | None = None,
    num_shards: int = 1,
    seed: int = 0,
    std: float = 0.08,
) -> Path:
    """Writes a tiny random checkpoint of ``family`` into ``path`` and returns it."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(
        family,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_embeddings=tie_embeddings,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (TINY_VOCAB, hidden_size),
        "model.norm.weight": (hidden_size,),
    }
    if not tie_embeddings:
        shapes["lm_head.weight"] = (TINY_VOCAB, hidden_size)
    for i in range(num_layers):
        shapes.update(_decoder_block(f"model.layers.{i}.", family, cfg))
    if mtp_layout is not None:
        shapes.update(_mtp_shapes(mtp_layout, family, cfg, num_mtp_layers))
        if mtp_layout == "qwen3_next":
            cfg["mtp_num_hidden_layers"] = num_mtp_layers
        else:
            cfg["num_nextn_predict_layers"] = num_mtp_layers
        if mtp_layout == "mimo":
            cfg["model_type"] = "mimo"
            cfg["architectures"] = ["MiMoForCausalLM"]
    zero_centred = ("mtp.",) if mtp_layout == "qwen3_next" else ()
    weights = random_weights(shapes, seed=seed, std=std, zero_centred=zero_centred)
    _save_weights(path, weights, num_shards)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS_ID, "eos_token_id": [EOS_ID, EOS_ID + 2]})
    )
    write_byte_tokenizer(path)
    return path


def _save_weights(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    names = sorted(weights)
    if num_shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[shard::num_shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_reference_model(path: Path) -> Any:
    """transformers' own model class for a tiny checkpoint, fp32, eval mode.

    A ``mimo`` checkpoint is read as the Qwen2 model it is built on.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type") == "mimo":
        cfg["model_type"] = "qwen2"
        config = AutoConfig.for_model(**cfg)
        model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def build_runtime(
    path: Path,
    num_slots: int = 4,
    max_len: int = 96,
    headroom: int = 0,
    device: str = "cpu",
) -> LlamaModel:
    """metrale's runtime of a checkpoint folder, float32 (on the CPU unless asked)."""
    ckpt = read_checkpoint(path)
    return LlamaModel(
        ckpt.spec,
        ckpt.hf_config,
        ckpt.weights,
        num_slots=num_slots,
        max_len=max_len,
        dtype=torch.float32,
        device=torch.device(device),
        headroom=headroom,
    )


def random_ids(num_seqs: int, length: int, seed: int = 1) -> torch.Tensor:
    """Seeded byte-token ids ``[num_seqs, length]``."""
    return torch.randint(0, 256, (num_seqs, length), generator=torch.Generator().manual_seed(seed))


def reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits ``[num_seqs, length, vocab]`` for ``ids``."""
    with torch.no_grad():
        logits: torch.Tensor = load_reference_model(path)(ids).logits
    return logits
