"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over slot-addressed
latent cache.

Contract: ``mla_attention(h, w, spec, num_heads, cache, layer, plan, rope)`` gives,
for packed rows ``h`` ``[num_tokens, hidden]``, what transformers'
``DeepseekV3Attention`` (and ``Glm4MoeLiteAttention``, the same module) gives
after ``o_proj``, and keeps the Segment contract of ``model.py``: it writes this
forward's cache entries at each row's slot and position, then each row attends
to positions ``[0, its own position]`` of its slot. The maths, per head ``h``::

    q = q_proj(x)  or  q_b_proj(rms_norm(q_a_proj(x)))  ->  [q_nope | q_rot]
    [c | k_rot] = kv_a_proj_with_mqa(x);  c = rms_norm(c)   (the latent)
    q_rot, k_rot = rope(q_rot), rope(k_rot)                  (k_rot: one head, shared)
    [k_nope | v] = kv_b_proj(c)                              (W_uk, W_uv per head)
    score(t, s) = scale * (q_nope_t . W_uk c_s + q_rot_t . k_rot_s)
    out_t = o_proj(concat_h W_uv sum_s softmax(score)_ts c_s)

``LatentCache`` (``latent_cache.py``) holds only ``c`` and ``k_rot`` per
position, never keys or values per head: ``kv_lora_rank + qk_rope_head_dim``
numbers per layer and position.

Two exact ways to attend, chosen per forward by ``expands`` (or forced with
``path=``):

- *absorbed* (decode, verify, short chunks far into their context): ``W_uk``
  is folded into the query (``q_nope W_uk``, ``[kv_lora_rank]`` per head) and
  ``W_uv`` applied after the weighted sum, so attention runs in latent space
  against the cache as it is stored: one shared "head" of ``kv_lora_rank +
  qk_rope_head_dim`` that every query head reads, never expanded.
- *expanded* (a lone prefill from 0, long chunks): ``kv_b_proj`` expands the
  window into per-head keys and values once, after which each (row, position)
  pair costs ``qk_head_dim`` and ``v_head_dim`` wide products instead of two
  ``kv_lora_rank + qk_rope_head_dim`` wide ones. With as many rows as
  positions that is cheaper for every released MLA model, whose
  ``kv_lora_rank`` is far wider than its per-head dims; for one decode row it
  would expand the whole context to read it once.

Both give q, k and v one width (the absorbed path reads the window as its
values too and drops the rope columns of the output, the expanded one appends
zero columns) so that torch takes its fused attention kernel rather than the
unfused one that unequal widths force.

RoPE: ``rope`` is a ``RopeTable`` built for ``qk_rope_head_dim``; it already
scales cos/sin by YaRN's attention factor, and ``spec.softmax_scale`` holds the
``mscale_all_dim`` factor. Checkpoints with ``rope_interleave`` store each
rotary pair side by side; ``load_mla_weights`` reorders the rotary rows of the
q and kv_a projections to the half-split layout once, so the forward rotates
both the same way (``apply_rope``) and scores are unchanged: a dot product does
not see a permutation applied to both of its sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from metrale.engine.runtime.arch import MlaSpec
from metrale.engine.runtime.kv_cache import RowPlan
from metrale.engine.runtime.latent_cache import LatentCache
from metrale.engine.runtime.ops import Weight, linear, rms_norm
from metrale.engine.runtime.rope import RopeTable, apply_rope

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default
# eps, not the config's rms_norm_eps (DeepSeek's own code does the same).
LATENT_NORM_EPS = 1e-6

MlaPath = Literal["absorbed", "expanded"]


