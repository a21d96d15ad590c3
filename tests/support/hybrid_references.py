"""transformers' own references for the hybrid Qwen checkpoints of
``tests.support.hybrid_checkpoints``: never metrale's code.

Contract: ``reference_logits`` runs the family's model class on a folder;
``ReferenceMtp`` is the MTP module rebuilt from the family's decoder-layer,
RMSNorm and rotary classes and loaded from the ``mtp.*`` keys;
``mtp_logits`` / ``mtp_chain`` feed it as vLLM does; ``next_token_map``
gives the main model's greedy token after each single token.
``CLASSES`` names each family's transformers classes, and
``fuse_experts`` stacks per-expert keys as transformers holds them.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file

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


def text_model(model: Any) -> Any:
    return getattr(model.model, "language_model", model.model)


def main_hiddens(model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The main model's ``logits`` [B, T, vocab] and last hiddens [B, T, hidden]
    of ``ids`` [B, T]: ``normed`` (after the final norm, what ``lm_head``
    reads) and ``raw`` (before it)."""
    seen: dict[str, torch.Tensor] = {}

    def grab(_: Any, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["raw"], seen["normed"] = args[0], out

    hook = text_model(model).norm.register_forward_hook(grab)
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

        family = family_of(path)
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


def family_of(path: Path) -> str:
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
        embeds = text_model(model).embed_tokens(ids[:, 1:])  # [1, T-1, hidden]
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
    embed = text_model(model).embed_tokens
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
