"""One gated DeltaNet layer (the linear attention of Qwen3.5/3.6 and Qwen3-Next)
over packed rows, reading and writing its slots' state in ``LinearStates``.

Contract: ``deltanet(h, w, spec, states, index, batch)`` maps the normed
residual rows ``h`` ``[num_tokens, hidden]`` of a forward's segments to the
layer's output rows, as transformers' ``Qwen3_5GatedDeltaNet`` does:

    qkv, z, b, a = in_proj(h)                        # q/k/v side by side, the gate z
    q, k, v = silu(causal_conv1d(qkv))                # depthwise, kernel 4, state = last 3 inputs
    q, k = l2norm(q) / sqrt(k_dim), l2norm(k)         # float32 from here
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule (delta_rule.py), value head h reading key head h // group
    out = out_proj(weight * rmsnorm(o) * silu(z))    # the gated norm, per value head

A segment of at most ``states.verify_rows`` rows (decode, verify) runs the
recurrence token by token from the slot's committed state and leaves its rows
pending; a longer one (prefill) runs the chunked form and commits its end
(``linear_state.py`` says why and how the next forward commits a prefix).

Qwen3-Next fuses ``in_proj_qkvz`` and ``in_proj_ba`` grouped per key head
(``[q, k, v of the group's value heads, z of them]`` per key head); at load
the rows are regrouped into Qwen3.5's layout, so one forward serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.engine.runtime.arch import LinearAttnSpec
from metrale.engine.runtime.delta_rule import (
    chunked_delta_rule,
    delta_rule_step,
    l2_normalize,
    read_state,
)
from metrale.engine.runtime.linear_state import LinearStates, keys_for_values
from metrale.engine.runtime.ops import Weight, linear
from metrale.engine.runtime.weights import WeightStore


@dataclass
class DeltaNetWeights:
    in_proj: Weight  # [conv_channels + value_size + 2 * v_heads, hidden]: qkv, z, b, a
    conv: torch.Tensor  # [conv_channels, 1, kernel] depthwise
    neg_decay_rate: torch.Tensor  # [v_heads] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [v_heads] float32
    norm: torch.Tensor  # [v_dim] the gated norm's weight (not zero-centred)
    out_proj: Weight  # [hidden, value_size]


@dataclass(frozen=True)
class LinearBatch:
    """One forward's segments as the linear layers read them."""

    slots: torch.Tensor  # [S] int64
    starts: torch.Tensor  # [S] int64
    lengths: torch.Tensor  # [S] int64
    rows: list[tuple[int, int]]  # (first packed row, length) per segment
    max_rows: int
    pad_index: torch.Tensor | None  # [num_tokens] into [S * max_rows]; None: no padding
    # [S] bool in a static forward: the slots really fed (the others point into
    # the cache's headroom and keep their state, ``linear_state.py``).
    live: torch.Tensor | None = None
    host_slots: tuple[int, ...] = ()  # ``slots`` as the host knows them


def static_linear_batch(starts: torch.Tensor, width: int, max_len: int) -> LinearBatch:
    """The device step's slots ``0..B-1``, each fed ``width`` rows from ``starts``
    (``static_step.py``); a start at or past ``max_len`` marks a slot not fed."""
    batch = starts.shape[0]
    slots = torch.arange(batch, device=starts.device)
    return LinearBatch(
        slots=slots,
        starts=starts,
        lengths=torch.full_like(starts, width),
        rows=[(b * width, width) for b in range(batch)],
        max_rows=width,
        pad_index=None,
        live=starts < max_len,
        host_slots=tuple(range(batch)),
    )


