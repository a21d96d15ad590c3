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

The references are transformers' classes, never metrale's:
``reference_logits`` runs the family's model class; ``ReferenceMtp`` is the
MTP module rebuilt from the family's decoder-layer, RMSNorm and rotary
classes and loaded from the ``mtp.*`` keys; ``mtp_logits`` / ``mtp_chain``
feed it as vLLM does. ``write_exact_mtp_checkpoint`` builds a checkpoint whose
drafts are all accepted under greedy decoding when, and only when, the MTP
layer is wired that way; ``write_fp8_twin`` quantizes a folder to block FP8
beside its dequantized float32 twin.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
from math import ceil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from tests.support.checkpoints import EOS_ID, TINY_VOCAB, write_byte_tokenizer

FAMILIES = ("qwen3_5_moe", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next")
NESTED = ("qwen3_5_moe", "qwen3_5")
ExpertLayout = Literal["per_expert", "fused"]
# Which hidden is fed to the MTP layer: after the final norm (what vLLM and
# SGLang feed), or before it.
HiddenSource = Literal["normed", "raw"]

# family -> (transformers module, class prefix, model class, config class, rotary class)
CLASSES: dict[str, tuple[str, str, str, str, str]] = {
    "qwen3_5_moe": (
        "qwen3_5_moe",
        "Qwen3_5Moe",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeConfig",
        "Qwen3_5MoeTextRotaryEmbedding",
    ),
    "qwen3_5": (
        "qwen3_5",
        "Qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5Config",
        "Qwen3_5TextRotaryEmbedding",
    ),
    "qwen3_5_moe_text": (
        "qwen3_5_moe",
        "Qwen3_5Moe",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeTextRotaryEmbedding",
    ),
    "qwen3_5_text": (
        "qwen3_5",
        "Qwen3_5",
        "Qwen3_5ForCausalLM",
        "Qwen3_5TextConfig",
        "Qwen3_5TextRotaryEmbedding",
    ),
    "qwen3_next": (
        "qwen3_next",
        "Qwen3Next",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        "Qwen3NextRotaryEmbedding",
    ),
}
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
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Matrices the Qwen FP8 releases keep in bf16 (the vision tower too).
FP8_PLAIN = re.compile(
    r"(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba"
    r"|conv1d|mtp\.fc)\.weight$"
)
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
    text = _text_model(model)
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


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert keys stacked into ``experts.gate_up_proj`` / ``experts.down_proj``
    (the inverse of ``public_tensors``); other tensors pass unchanged."""
    expert = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in weights.items():
        if (m := expert.match(name)) is None:
            out[name] = tensor
        else:
            groups.setdefault(m[1], {})[(int(m[2]), m[3])] = tensor
    for at, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        out[at + "gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts]
        )  # [E, 2I, H]
        out[at + "down_proj"] = torch.stack([parts[(e, "down")] for e in experts])  # [E, H, I]
    return out


# ------------------------------------------------------------- references


def load_reference(path: Path) -> Any:
    """transformers' model of the folder (its ``architectures`` class: the
    ForConditionalGeneration one for the nested families), float32, eval."""
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits [B, T, vocab] of the text-only forward of ``ids`` [B, T]."""
    with torch.no_grad():
        logits: torch.Tensor = load_reference(path)(input_ids=ids).logits.float()
    return logits


def text_config(config: Any) -> Any:
    """The language model's config: ``text_config`` of the nested families, else itself."""
    return getattr(config, "text_config", config)


def _text_model(model: Any) -> Any:
    return getattr(model.model, "language_model", model.model)