class TensorStore(Protocol):
    """What loading reads: ``WeightStore`` or any name -> tensor mapping."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


@dataclass
class MlaWeights:
    """One layer's MLA projections. Queries come from ``q_proj`` or, with a
    ``q_lora_rank``, from ``q_a_proj`` / ``q_a_norm`` / ``q_b_proj``. Biases exist
    only with ``attention_bias``, and then only on q_a, kv_a and o (transformers
    builds q_proj, q_b_proj and kv_b_proj without). Rotary rows of the q and
    kv_a projections are in half-split order (see module doc)."""

    q_proj: Weight | None  # [num_heads * qk_head_dim, hidden]
    q_a_proj: Weight | None  # [q_lora_rank, hidden]
    q_a_bias: torch.Tensor | None  # [q_lora_rank]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b_proj: Weight | None  # [num_heads * qk_head_dim, q_lora_rank]
    kv_a_proj: Weight  # [kv_lora_rank + qk_rope_head_dim, hidden]
    kv_a_bias: torch.Tensor | None  # [kv_lora_rank + qk_rope_head_dim]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b_proj: torch.Tensor  # [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    o_proj: Weight  # [hidden, num_heads * v_head_dim]
    o_bias: torch.Tensor | None  # [hidden]


def load_mla_weights(
    store: TensorStore,
    prefix: str,
    spec: MlaSpec,
    num_heads: int,
    dtype: torch.dtype,
    device: torch.device,
) -> MlaWeights:
    """Reads ``{prefix}self_attn.q_a_proj.weight`` etc. (the public keys); a bias is
    read where the checkpoint has one."""
    attn = f"{prefix}self_attn."
    rope_rows = _half_split_order(spec) if spec.rope_interleave else None

    def get(name: str, reorder: torch.Tensor | None = None) -> torch.Tensor:
        tensor = store.get(attn + name)
        if reorder is not None:
            tensor = tensor.index_select(0, reorder)
        return tensor.to(device=device, dtype=dtype)

    def bias(name: str, reorder: torch.Tensor | None = None) -> torch.Tensor | None:
        return get(name, reorder) if attn + name in store else None

    q_rows = None if rope_rows is None else _per_head_rows(rope_rows, spec, num_heads)
    kv_a_rows = None if rope_rows is None else _kv_a_rows(rope_rows, spec)
    lora = spec.q_lora_rank is not None
    return MlaWeights(
        q_proj=None if lora else get("q_proj.weight", q_rows),
        q_a_proj=get("q_a_proj.weight") if lora else None,
        q_a_bias=bias("q_a_proj.bias") if lora else None,
        q_a_norm=get("q_a_layernorm.weight") if lora else None,
        q_b_proj=get("q_b_proj.weight", q_rows) if lora else None,
        kv_a_proj=get("kv_a_proj_with_mqa.weight", kv_a_rows),
        kv_a_bias=bias("kv_a_proj_with_mqa.bias", kv_a_rows),
        kv_a_norm=get("kv_a_layernorm.weight"),
        kv_b_proj=get("kv_b_proj.weight"),
        o_proj=get("o_proj.weight"),
        o_bias=bias("o_proj.bias"),
    )


def _half_split_order(spec: MlaSpec) -> torch.Tensor:
    """Rotary dims ``(x0, x1), (x2, x3), ...`` -> ``(x0, x2, ..., x1, x3, ...)``:
    the order transformers' ``apply_rotary_pos_emb_interleave`` outputs."""
    dims = torch.arange(spec.qk_rope_head_dim)  # [qk_rope_head_dim]
    return torch.cat((dims[0::2], dims[1::2]))


def _per_head_rows(rope_order: torch.Tensor, spec: MlaSpec, num_heads: int) -> torch.Tensor:
    """Rows of a q projection ``[num_heads * qk_head_dim, in]`` with each head's
    rotary rows (its last ``qk_rope_head_dim``) reordered."""
    head = torch.cat((torch.arange(spec.qk_nope_head_dim), spec.qk_nope_head_dim + rope_order))
    starts = torch.arange(num_heads) * spec.qk_head_dim  # [num_heads]
    return (starts[:, None] + head[None, :]).flatten()  # [num_heads * qk_head_dim]


def _kv_a_rows(rope_order: torch.Tensor, spec: MlaSpec) -> torch.Tensor:
    """Rows of ``kv_a_proj_with_mqa`` ``[kv_lora_rank + qk_rope_head_dim, hidden]``
    with the rotary key's rows reordered."""
    return torch.cat((torch.arange(spec.kv_lora_rank), spec.kv_lora_rank + rope_order))


def expands(spec: MlaSpec, rows: int, ctx_len: int) -> bool:
    """Whether expanding the window beats absorbing, by multiply-adds per head and
    segment for ``rows`` query rows over ``ctx_len`` positions (``r`` the
    latent rank, ``d`` the wider of ``qk_head_dim`` and ``v_head_dim``)::

        absorbed = rows * r * (nope + v) + rows * ctx * 2 * (r + rope)
        expanded = ctx * r * (nope + v) + rows * ctx * 2 * d

    The first terms fold ``W_uk``/``W_uv`` into the rows, or expand the window.
    """
    rank, up = spec.kv_lora_rank, spec.qk_nope_head_dim + spec.v_head_dim
    width = max(spec.qk_head_dim, spec.v_head_dim)
    absorbed = rows * rank * up + rows * ctx_len * 2 * (rank + spec.qk_rope_head_dim)
    expanded = ctx_len * rank * up + rows * ctx_len * 2 * width
    return expanded < absorbed


