"""MTP modules: detection in a checkpoint, and the forward every layout shares.

Contract: one MTP module at position ``p`` takes the main model's pre-norm
hidden state ``h_p`` and the id of token ``p+1`` and predicts token ``p+2``:

    x      = proj(cat[norm_e(embed(t_{p+1})), norm_h(h_p)])   # DeepSeek, Qwen3-Next
    x      = proj(cat[norm_h(h_p), norm_e(embed(t_{p+1}))])   # MiMo: the reverse order
    y      = decoder_block(x)        # the main model's block type, own KV cache
    logits = lm_head(final_norm(y))  # embedding and LM head shared with the model

A standalone head may name a draft vocabulary: its LM head then computes only
those rows (the shipped head keeps 8,192 of the default model's 49,152, and
the LM head is most of a small head's forward) and every other token gets
logit -inf, so it is never drafted and has probability 0 in sampled drafts.
Verification is unchanged, so output stays exactly the model's.

``y`` (pre-norm) is returned as the module's hidden state, so feeding it back
with the module's own draft gives a chain. The block writes its own slot KV
cache at positions ``p``, so the cache must hold every accepted position.

Several modules (``num_nextn_predict_layers > 1``) are stacked, as
transformers' ``MtpModel`` runs them: module ``k`` (its depth) at source row
``p`` takes module ``k-1``'s output at row ``p`` and token ``p+1+k`` and
predicts token ``p+2+k``. At ``k > 0`` the hidden it reads first goes through
module ``k-1``'s final norm (``input_norm``): transformers' layer hands on its
post-norm output, which is also what its LM head reads. Its segments address
rows: cache position ``p`` holds row ``p``, so every position from 0 is
written. transformers rotates row ``p`` at position ``p+k``; rotating it at
``p`` gives the same attention scores, since a rotary embedding enters them
only through the difference of two positions (every supported scaling keeps
the frequencies fixed), and the module keeps the model's own table.

Layouts (key prefixes and the config fields that announce them):
- ``deepseek`` (DeepSeek-V3/R1, GLM-4.5): ``model.layers.{num_hidden_layers + i}.``
  ``enorm, hnorm, eh_proj, shared_head.norm`` (+ optional ``shared_head.head``);
  ``num_nextn_predict_layers``.
- ``mimo`` (Xiaomi MiMo): ``model.mtp_layers.{i}.token_layernorm,
  hidden_layernorm, input_proj, final_layernorm``; ``num_nextn_predict_layers``.
- ``qwen3_next`` (Qwen3-Next, Qwen3.5/3.6): ``mtp.fc, mtp.pre_fc_norm_embedding,
  mtp.pre_fc_norm_hidden, mtp.layers.{i}, mtp.norm``; every norm zero-centred
  (scale = weight + 1); ``mtp_num_hidden_layers`` / ``num_nextn_predict_layers``
  layers share the fc and norms, module ``i`` running ``layers.{i}`` (a
  gated full-attention layer, never a linear one). These families feed the
  *final-normed* hidden state (``ArchSpec.hidden_normed``: the main model
  returns it so) and hand on ``norm(y)`` rather than ``y``, as vLLM runs them
  and as their MTP layers were trained; their logits are ``lm_head`` of that.
- ``head``: a standalone head file (``mtp_head.py``), DeepSeek's structure.
A module's block is the main model's block type, MoE included (``load_block``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from metrale.engine.runtime.block import BlockWeights, load_block, make_cache
from metrale.engine.runtime.kv_cache import plan_rows
from metrale.engine.runtime.llama import DecoderStack, LlamaModel
from metrale.engine.runtime.model import ForwardOutput, MtpLogitRows, Segment
from metrale.engine.runtime.ops import Weight, linear, rms_norm
from metrale.engine.runtime.packed import PackedSource, PackedWeight
from metrale.engine.runtime.static_step import static_plan
from metrale.engine.runtime.weights import WeightStore

LAYOUTS = ("deepseek", "mimo", "qwen3_next", "head")
_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")


@dataclass(frozen=True)
class MtpFound:
    """What a checkpoint ships: ``layout`` and how many modules."""

    layout: str
    count: int


def detect_mtp(
    raw_config: dict[str, Any], names: Sequence[str], num_layers: int
) -> MtpFound | None:
    """Finds MTP weights by their key names; the config's count field, when
    present, bounds how many modules are taken. ``None`` when no weights exist
    (many conversions strip them even when the config still announces them)."""
    declared = next((int(raw_config[f]) for f in _COUNT_FIELDS if raw_config.get(f)), None)
    keys = set(names)

    def count(prefix_of: Any, probe: str) -> int:
        n = 0
        while f"{prefix_of(n)}{probe}" in keys:
            n += 1
        return n if declared is None else min(n, declared)

    found = [
        ("deepseek", count(lambda i: f"model.layers.{num_layers + i}.", "eh_proj.weight")),
        ("mimo", count(lambda i: f"model.mtp_layers.{i}.", "input_proj.weight")),
        (
            "qwen3_next",
            count(lambda i: f"mtp.layers.{i}.", "input_layernorm.weight")
            if "mtp.fc.weight" in keys
            else 0,
        ),
    ]
    for layout, n in found:
        if n > 0:
            return MtpFound(layout, n)
    return None


@dataclass
class MtpWeights:
    """The parts around the block; ``lm_head`` is the main model's unless the
    checkpoint ships its own (DeepSeek's ``shared_head.head``)."""

    token_norm: torch.Tensor  # [hidden]
    hidden_norm: torch.Tensor  # [hidden]
    proj: Weight  # [hidden, 2 * hidden]
    final_norm: torch.Tensor  # [hidden]
    hidden_first: bool  # MiMo concatenates [hidden, embedding]
    block: BlockWeights
    lm_head: Weight | None = None  # [vocab, hidden]
    # Sorted token ids the head drafts from: its LM head computes only these
    # rows (a standalone head's `draft_vocab`); None: the whole vocabulary.
    draft_vocab: torch.Tensor | None = None
    # [hidden] at depth k > 0: module k-1's final norm, applied to the hidden
    # it hands on (see module doc); None at depth 0.
    input_norm: torch.Tensor | None = None


class MtpLayer:
    """``MtpModule`` over one set of ``MtpWeights`` (see module doc)."""

    def __init__(self, model: LlamaModel, weights: MtpWeights) -> None:
        spec = model.spec
        self.model = model
        self.weights = weights
        positions = model.max_len + model.headroom
        cache = make_cache(spec, 1, model.num_slots, positions, model.dtype, model.device)
        self.stack = DecoderStack(spec, [weights.block], cache)
        lm_head = weights.lm_head if weights.lm_head is not None else model.head.lm_head
        self.draft_vocab = weights.draft_vocab
        if self.draft_vocab is not None:
            index = self.draft_vocab.to(model.device)
            if isinstance(lm_head, PackedWeight):  # tied or not, its rows are kept
                rows: Weight = lm_head.rows(index)
            else:
                rows = lm_head[index]
            lm_head, self.draft_vocab = rows, index
        self.lm_head: Weight = lm_head

    @property
    def num_slots(self) -> int:
        return self.model.num_slots

    @property
    def max_len(self) -> int:
        return self.model.max_len

    @property
    def kv_bytes_per_token(self) -> int:
        return self.stack.cache.bytes_per_token

    @property
    def copies_prefixes(self) -> bool:
        return True

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Rows ``0..length-1`` of slot ``source``'s cache into ``slot``."""
        self.stack.cache.copy_prefix(source, slot, length)

    @torch.inference_mode()
    def forward(
        self,
        segments: Sequence[Segment],
        hidden: torch.Tensor,  # [num_tokens, hidden_size], rows in segment order
        logits: MtpLogitRows = "all",
    ) -> ForwardOutput:
        model = self.model
        plan = plan_rows(
            segments, model.num_slots, model.max_len, model.device, model.spec.sliding_window
        )
        assert hidden.shape[0] == plan.num_tokens, "one hidden row per segment token"
        y = self._handed_on(self.stack.run(self._input(plan.token_ids, hidden), plan, model.rope))
        if isinstance(logits, torch.Tensor):
            rows = y.index_select(0, logits.to(y.device))
        else:
            rows = y if logits == "all" else y.index_select(0, plan.last_rows)
        return ForwardOutput(logits=self._logits(rows), hidden=y)

    def prepare_static(self) -> bool:
        """``DecoderStack.prepare_static`` for the module's block."""
        return self.stack.prepare_static(self.model.device, self.model.dtype)

    @torch.inference_mode()
    def forward_static(
        self,
        tokens: torch.Tensor,  # [B, W] int64 on the device: the token after each row
        hidden: torch.Tensor,  # [B * W, hidden_size], slot-major
        starts: torch.Tensor,  # [B] int64 on the device
        ctx: int,
        rows: torch.Tensor,  # [B] int64: the one row of each slot to take logits of
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` at the device step's static shape (``static_step.py``):
        ``(logits [B, vocab] float32 of each slot's row in rows, hidden [B * W,
        hidden])``, no host read. Only the row a draft comes from pays for the
        LM head."""
        model = self.model
        batch, width = tokens.shape
        plan = static_plan(starts, width, ctx, model.spec.sliding_window)
        y = self.stack.torch_ops().run(self._input(tokens.reshape(-1), hidden), plan, model.rope)
        y = self._handed_on(y)
        picked = y.view(batch, width, -1)[torch.arange(batch, device=y.device), rows]
        return self._logits(picked), y

    def _input(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input rows: ``proj`` of the normed embedding and hidden."""
        model, w, eps = self.model, self.weights, self.model.spec.rms_norm_eps
        emb = rms_norm(model.head.embed(token_ids), w.token_norm, eps)
        hidden = hidden.to(model.dtype)
        if w.input_norm is not None:
            hidden = rms_norm(hidden, w.input_norm, eps)
        hid = rms_norm(hidden, w.hidden_norm, eps)
        both = torch.cat(
            [hid, emb] if w.hidden_first else [emb, hid], dim=-1
        )  # [num_tokens, 2 * hidden]
        return linear(both, w.proj)

    def _handed_on(self, y: torch.Tensor) -> torch.Tensor:
        """The hidden rows the module returns: ``y``, or ``norm(y)`` for the
        families that feed normed states (module doc)."""
        if not self.model.spec.hidden_normed:
            return y
        return rms_norm(y, self.weights.final_norm, self.model.spec.rms_norm_eps)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        w, eps = self.weights, self.model.spec.rms_norm_eps
        if not self.model.spec.hidden_normed:
            rows = rms_norm(rows, w.final_norm, eps)
        out = linear(rows, self.lm_head).float()
        if self.draft_vocab is not None:  # tokens outside it are never drafted
            full = out.new_full((out.shape[0], self.model.vocab_size), float("-inf"))
            out = full.index_copy_(1, self.draft_vocab, out)
        return out


def load_checkpoint_mtp(
    model: LlamaModel, store: WeightStore, found: MtpFound, packed: PackedSource | None = None
) -> list[MtpLayer]:
    """Builds the modules a checkpoint ships in one of the public layouts, in
    stack order; linear weights ``packed`` has are taken from it."""
    weights = [_read_layout(model, store, found.layout, i, packed) for i in range(found.count)]
    if not model.spec.hidden_normed:  # a normed family hands on normed rows already
        for before, after in itertools.pairwise(weights):
            after.input_norm = before.final_norm
    return [MtpLayer(model, w) for w in weights]


def _read_layout(
    model: LlamaModel, store: WeightStore, layout: str, index: int, packed: PackedSource | None
) -> MtpWeights:
    spec, dtype, device = model.spec, model.dtype, model.device
    offset = 1.0 if layout == "qwen3_next" else 0.0

    def get(name: str, norm: bool = False) -> torch.Tensor:
        value = store.get(name).float()
        return (value + offset if norm else value).to(device=device, dtype=dtype)

    if layout == "deepseek":
        p = f"model.layers.{spec.num_layers + index}."
        names = ("enorm", "hnorm", "eh_proj", "shared_head.norm", False)
    elif layout == "mimo":
        p = f"model.mtp_layers.{index}."
        names = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", True)
    elif layout == "qwen3_next":
        p = "mtp."
        names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", False)
    else:
        raise ValueError(f"unknown MTP layout {layout!r}; expected one of {LAYOUTS}")
    token_norm, hidden_norm, proj, final_norm, hidden_first = names
    block_prefix = f"mtp.layers.{index}." if layout == "qwen3_next" else p
    own_head = f"{p}shared_head.head.weight"

    def linear_weight(name: str) -> Weight:
        return (packed.get(name) if packed else None) or get(name)

    return MtpWeights(
        token_norm=get(f"{p}{token_norm}.weight", norm=True),
        hidden_norm=get(f"{p}{hidden_norm}.weight", norm=True),
        proj=linear_weight(f"{p}{proj}.weight"),
        final_norm=get(f"{p}{final_norm}.weight", norm=True),
        hidden_first=bool(hidden_first),
        block=load_block(
            store, block_prefix, spec, dtype, device, norm_offset=offset, packed=packed
        ),
        lm_head=linear_weight(own_head) if layout == "deepseek" and own_head in store else None,
    )