def main_hiddens(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The main model's ``logits`` [B, T, vocab] and last hiddens [B, T, hidden]
    of ``ids`` [B, T]: ``normed`` (after the final norm, what ``lm_head``
    reads) and ``raw`` (before it)."""
    seen: dict[str, torch.Tensor] = {}

    def grab(_: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["raw"], seen["normed"] = args[0], out

    hook = _text_model(model).norm.register_forward_hook(grab)
    try:
        with torch.no_grad():
            seen["logits"] = model(input_ids=ids).logits.float()
    finally:
        hook.remove()
    return seen


class ReferenceMtp(torch.nn.Module):
    """The MTP module of a hybrid Qwen checkpoint, in transformers' own layer classes.

    For a row's token embedding ``e`` and hidden ``h``:
    ``x = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])`` (the
    embedding half first, as released), then ``layers[0]``: a FULL-attention
    decoder layer of the family (gated attention, and the family's MLP: MoE
    with a shared expert, or dense) attending causally over the rows given at
    rotary ``positions``, then ``norm``. The norms are the family's
    zero-centred RMSNorm. Parameter names are the ``mtp.*`` keys less the
    prefix (experts stacked, as transformers holds them). The embedding and
    head are the main model's (``mtp_use_dedicated_embeddings`` is false).
    """

    def __init__(self, family: str, config: Any, num_layers: int) -> None:
        super().__init__()
        module_name, prefix, *_, rotary_name = CLASSES[family]
        classes = importlib.import_module(
            f"transformers.models.{module_name}.modeling_{module_name}"
        )
        config = copy.deepcopy(config)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        if hasattr(config, "mlp_only_layers"):
            config.mlp_only_layers = []
        config._attn_implementation = "eager"  # honours the explicit mask below
        config._experts_implementation = "eager"
        norm = getattr(classes, f"{prefix}RMSNorm")
        layer = getattr(classes, f"{prefix}DecoderLayer")
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=eps)
        self.layers = torch.nn.ModuleList(layer(config, i) for i in range(num_layers))
        self.norm = norm(hidden, eps=eps)
        self.rotary_emb = getattr(classes, rotary_name)(config)

    @classmethod
    def from_checkpoint(cls, path: Path) -> ReferenceMtp:
        """The folder's ``mtp.*`` tensors in transformers' classes (a strict load)."""
        import transformers

        family = _family_of(path)
        config = text_config(transformers.AutoConfig.from_pretrained(str(path)))
        weights = load_file(str(path / "model.safetensors"))
        own = {n.removeprefix("mtp."): t for n, t in weights.items() if n.startswith("mtp.")}
        mtp = cls(family, config, config.mtp_num_hidden_layers)
        mtp.load_state_dict(fuse_experts(own), strict=True)
        return mtp.float().eval()

    def forward(
        self, embeds: torch.Tensor, hiddens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``embeds``, ``hiddens`` [B, R, hidden], ``positions`` [R] -> the
        output of ``layers[0]`` [B, R, hidden] before ``norm``, and after."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hiddens)], -1)
        out = self.decode(self.fc(x), positions)  # [B, R, hidden]
        return out, self.norm(out)

    def decode(self, x: torch.Tensor, positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """``layers[layer]`` over ``x`` [B, R, hidden], causal, at rotary ``positions`` [R]."""
        rows = x.shape[1]
        mask = torch.full((rows, rows), torch.finfo(x.dtype).min).triu(1)[None, None]  # [1,1,R,R]
        position_ids = positions[None]  # [1, R]; mRoPE repeats it for T, H and W
        out = self.layers[layer](
            x,
            position_embeddings=self.rotary_emb(x, position_ids),
            attention_mask=mask,
            position_ids=position_ids,
        )
        return out[0] if isinstance(out, tuple) else out


def _family_of(path: Path) -> str:
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return next(family for family, names in CLASSES.items() if names[2] == arch)


def load_reference_mtp(path: Path) -> ReferenceMtp:
    return ReferenceMtp.from_checkpoint(path)


def mtp_logits(
    model: Any, mtp: ReferenceMtp, ids: torch.Tensor, hidden_source: HiddenSource = "normed"
) -> torch.Tensor:
    """The MTP layer's logits [T - 1, vocab] over a prompt ``ids`` [T] or [1, T].

    Row ``p`` (0..T-2) feeds token ``ids[p + 1]`` and the main model's last
    hidden at ``p`` (``hidden_source``), at rotary position ``p``, attending
    to rows 0..p (MTP cache row ``p`` holds position ``p``), then
    ``mtp.norm`` and the main ``lm_head``. Its argmax guesses ``ids[p + 2]``.
    """
    ids = ids.reshape(1, -1)  # [1, T]
    with torch.no_grad():
        hiddens = main_hiddens(model, ids)[hidden_source][:, :-1]  # [1, T-1, hidden]
        embeds = _text_model(model).embed_tokens(ids[:, 1:])  # [1, T-1, hidden]
        _, normed = mtp(embeds, hiddens, torch.arange(ids.shape[1] - 1))
        logits: torch.Tensor = model.lm_head(normed)[0].float()  # [T-1, vocab]
    return logits


def mtp_chain(
    model: Any,
    mtp: ReferenceMtp,
    ids: torch.Tensor,
    depth: int,
    hidden_source: HiddenSource = "normed",
    chain_hidden: HiddenSource = "normed",
) -> list[int]:
    """Greedy MTP drafts ``[d_1 .. d_depth]`` after a prompt ``ids`` [T] or [1, T].

    Given the prompt ``t_0 .. t_{T-1}``, the main model's greedy next token
    is ``t_T``. The MTP rows are those of ``mtp_logits`` (row ``p``: token
    ``t_{p+1}``, main hidden ``p``) and then row ``T - 1``: ``t_T`` with main
    hidden ``T - 1``; its argmax is ``d_1``, the guess for ``t_{T+1}``.
    Draft ``k > 1`` comes from row ``T + k - 2``: token ``d_{k-1}`` with the
    MTP layer's own output at the row before, at rotary position
    ``T + k - 2``, attending to every earlier MTP row; it guesses ``t_{T+k}``.

    The fed-back output is ``chain_hidden``: ``normed`` (after ``mtp.norm``,
    the default) is what vLLM feeds. ``Qwen3NextMultiTokenPredictor.forward``
    and ``Qwen3_5MultiTokenPredictor.forward`` end with ``hidden_states, _ =
    self.norm(hidden_states, residual)`` and return it; ``compute_logits``
    applies ``lm_head`` to it without another norm; and the proposer
    (``v1/spec_decode``, ``propose``) takes ``last_hidden_states =
    hidden_states = ret_hidden_states`` for single-output models and copies
    ``hidden_states`` into the next step's input. SGLang's
    ``Qwen3NextForCausalLMMTP`` runs the layer and ``mtp.norm`` as a one-layer
    ``Qwen3NextModel`` and feeds back that same normed output. ``raw`` (before
    ``mtp.norm``) shows what the other choice drafts. Both feed the main
    model's normed hidden first. One MTP layer only (every release has one).
    """
    if len(mtp.layers) != 1:
        raise ValueError(f"the chain reference runs one MTP layer, not {len(mtp.layers)}")
    ids = ids.reshape(1, -1)  # [1, T]
    embed = _text_model(model).embed_tokens
    drafts: list[int] = []
    with torch.no_grad():
        main = main_hiddens(model, ids)
        tokens = [*ids[0, 1:].tolist(), int(main["logits"][0, -1].argmax())]
        hiddens = main[hidden_source]  # [1, T, hidden], one a row
        for _ in range(depth):
            raw, normed = mtp(embed(torch.tensor([tokens])), hiddens, torch.arange(len(tokens)))
            drafts.append(int(model.lm_head(normed[0, -1]).argmax()))
            fed = (normed if chain_hidden == "normed" else raw)[:, -1:]  # [1, 1, hidden]
            tokens.append(drafts[-1])
            hiddens = torch.cat([hiddens, fed], dim=1)
    return drafts


def reference_mtp_logits(
    path: Path, ids: torch.Tensor, hidden_source: HiddenSource = "normed"
) -> torch.Tensor:
    """``mtp_logits`` [T - 1, vocab] of the folder's model and ``mtp.*`` layer."""
    return mtp_logits(load_reference(path), load_reference_mtp(path), ids, hidden_source)