def mla_attention(
    h: torch.Tensor,  # [num_tokens, hidden], normed
    w: MlaWeights,
    spec: MlaSpec,
    num_heads: int,
    cache: LatentCache,
    layer: int,
    plan: RowPlan,
    rope: RopeTable,
    *,
    path: MlaPath | None = None,
) -> torch.Tensor:
    """The layer's attention output ``[num_tokens, hidden]`` (see module doc);
    ``path`` forces one way to attend, ``None`` lets ``expands`` choose."""
    cos, sin = rope.gather(plan.positions)  # [num_tokens, 1, qk_rope_head_dim] each
    q = _queries(h, w, spec, num_heads)  # [num_tokens, num_heads, qk_head_dim]
    q_nope, q_rot = q.split([spec.qk_nope_head_dim, spec.qk_rope_head_dim], dim=-1)
    q_rot = apply_rope(q_rot, cos, sin)
    kv_a = linear(h, w.kv_a_proj, w.kv_a_bias)  # [num_tokens, kv_lora_rank + qk_rope_head_dim]
    latent = rms_norm(kv_a[:, : spec.kv_lora_rank], w.kv_a_norm, LATENT_NORM_EPS)
    k_rot = apply_rope(kv_a[:, None, spec.kv_lora_rank :], cos, sin)[:, 0]
    cache.write(layer, plan, latent, k_rot)
    window = cache.read(layer, plan)  # [num_segments, ctx_len, kv_lora_rank + qk_rope_head_dim]
    if path is None:
        path = "expanded" if expands(spec, plan.max_rows, plan.ctx_len) else "absorbed"
    if path == "expanded":
        out = _attend_expanded(q_nope, q_rot, window, w, spec, plan)
    else:
        out = _attend_absorbed(q_nope, q_rot, window, w, spec, plan)
    return linear(out, w.o_proj, w.o_bias)  # [num_tokens, hidden]


def _queries(h: torch.Tensor, w: MlaWeights, spec: MlaSpec, num_heads: int) -> torch.Tensor:
    """``[num_tokens, num_heads, qk_head_dim]``, from ``q_proj`` or the q LoRA pair."""
    if w.q_proj is not None:
        q = linear(h, w.q_proj)
    else:
        assert w.q_a_proj is not None and w.q_a_norm is not None and w.q_b_proj is not None
        q_a = linear(h, w.q_a_proj, w.q_a_bias)  # [num_tokens, q_lora_rank]
        q = linear(rms_norm(q_a, w.q_a_norm, LATENT_NORM_EPS), w.q_b_proj)
    return q.view(h.shape[0], num_heads, spec.qk_head_dim)