def load_deltanet(
    store: WeightStore,
    prefix: str,
    spec: LinearAttnSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> DeltaNetWeights:
    """Reads ``{prefix}linear_attn.`` in either public layout (module doc)."""
    at = prefix + "linear_attn."

    def get(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return store.get(at + name).to(device=device, dtype=as_dtype)

    if spec.fused_projections:
        in_proj = _regroup_fused(get("in_proj_qkvz.weight"), get("in_proj_ba.weight"), spec)
    else:
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        in_proj = torch.cat([get(f"{n}.weight") for n in names])
    return DeltaNetWeights(
        in_proj=in_proj,
        conv=get("conv1d.weight").reshape(spec.conv_channels, 1, spec.conv_kernel),
        neg_decay_rate=-get("A_log", torch.float32).exp(),
        dt_bias=get("dt_bias", torch.float32),
        norm=get("norm.weight"),
        out_proj=get("out_proj.weight"),
    )


def _regroup_fused(qkvz: torch.Tensor, ba: torch.Tensor, spec: LinearAttnSpec) -> torch.Tensor:
    """Qwen3-Next's per-key-head groups -> rows ``[q, k, v, z, b, a]`` (module doc)."""
    heads, group = spec.num_k_heads, spec.num_v_heads // spec.num_k_heads
    kd, vd = spec.k_head_dim, spec.v_head_dim
    hidden = qkvz.shape[-1]
    grouped = qkvz.view(heads, 2 * kd + 2 * group * vd, hidden)
    q, k, v, z = grouped.split([kd, kd, group * vd, group * vd], dim=1)
    b, a = ba.view(heads, 2 * group, hidden).split([group, group], dim=1)
    parts = (q, k, v, z, b, a)
    return torch.cat([p.reshape(-1, hidden) for p in parts])


def deltanet(
    h: torch.Tensor,  # [num_tokens, hidden]
    w: DeltaNetWeights,
    spec: LinearAttnSpec,
    eps: float,
    states: LinearStates,
    index: int,  # the layer's place among the stack's linear layers
    batch: LinearBatch,
) -> torch.Tensor:
    """The layer's output rows ``[num_tokens, hidden]`` (module doc)."""
    channels, heads = spec.conv_channels, spec.num_v_heads
    projected = linear(h, w.in_proj)  # [num_tokens, channels + value_size + 2 * heads]
    x, z, b, a = projected.split([channels, spec.value_size, heads, heads], dim=-1)
    beta = b.float().sigmoid()  # [num_tokens, heads]
    decay = w.neg_decay_rate * F.softplus(a.float() + w.dt_bias)
    out = h.new_empty(h.shape[0], heads, spec.v_head_dim, dtype=torch.float32)
    short = [i for i, (_, n) in enumerate(batch.rows) if n <= states.verify_rows]
    if len(short) == len(batch.rows):
        out = _recurrent(x, decay, beta, w, spec, states, index, batch)
    else:
        for i, (first, n) in enumerate(batch.rows):
            rows = slice(first, first + n)
            if n <= states.verify_rows:
                one = _one_segment(batch, i)
                out[rows] = _recurrent(
                    x[rows], decay[rows], beta[rows], w, spec, states, index, one
                )
            else:
                out[rows] = _chunked(
                    x[rows], decay[rows], beta[rows], w, spec, states, index, batch, i
                )
    gated = _gated_norm(out.to(h.dtype), z.view(-1, heads, spec.v_head_dim), w.norm, eps)
    return linear(gated.reshape(h.shape[0], spec.value_size), w.out_proj)


def _one_segment(batch: LinearBatch, i: int) -> LinearBatch:
    n = batch.rows[i][1]
    return LinearBatch(
        slots=batch.slots[i : i + 1],
        starts=batch.starts[i : i + 1],
        lengths=batch.lengths[i : i + 1],
        rows=[(0, n)],
        max_rows=n,
        pad_index=None,
    )


def _conv(
    window: torch.Tensor,  # [S, channels, kernel - 1] the inputs before each segment
    x: torch.Tensor,  # [S, rows, channels]
    w: DeltaNetWeights,
) -> torch.Tensor:
    """silu(causal depthwise conv1d) of each segment's rows: ``[S, rows, channels]``."""
    inputs = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=-1)
    mixed = F.conv1d(inputs, w.conv.to(x.dtype), groups=x.shape[-1])  # [S, channels, rows]
    return F.silu(mixed).transpose(1, 2)


def _factors(
    mixed: torch.Tensor,  # [..., channels] after the conv
    spec: LinearAttnSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised, scaled query and normalised key per key head, and the value
    per value head, float32."""
    q, k, v = mixed.float().split([spec.key_size, spec.key_size, spec.value_size], dim=-1)
    lead = mixed.shape[:-1]
    q = l2_normalize(q.reshape(*lead, spec.num_k_heads, spec.k_head_dim))
    q = q / spec.k_head_dim**0.5
    k = l2_normalize(k.reshape(*lead, spec.num_k_heads, spec.k_head_dim))
    return q, k, v.reshape(*lead, spec.num_v_heads, spec.v_head_dim)


def _recurrent(
    x: torch.Tensor,  # [num_tokens, channels] packed rows of short segments
    decay: torch.Tensor,  # [num_tokens, heads]
    beta: torch.Tensor,  # [num_tokens, heads]
    w: DeltaNetWeights,
    spec: LinearAttnSpec,
    states: LinearStates,
    index: int,
    batch: LinearBatch,
) -> torch.Tensor:
    """Token by token from each slot's committed state; rows left pending."""
    segs, rows = len(batch.rows), batch.max_rows
    x_pad, decay_pad, beta_pad = (_pad(t, batch) for t in (x, decay, beta))
    slots = batch.slots
    q, k, v = _factors(_conv(states.conv[index, slots], x_pad, w), spec)  # [S, rows, heads, dim]
    q_v, k_v = keys_for_values(q, spec), keys_for_values(k, spec)
    state = states.state[index, slots]  # [S, heads, k_dim, v_dim]
    out = q.new_empty(segs, rows, spec.num_v_heads, spec.v_head_dim)
    for r in range(rows):
        state = delta_rule_step(state, k_v[:, r], v[:, r], decay_pad[:, r], beta_pad[:, r])
        out[:, r] = read_state(state, q_v[:, r])
    kept = (
        (states.rows_x, x_pad), (states.rows_key, k), (states.rows_value, v),
        (states.rows_decay, decay_pad), (states.rows_beta, beta_pad),
    )  # fmt: skip
    for store, new in kept:
        new = new.to(store.dtype)
        if batch.live is not None:  # a slot not fed keeps its pending rows
            live = batch.live.view(-1, *([1] * (new.dim() - 1)))
            new = torch.where(live, new, store[index, slots, :rows])
        store[index, slots, :rows] = new
    return _unpad(out, batch)


def _chunked(
    x: torch.Tensor,  # [n, channels] one long segment
    decay: torch.Tensor,  # [n, heads]
    beta: torch.Tensor,  # [n, heads]
    w: DeltaNetWeights,
    spec: LinearAttnSpec,
    states: LinearStates,
    index: int,
    batch: LinearBatch,
    i: int,
) -> torch.Tensor:
    """The chunked form from the slot's committed state; its end is committed."""
    slot = int(batch.slots[i])
    window = states.conv[index, slot]  # [channels, kernel - 1]
    q, k, v = _factors(_conv(window[None], x[None], w)[0], spec)
    q, k = keys_for_values(q, spec), keys_for_values(k, spec)
    out, state = chunked_delta_rule(q, k, v, decay, beta, states.state[index, slot])
    states.state[index, slot] = state
    inputs = torch.cat([window.to(x.dtype), x.transpose(0, 1)], dim=-1)
    states.conv[index, slot] = inputs[:, -window.shape[-1] :].to(states.conv.dtype)
    return out


def _gated_norm(
    o: torch.Tensor,  # [num_tokens, heads, v_dim] in the model dtype
    z: torch.Tensor,  # [num_tokens, heads, v_dim]
    weight: torch.Tensor,  # [v_dim]
    eps: float,
) -> torch.Tensor:
    """``weight * rmsnorm(o) * silu(z)`` per value head, as transformers rounds it."""
    o32 = o.float()
    normed = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(o.dtype) * F.silu(z.float())).to(o.dtype)


def _pad(t: torch.Tensor, batch: LinearBatch) -> torch.Tensor:
    """Packed rows ``[num_tokens, ...]`` -> ``[S, max_rows, ...]`` (zeros past a segment)."""
    segs, rows = len(batch.rows), batch.max_rows
    if batch.pad_index is None:
        return t.reshape(segs, rows, *t.shape[1:])
    padded = t.new_zeros(segs * rows, *t.shape[1:])
    padded.index_copy_(0, batch.pad_index, t)
    return padded.view(segs, rows, *t.shape[1:])


def _unpad(t: torch.Tensor, batch: LinearBatch) -> torch.Tensor:
    flat = t.reshape(-1, *t.shape[2:])
    return flat if batch.pad_index is None else flat.index_select(0, batch.pad_index)