def reference_mtp_chain(
    path: Path, ids: torch.Tensor, depth: int, chain_hidden: HiddenSource = "normed"
) -> list[int]:
    """``mtp_chain`` of the folder: the drafts vLLM would propose after ``ids``."""
    model, mtp = load_reference(path), load_reference_mtp(path)
    return mtp_chain(model, mtp, ids, depth, chain_hidden=chain_hidden)


def next_token_map(path: Path) -> dict[int, int]:
    """The main model's greedy token after each single token, ``{t: next}``
    (for ``write_exact_mtp_checkpoint``, ``exact_perm``)."""
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    logits = reference_logits(path, torch.arange(vocab)[:, None])  # [vocab, 1, vocab]
    return {t: int(after) for t, after in enumerate(logits[:, 0].argmax(-1))}


# ------------------------------------------------------------------- FP8


def write_fp8_twin(src: Path, dst: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """``src`` quantized to block FP8 into ``dst``; its dequantized twin beside it.

    Every matrix of the language model and MTP layer becomes
    ``float8_e4m3fn`` beside ``{name}_scale_inv`` [ceil(out/b0),
    ceil(in/b1)] (per block ``scale = amax / 448``, ``q = w / scale``);
    stacked experts [E, out, in] get scales [E, ...]. Kept in float and
    listed in ``modules_to_not_convert`` (module names, as the releases list
    them): embeddings, ``lm_head``, routers (``mlp.gate``),
    ``shared_expert_gate``, the DeltaNet's ``in_proj_a`` / ``in_proj_b``
    (``in_proj_ba``) and ``conv1d``, ``mtp.fc`` and ``model.visual``.
    ``quantization_config`` goes at the top of ``config.json``. The twin, at
    ``dequantized_twin(dst)``, holds ``q.float() * scale`` in float32 and no
    ``quantization_config``: a runtime must run the two as the same model.
    """
    twin_path = dequantized_twin(dst)
    for folder in (dst, twin_path):
        shutil.copytree(src, folder)
    stored: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    plain: set[str] = set()
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.visual."):
            plain.add("model.visual")
            stored[name] = twin[name] = w
        elif w.dim() < 2:
            stored[name] = twin[name] = w
        elif FP8_PLAIN.search(name):
            plain.add(name.removesuffix(".weight"))
            stored[name] = twin[name] = w
        else:
            q, scale = quantize_fp8(w, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_fp8(q, scale, block)
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": sorted(plain),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def dequantized_twin(fp8_path: Path) -> Path:
    """Where ``write_fp8_twin`` puts the float32 twin of ``fp8_path``."""
    return fp8_path.with_name(fp8_path.name + "-dequantized")


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] -> ``q`` float8_e4m3fn [..., out, in] and ``scale``
    [..., ceil(out/b0), ceil(in/b1)]. An all-zero block gets a tiny scale, not
    0, so its ``q`` is 0, not NaN."""
    b0, b1 = block
    *lead, rows, cols = w.shape
    grid = (ceil(rows / b0), ceil(cols / b1))
    padded = torch.nn.functional.pad(w.float(), (0, grid[1] * b1 - cols, 0, grid[0] * b0 - rows))
    tiles = padded.reshape(*lead, grid[0], b0, grid[1], b1)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(1e-12)  # [..., *grid]
    q = (w.float() / _per_element(scale, block, (rows, cols))).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * scale`` of each element's block: float32 [..., out, in]."""
    return q.float() * _per_element(scale, block, tuple(q.shape[-2:]))


def _per_element(
    scale: torch.Tensor, block: tuple[int, int], size: tuple[int, ...]
) -> torch.Tensor:
    """``scale`` [..., R, C] spread over its blocks: [..., rows, cols]."""
    rows, cols = size
    spread = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return spread.repeat_interleave(block[1], dim=-1)[..., :cols]
