"""Tiny checkpoints of the hybrid Qwen families, with references built from transformers.

Contract: ``write_hybrid_checkpoint(path, family)`` writes a folder laid out
like a released Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint (gated DeltaNet
layers 3 : 1 with gated full attention, one MTP layer under ``mtp.*``) that
transformers loads offline, with the byte tokenizer and generation config of
``tests.support.checkpoints``. Every tensor is drawn from a seeded generator,
so the same arguments always give the same bytes, and no weight sits where a
runtime that skips it would still be right: zero-centred RMSNorm weights
(``x_hat * (1 + w)``) are drawn around 0, the DeltaNet's gated norm around 1,
``A_log`` and ``dt_bias`` so the recurrent state keeps about half of itself
a token (median decay 0.43, 5-95% 0.05-0.86): neither wiped nor frozen.

On disk, as released: the nested families (``qwen3_5_moe``, ``qwen3_5``)
hold ``model.language_model.*``, ``model.visual.*`` and ``lm_head.weight``,
with ``mtp_num_hidden_layers`` in ``text_config``; the text-only ones
(``*_text``, ``qwen3_next``) hold ``model.*`` and ``lm_head.weight`` with a
flat config. All hold the MTP layer at the top level: ``mtp.{fc,
pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.0.*}``. Experts are
per-expert keys (``mlp.experts.{e}.gate_proj.weight`` ...) unless
``expert_layout="fused"`` asks for the stacked ``mlp.experts.gate_up_proj``
[E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] that Qwen3.5-35B-A3B uses
for its main layers and Qwen3.6 for its MTP layer too. A nested family and its
text-only twin written with the same seed hold the same language model and
MTP layer.

The references, transformers' classes, are in
``tests.support.hybrid_references``; block-FP8 twins in
``tests.support.hybrid_fp8``. ``write_exact_mtp_checkpoint`` builds a
checkpoint whose drafts are all accepted under greedy decoding when, and
only when, the MTP layer is wired that way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import EOS_ID, TINY_VOCAB, write_byte_tokenizer
from tests.support.hybrid_references import (
    CLASSES,
    ReferenceMtp,
    fuse_experts,
    text_config,
    text_model,
)

FAMILIES = ("qwen3_5_moe", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
NESTED = ("qwen3_5_moe", "qwen3_5")
ExpertLayout = Literal["per_expert", "fused"]
TEXT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 16,  # unlike the key dim, so a swap is caught
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": EOS_ID,
    "eos_token_id": EOS_ID,
    "mtp_use_dedicated_embeddings": False,
}
MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
ROPE: dict[str, Any] = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,  # head_dim 16 -> rotary dim 4, two frequencies
}
# The releases carry mrope_section [11, 11, 10] over 32 frequencies,
# interleaved T/H/W; [1, 1, 0] splits 2 the same way (frequency 0 is T, 1 is
# H). Text-only positions have T = H = W, so the sections must change nothing.
MROPE: dict[str, Any] = {**ROPE, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
FAMILY_TEXT: dict[str, dict[str, Any]] = {
    "qwen3_5_moe": {**MOE, "rope_parameters": MROPE},
    "qwen3_5_moe_text": {**MOE, "rope_parameters": MROPE},
    "qwen3_5": {"intermediate_size": 96, "rope_parameters": MROPE},
    "qwen3_5_text": {"intermediate_size": 96, "rope_parameters": MROPE},
    "qwen3_next": {
        **MOE,
        "intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        # One dense layer. vLLM builds the MTP layer with layer index 0, so
        # 0 stays out of the list and the MTP layer is MoE, as released.
        "mlp_only_layers": [1],
        "rope_parameters": ROPE,
    },
}
# Just enough of a vision tower to instantiate; text-only forwards never run it.
VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
}
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# What each token mixer and MLP adds to the residual stream through.
OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", STACKED[1])


# ---------------------------------------------------------------- writing


def hybrid_config(family: str, *, mtp_layers: int = 1, **text_overrides: Any) -> Any:
    """transformers' config of ``family`` with the tiny shapes above.

    ``text_overrides`` go to the language model's fields; ``layer_types``
    follows ``num_hidden_layers`` (every fourth layer full) unless given.
    """
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    text = {**TEXT, **FAMILY_TEXT[family], "mtp_num_hidden_layers": mtp_layers, **text_overrides}
    if "layer_types" not in text_overrides:
        text["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
            for i in range(text["num_hidden_layers"])
        ]
    config_class = getattr(transformers, CLASSES[family][3])
    if family not in NESTED:
        return config_class(**text)
    vision = {**VISION, "out_hidden_size": text["hidden_size"]}
    # image/video token ids keep their released values, outside the tiny
    # vocab, so no text token is ever taken for an image placeholder.
    return config_class(text_config=text, vision_config=vision, tie_word_embeddings=False)


def write_hybrid_checkpoint(
    path: Path,
    family: str,
    *,
    mtp_layers: int = 1,
    seed: int = 0,
    expert_layout: ExpertLayout = "per_expert",
    **text_overrides: Any,
) -> Path:
    """Writes a tiny random checkpoint of ``family`` into ``path`` and returns it."""
    model, mtp = _build(family, mtp_layers, seed, text_overrides)
    return _save(path, model, mtp, expert_layout)


def write_exact_mtp_checkpoint(
    path: Path, family: str, *, seed: int = 0, expert_layout: ExpertLayout = "per_expert"
) -> Path:
    """A checkpoint whose MTP drafts are right by construction, if wired as vLLM does.

    Main model: every layer's output projection (``o_proj``, ``out_proj``,
    dense, shared and expert ``down_proj``) is zero, so the residual stream
    is the token's embedding and the next token is ``perm(t)`` of the
    current one (``exact_perm``: one cycle through the 256 byte tokens, the
    specials fixed; greedy decoding never emits EOS, and no wrong draft
    matches through a short cycle). Hidden 64 is two 32-dim halves; with
    unit codes ``a(t)``, ``embed(t) = [a(t) ; a(perm^-1(t))]``, and
    ``lm_head`` row ``s`` is ``embed(perm^-1(s))`` (unit length, times the
    final norm's ``g`` below): decoding ``x`` picks ``perm(u)`` for the
    ``u`` whose embedding ``x`` points at (every logit margin >= 3.9, in
    bfloat16 too).

    MTP row ``p`` gets token ``t_{p+1}`` and the main hidden at ``p``, which
    encodes ``t_p``. ``fc`` builds ``x = [e_1 ; 2 h_1 - 1.5 e_2]`` from the
    halves ``e_1, e_2`` of the embedding and ``h_1`` of the hidden; along
    the model's own output (``t_p = perm^-1(t_{p+1})``) that is
    ``[a(t_{p+1}) ; 0.5 a(t_p)]``, pointing at ``t_{p+1}``, so the draft is
    ``perm(t_{p+1})``: the main model's next-next token. The decoder layer
    passes ``x`` through (its ``o_proj`` and ``down`` are zero). Miswirings:

    - fc halves swapped, or the hidden of the next position: the hidden's
      ``2 h_1`` points elsewhere and outweighs ``e_1``;
    - no hidden: the ``-1.5 e_2`` term wins;
    - the final norm's weight is a random +-1 sign pattern ``g`` (stored
      ``g - 1``), which ``fc`` undoes, and ``mtp.norm`` carries the same
      ``g``: a pre-norm hidden (of the main model, or of the MTP layer when
      chaining drafts) reaches ``fc`` scrambled;
    - zero-centred norms read as plain scales give zeros; the embedding used
      as the head decodes ``t_{p+1}`` itself.

    Prompt rows that do not follow ``perm`` are not drafted right (their
    hidden does not encode ``perm^-1`` of the token); every draft after the
    prompt is. The pre-fc norms are zero (scale 1); attention, DeltaNet and
    MLP inputs stay random but contribute nothing, so this checkpoint proves
    MTP wiring, not numerics: compare logits with ``mtp_logits`` on a
    ``write_hybrid_checkpoint`` folder for that.
    """
    model, mtp = _build(family, 1, seed, {})
    assert mtp is not None
    _make_exact(model, mtp, seed)
    return _save(path, model, mtp, expert_layout)


def exact_perm(vocab: int, seed: int = 0) -> torch.Tensor:
    """The next-token map of ``write_exact_mtp_checkpoint(seed=seed)`` [vocab]:
    ``perm[t]`` follows ``t``; one cycle through bytes 0..255, specials fixed."""
    order = torch.randperm(256, generator=torch.Generator().manual_seed(seed + 2))
    perm = torch.arange(vocab)
    perm[order] = torch.roll(order, -1)
    return perm


def _build(
    family: str, mtp_layers: int, seed: int, text_overrides: dict[str, Any]
) -> tuple[Any, ReferenceMtp | None]:
    import transformers

    config = hybrid_config(family, mtp_layers=mtp_layers, **text_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family][2])(config).float().eval()
    redraw(model, torch.Generator().manual_seed(seed))
    if mtp_layers == 0:
        return model, None
    # A generator of its own, so a nested family and its text-only twin hold
    # the same MTP layer (the vision tower draws from the model's).
    mtp = ReferenceMtp(family, text_config(model.config), mtp_layers)
    redraw(mtp, torch.Generator().manual_seed(seed + 1))
    return model, mtp


def redraw(module: torch.nn.Module, gen: torch.Generator, std: float = 0.1) -> None:
    """Every parameter of ``module``, in name order, drawn anew from ``gen`` by kind."""
    with torch.no_grad():
        for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
            param.copy_(_draw(name, tuple(param.shape), gen, std))


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        # decay exp(-A * softplus(a + dt_bias)): with dt_bias ~ -1, about 0.5
        return torch.empty(shape).uniform_(0.5, 4.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return -1.0 + 0.5 * noise
    if "visual." in name:  # LayerNorms with biases
        return 1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else std * noise
    if "linear_attn.norm." in name:  # the gated norm scales by w itself
        return 1.0 + 0.1 * noise
    if "norm" in name:  # zero-centred: x_hat * (1 + w)
        return 0.1 * noise
    if "embed_tokens" in name:
        return noise
    if "conv1d" in name:
        return 0.3 * noise
    return std * noise  # matrices, stacked experts, routers: activations O(1)


def _make_exact(model: Any, mtp: ReferenceMtp, seed: int) -> None:
    """The weights ``write_exact_mtp_checkpoint`` describes, in place."""
    gen = torch.Generator().manual_seed(seed + 1)
    text = text_model(model)
    vocab, hidden = text.embed_tokens.weight.shape
    half = hidden // 2
    inverse = torch.argsort(exact_perm(vocab, seed))  # [vocab]
    codes = torch.nn.functional.normalize(torch.randn(vocab, half, generator=gen), dim=-1)
    embed = torch.cat([codes, codes[inverse]], dim=-1)  # [vocab, hidden]
    signs = torch.where(torch.rand(hidden, generator=gen) < 0.5, -1.0, 1.0)  # [hidden]
    eye = torch.eye(half)
    fc = torch.zeros(hidden, 2 * hidden)  # [hidden, embedding | hidden]
    fc[:half, :half] = eye  # e_1
    fc[half:, half:hidden] = -1.5 * eye  # -1.5 e_2
    fc[half:, hidden : hidden + half] = 2.0 * torch.diag(signs[:half])  # 2 h_1, g undone
    with torch.no_grad():
        for module in (model, mtp):
            for name, param in module.named_parameters():
                if name.endswith(OUTPUT_PROJECTIONS):
                    param.zero_()
        text.embed_tokens.weight.copy_(embed)
        text.norm.weight.copy_(signs - 1.0)
        head = embed[inverse] * signs / embed.norm(dim=-1, keepdim=True)  # [vocab, hidden]
        model.lm_head.weight.copy_(head)
        mtp.fc.weight.copy_(fc)
        mtp.pre_fc_norm_embedding.weight.zero_()
        mtp.pre_fc_norm_hidden.weight.zero_()
        mtp.norm.weight.copy_(signs - 1.0)


def _save(path: Path, model: Any, mtp: ReferenceMtp | None, expert_layout: ExpertLayout) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))  # per-expert keys, visual tower, configs
    weights = load_file(str(path / "model.safetensors"))
    if mtp is not None:
        weights.update({f"mtp.{n}": t for n, t in public_tensors(mtp.state_dict()).items()})
    if expert_layout == "fused":
        weights = fuse_experts(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS_ID, "eos_token_id": [EOS_ID, EOS_ID + 2]})
    )
    write_byte_tokenizer(path)
    return path


def public_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts split into the public per-expert keys.

    ``experts.gate_up_proj`` [E, 2I, H] holds gate in its first I rows and
    ``experts.down_proj`` is [E, H, I]; other tensors pass unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(STACKED[0]):
            at, size = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e, both in enumerate(tensor):
                out[f"{at}{e}.gate_proj.weight"] = both[:size].clone()  # [I, H]
                out[f"{at}{e}.up_proj.weight"] = both[size:].clone()  # [I, H]
        elif name.endswith(STACKED[1]):
            at = name.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                out[f"{at}{e}.down_proj.weight"] = down.clone()  # [H, I]
        else:
            out[name] = tensor.clone()
    return out