def _up_projections(
    w: MlaWeights, spec: MlaSpec, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj`` as per-head ``W_uk`` ``[num_heads, qk_nope, kv_lora_rank]`` and
    ``W_uv`` ``[num_heads, v_head_dim, kv_lora_rank]``, views."""
    per_head = w.kv_b_proj.view(num_heads, spec.qk_nope_head_dim + spec.v_head_dim, -1)
    k_up, v_up = per_head.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)
    return k_up, v_up


def _attend_absorbed(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
    q_rot: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim]
    window: torch.Tensor,  # [num_segments, ctx_len, kv_lora_rank + qk_rope_head_dim]
    w: MlaWeights,
    spec: MlaSpec,
    plan: RowPlan,
) -> torch.Tensor:
    """Attention in latent space; returns ``[num_tokens, num_heads * v_head_dim]``.
    Every query head reads the one shared window, so the heads are stacked along
    the query axis (``[S, 1, heads * rows, d]``) and the window is read once."""
    num_tokens, heads, _ = q_nope.shape
    segs, rows = plan.num_segments, plan.max_rows
    k_up, v_up = _up_projections(w, spec, heads)
    q_latent = torch.bmm(q_nope.transpose(0, 1), k_up)  # [heads, num_tokens, kv_lora_rank]
    q = torch.cat((q_latent.transpose(0, 1), q_rot), dim=-1)  # [num_tokens, heads, d]
    # [S * rows, heads, d] -> [S, heads, rows, d] -> [S, 1, heads * rows, d]
    q = _padded(q, plan).view(segs, rows, heads, -1).transpose(1, 2)
    q = q.reshape(segs, 1, heads * rows, q.shape[-1])
    keys = window.unsqueeze(1)  # [S, 1, ctx_len, kv_lora_rank + qk_rope_head_dim]
    mask = plan.grouped_mask(heads) if plan.mask is not None else _stacked_causal(rows, heads, q)
    # The window serves as the values too: the latent columns of the output are
    # the weighted latent, and equal widths let torch take its fused kernel.
    out = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask, scale=spec.softmax_scale)
    out = out[..., : spec.kv_lora_rank]  # [S, 1, heads * rows, kv_lora_rank]
    # [S, heads, rows, r] -> [S * rows, heads, r] -> [num_tokens, heads, r]
    out = out.view(segs, heads, rows, -1).transpose(1, 2).reshape(segs * rows, heads, -1)
    out = _packed(out, plan)
    out = torch.bmm(out.transpose(0, 1), v_up.transpose(1, 2))  # [heads, num_tokens, v_head_dim]
    return out.transpose(0, 1).reshape(num_tokens, heads * spec.v_head_dim)


def _attend_expanded(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
    q_rot: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim]
    window: torch.Tensor,  # [num_segments, ctx_len, kv_lora_rank + qk_rope_head_dim]
    w: MlaWeights,
    spec: MlaSpec,
    plan: RowPlan,
) -> torch.Tensor:
    """Attention over the window expanded to per-head keys and values; returns
    ``[num_tokens, num_heads * v_head_dim]``."""
    heads = q_nope.shape[1]
    segs, rows, ctx = plan.num_segments, plan.max_rows, plan.ctx_len
    latent, k_rot = window.split([spec.kv_lora_rank, spec.qk_rope_head_dim], dim=-1)
    kv = F.linear(latent, w.kv_b_proj).view(segs, ctx, heads, -1).transpose(1, 2)
    k_nope, values = kv.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=-1)
    # [S, heads, ctx_len, qk_head_dim], the rotary key shared by every head
    keys = torch.cat((k_nope, k_rot.unsqueeze(1).expand(segs, heads, ctx, -1)), dim=-1)
    q = torch.cat((q_nope, q_rot), dim=-1)  # [num_tokens, heads, qk_head_dim]
    q = _padded(q, plan).view(segs, rows, heads, -1).transpose(1, 2)  # [S, heads, rows, d]
    # torch's fused kernel wants one width for q, k and v: zero columns widen
    # the narrower side without changing a score or an output column.
    width = max(spec.qk_head_dim, spec.v_head_dim)
    q, keys, values = (_widened(x, width) for x in (q, keys, values))
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=plan.mask, is_causal=plan.mask is None, scale=spec.softmax_scale
    )[..., : spec.v_head_dim]  # [S, heads, rows, v_head_dim]
    out = out.transpose(1, 2).reshape(segs * rows, heads * spec.v_head_dim)
    return _packed(out, plan)  # [num_tokens, heads * v_head_dim]


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns appended up to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _padded(x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """Packed rows ``[num_tokens, ...]`` -> ``[num_segments * max_rows, ...]``,
    padding rows zero."""
    if plan.pad_index is None:
        return x
    padded = x.new_zeros(plan.num_segments * plan.max_rows, *x.shape[1:])
    return padded.index_copy_(0, plan.pad_index, x)


def _packed(x: torch.Tensor, plan: RowPlan) -> torch.Tensor:
    """``[num_segments * max_rows, ...]`` -> packed rows ``[num_tokens, ...]``."""
    return x if plan.pad_index is None else x.index_select(0, plan.pad_index)


def _stacked_causal(rows: int, heads: int, like: torch.Tensor) -> torch.Tensor:
    """A lone prefill from 0's causal mask for heads stacked along the query axis:
    ``[1, 1, heads * rows, rows]``."""
    causal = torch.ones(rows, rows, dtype=torch.bool, device=like.device).tril()
    return causal.repeat(heads, 1).view(1, 1, heads * rows, rows)
