"""The decoder forward over slot-addressed KV cache, for every family the runtime runs.

Contract: ``LlamaModel`` implements ``metrale.engine.runtime.model.Model`` for Llama,
SmolLM, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), MiMo's Qwen2 base,
and the MoE families (``moe.py``, with MLA attention in ``mla.py`` for
DeepSeek-V3 and GLM-4.7-Flash): RMSNorm, RoPE (``rope.py``, partial for
GLM-4.5), grouped-query attention, SwiGLU or experts, tied or untied
embeddings; the blocks are read by ``block.py``. Numerics follow transformers' modules (norms in float32,
cast back before the weight), so greedy output matches theirs token for token
at the same dtype.

All rows of a forward run as one packed batch: one matmul per projection for
every token of every segment, one attention call for all segments, KV
written by one index op per layer. On the CPU in float32, forwards whose
segments all have at most ``KERNEL_ATTENTION_ROWS`` rows (decode and verify
steps, short prefill chunks) attend in metrale's C kernel
(``kernels/attention.c``: each segment reads only its own cache length,
whatever its neighbours); other forwards, and a lone prefill from position
0, use torch's attention on segments padded to the longest. The norms,
rotary embedding, cache write and SwiGLU then run in ``kernels/layer_ops.c``
too; when every layer's products are packed (and it has no biases or q/k
norms) such a forward goes through all layers in one C call
(``fused_layers.py``), bit for bit the same. q/k/v and gate/up weights are
fused at load time so a decode step costs few, large ops. Everything runs
under ``torch.inference_mode``, so the returned logits and hidden states are
inference tensors: read them freely, but clone before modifying them in
place outside inference mode.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from metrale.engine.kernels.binding import PackedKernel, packed_kernel
from metrale.engine.runtime.arch import ArchSpec
from metrale.engine.runtime.block import BlockWeights, KVCache, load_block, make_cache
from metrale.engine.runtime.deltanet import LinearBatch, deltanet, static_linear_batch
from metrale.engine.runtime.embedding import Embedding
from metrale.engine.runtime.fused_layers import FusedLayers
from metrale.engine.runtime.kv_cache import RowPlan, SlotKVCache, plan_rows
from metrale.engine.runtime.latent_cache import LatentCache
from metrale.engine.runtime.linear_state import VERIFY_ROWS, LinearStates
from metrale.engine.runtime.mla import mla_attention
from metrale.engine.runtime.model import ForwardOutput, LogitRows, Segment
from metrale.engine.runtime.moe import grouped_experts_run, moe_mlp, stack_experts
from metrale.engine.runtime.ops import Weight, linear, rms_norm
from metrale.engine.runtime.packed import PackedSource
from metrale.engine.runtime.rope import RopeTable, apply_rope
from metrale.engine.runtime.static_step import static_plan
from metrale.engine.runtime.weights import WeightStore

# Query rows per segment up to which the C kernel attends (decode and verify
# steps); longer segments are prefill chunks, where torch's blocked attention
# is faster.
KERNEL_ATTENTION_ROWS = 32


class DecoderStack:
    """Runs decoder blocks over a ``RowPlan`` with one slot cache (``make_cache``).

    Shared by the main model and MTP modules: a module's block is a stack of
    one layer with its own cache.
    """

    def __init__(
        self,
        spec: ArchSpec,
        blocks: list[BlockWeights],
        cache: KVCache,
        *,
        kernels: bool = True,
        linear_states: LinearStates | None = None,
    ) -> None:
        """``kernels=False``: torch ops only, never the C kernels, as on a GPU
        (the device step's static forward runs so on the CPU too). ``cache``
        holds the attention blocks' layers in order, ``linear_states`` the
        gated DeltaNet blocks' (``linear_state.py``)."""
        self.spec = spec
        self.blocks = blocks
        self.cache = cache
        self.linear_states = linear_states
        # Each block's layer in its own store: the cache's, or the linear states'.
        self.store_index: list[int] = []
        counts = [0, 0]
        for w in blocks:
            kind = int(w.linear is not None)
            self.store_index.append(counts[kind])
            counts[kind] += 1
        assert (linear_states is not None) == (counts[1] > 0), "linear blocks need their states"
        self.group = spec.num_heads // spec.num_kv_heads
        some = cache.keys[0] if isinstance(cache, SlotKVCache) else cache.entries[0]
        cpu_float32 = some.device.type == "cpu" and some.dtype == torch.float32
        self.kernel: PackedKernel | None = packed_kernel() if cpu_float32 and kernels else None
        # Every layer in one C call for decode and verify steps (None: layer by layer).
        self.fused = None
        if isinstance(cache, SlotKVCache) and linear_states is None and not spec.attn_gate:
            self.fused = FusedLayers.build(spec, blocks, cache, self.kernel)
        self._torch: DecoderStack | None = None if self.kernel is not None else self

    def prepare_static(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Readies the blocks for the device step (``static_step.py``): each MoE
        block's experts stacked for grouped products (``moe.py``). True when no
        block reads anything back on the host, so its forward can be captured."""
        blocks = [w.moe for w in self.blocks if w.moe is not None]
        if not blocks:
            return True
        return grouped_experts_run(device, dtype) and all(stack_experts(m) for m in blocks)

    def torch_ops(self) -> DecoderStack:
        """This stack over the same blocks and cache in torch ops only."""
        if self._torch is None:
            self._torch = DecoderStack(
                self.spec, self.blocks, self.cache, kernels=False, linear_states=self.linear_states
            )
        return self._torch

    def run(
        self,
        x: torch.Tensor,
        plan: RowPlan,
        rope: RopeTable,
        linear: LinearBatch | None = None,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` through every block; returns the new
        residual. ``linear``: the segments as the linear blocks read them (a
        stack with linear blocks needs it)."""
        if self.fused is not None and plan.mask is not None and self._kernel_attends(plan):
            return self.fused.run(x, plan, rope)
        states = self.linear_states
        if states is not None:
            assert linear is not None, "a stack with linear blocks needs the segments"
            states.settle(linear.slots, linear.starts, linear.live, list(linear.host_slots))
        # The C kernel rotates whole heads from the tables by position; torch
        # rotates from gathered rows, and is the one to rotate part of a head.
        kernel_rotates = self.kernel is not None and self.spec.rotary_dim is None
        kernel_rotates = kernel_rotates and self.spec.mla is None  # MLA rotates its own
        cos_sin = None if kernel_rotates else rope.gather(plan.positions)
        for layer, w in enumerate(self.blocks):
            h = self._norm(x, w.attn_norm)
            if w.linear is not None:
                assert states is not None and linear is not None and self.spec.linear is not None
                index, eps = self.store_index[layer], self.spec.rms_norm_eps
                x = x + deltanet(h, w.linear, self.spec.linear, eps, states, index, linear)
            else:
                x = x + self._attention(h, w, self.store_index[layer], plan, rope, cos_sin)
            x = x + self._mlp(self._norm(x, w.mlp_norm), w)
        if states is not None:
            assert linear is not None
            states.mark_rows(linear.slots, linear.starts, linear.lengths, linear.live)
            widths = [n for _, n in linear.rows]
            states.bound_rows(list(linear.host_slots), widths, exact=linear.live is None)
        return x

    def _mlp(self, h: torch.Tensor, w: BlockWeights) -> torch.Tensor:
        """The MLP of ``h`` ``[num_tokens, hidden]``: dense SwiGLU or the experts."""
        if w.moe is not None:
            assert self.spec.moe is not None
            return moe_mlp(h, w.moe, self.spec.moe)
        assert w.gate_up is not None and w.down is not None
        return linear(self._swiglu(linear(h, w.gate_up)), w.down)

    def _kernel_attends(self, plan: RowPlan) -> bool:
        return self.kernel is not None and plan.max_rows <= KERNEL_ATTENTION_ROWS

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.is_contiguous():
            return self.kernel.rms_norm(x, weight, self.spec.rms_norm_eps)
        return rms_norm(x, weight, self.spec.rms_norm_eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused ``[num_tokens, 2 * intermediate]``."""
        if self.kernel is not None and gate_up.is_contiguous():
            return self.kernel.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotate(
        self,
        x: torch.Tensor,  # [num_tokens, heads, head_dim]
        plan: RowPlan,
        rope: RopeTable,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        if cos_sin is None:
            assert self.kernel is not None
            self.kernel.rope_(x, rope.cos, rope.sin, plan.positions)
            return x
        dim = self.spec.rotary_dim
        if dim is None:
            return apply_rope(x, *cos_sin)
        # Partial rotary: the first ``dim`` of each head turn, the rest pass.
        return torch.cat((apply_rope(x[..., :dim], *cos_sin), x[..., dim:]), dim=-1)

    def _attention(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        w: BlockWeights,
        layer: int,
        plan: RowPlan,
        rope: RopeTable,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        spec = self.spec
        if w.mla is not None:
            assert spec.mla is not None and isinstance(self.cache, LatentCache)
            return mla_attention(h, w.mla, spec.mla, spec.num_heads, self.cache, layer, plan, rope)
        assert w.qkv is not None and w.o_proj is not None
        assert isinstance(self.cache, SlotKVCache)
        num_tokens = h.shape[0]
        qkv = linear(h, w.qkv, w.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        gate = None
        if spec.attn_gate:
            # q_proj's rows hold, per head, the query and then its gate.
            q_gate, kv = qkv.split([2 * spec.q_size, 2 * spec.kv_size], dim=-1)
            q_gate = q_gate.view(num_tokens, heads, 2 * spec.head_dim)
            gate = q_gate[..., spec.head_dim :].reshape(num_tokens, spec.q_size)
            qkv = torch.cat([q_gate[..., : spec.head_dim].reshape(num_tokens, -1), kv], dim=-1)
        if w.q_norm is None or w.k_norm is None:
            # q and k sit side by side in qkv: rotate both in one call.
            qk = qkv[:, : spec.q_size + spec.kv_size].view(num_tokens, heads + kv_heads, -1)
            q, k = self._rotate(qk, plan, rope, cos_sin).split([heads, kv_heads], dim=1)
            v = qkv[:, spec.q_size + spec.kv_size :].view(num_tokens, kv_heads, spec.head_dim)
        else:
            q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
            q = rms_norm(q.view(num_tokens, heads, -1), w.q_norm, spec.rms_norm_eps)
            k = rms_norm(k.view(num_tokens, kv_heads, -1), w.k_norm, spec.rms_norm_eps)
            q, k = self._rotate(q, plan, rope, cos_sin), self._rotate(k, plan, rope, cos_sin)
            v = v.view(num_tokens, kv_heads, spec.head_dim)
        if self.kernel is not None:
            assert plan.segment_table is not None, "plan_rows builds the table"
            keys, values = self.cache.keys[layer], self.cache.values[layer]
            self.kernel.kv_write(k, v, keys, values, plan.segment_table)
        else:
            self.cache.write(layer, plan, k, v)
        if plan.mask is None:
            out = self._causal_prefill(q, k, v)
        elif self._kernel_attends(plan):
            assert self.kernel is not None and plan.segment_table is not None
            out = self.kernel.attend(
                q,
                self.cache.keys[layer],
                self.cache.values[layer],
                plan.segment_table,
                plan.sliding_window or 0,
                spec.head_dim**-0.5,
            )
        else:
            out = self._attend_cached(q, layer, plan)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, w.o_proj, w.o_bias)

    def _causal_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One segment from position 0: attention over its own k/v, no cache read."""
        num_tokens = q.shape[0]
        q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, num_tokens, head_dim]
        k4 = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, num_tokens, head_dim]
        v4 = v.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1).reshape(num_tokens, -1)  # [num_tokens, q_size]

    def _attend_cached(self, q: torch.Tensor, layer: int, plan: RowPlan) -> torch.Tensor:
        """All segments in one call. The query heads sharing a kv head are stacked
        along the query axis (``[S, kv_heads, group * rows, head_dim]``) so keys
        and values are read once per kv head, never repeated."""
        spec, group = self.spec, self.group
        assert isinstance(self.cache, SlotKVCache)
        segs, rows = plan.num_segments, plan.max_rows
        if plan.pad_index is not None:
            padded = q.new_zeros(segs * rows, spec.num_heads, spec.head_dim)
            padded.index_copy_(0, plan.pad_index, q)
            q = padded
        # [S, rows, kv_heads, group, head_dim] -> [S, kv_heads, group * rows, head_dim]
        q = q.view(segs, rows, spec.num_kv_heads, group, spec.head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(segs, spec.num_kv_heads, group * rows, spec.head_dim)
        keys, values = self.cache.read(layer, plan)  # [S, kv_heads, ctx_len, head_dim] each
        mask = plan.grouped_mask(group)  # [S, 1, group * rows, ctx_len]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        # back to packed rows: [S, kv_heads, group, rows, head_dim] -> [S * rows, q_size]
        out = out.view(segs, spec.num_kv_heads, group, rows, spec.head_dim)
        out = out.permute(0, 3, 1, 2, 4).reshape(segs * rows, spec.q_size)
        if plan.pad_index is not None:
            out = out.index_select(0, plan.pad_index)
        return out


@dataclass
class HeadWeights:
    embed: Embedding  # [vocab, hidden] rows
    norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden]; the embedding itself (or its packed form) when tied


class LlamaModel:
    """``Model`` for the Llama family (see module doc)."""

    def __init__(
        self,
        spec: ArchSpec,
        hf_config: Any,
        store: WeightStore,
        *,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        packed: PackedSource | None = None,
        headroom: int = 0,
        verify_rows: int = VERIFY_ROWS,
    ) -> None:
        """``packed``: linear weights to run packed (CPU, float32 only).
        ``headroom``: cache positions per slot past ``max_len``, where the
        device step's padded rows write (``static_step.py``); no segment of
        ``forward`` reaches them. ``verify_rows``: with gated DeltaNet layers,
        the widest segment whose every prefix can be kept (``max_verify_rows``)."""
        self.spec = spec
        self.dtype = dtype
        self._device = device
        self._num_slots = num_slots
        self._max_len = max_len
        self.headroom = headroom

        def get(name: str) -> torch.Tensor:
            return store.get(name).to(device=device, dtype=dtype)

        tied = spec.tie_embeddings or "lm_head.weight" not in store
        self.tied = tied
        embed_name = "model.embed_tokens.weight"
        packed_embed = packed.get(embed_name) if packed else None
        # A packed embedding decodes the rows it is asked for (embedding.py):
        # no float32 copy of the table is kept beside its packed form.
        embed = Embedding(packed=packed_embed) if packed_embed else Embedding(get(embed_name))
        if tied:
            lm_head: Weight = embed.packed or embed.matrix()
        else:
            lm_head = (packed.get("lm_head.weight") if packed else None) or get("lm_head.weight")
        norm = (store.get("model.norm.weight").float() + spec.norm_offset).to(device, dtype)
        self.head = HeadWeights(embed=embed, norm=norm, lm_head=lm_head)
        blocks = [
            load_block(store, f"model.layers.{i}.", spec, dtype, device, packed=packed, layer=i)
            for i in range(spec.num_layers)
        ]
        attending = len(spec.attention_layers)
        cache = make_cache(spec, attending, num_slots, max_len + headroom, dtype, device)
        states = None
        if spec.linear is not None:
            linear_layers = spec.num_layers - attending
            states = LinearStates(spec.linear, linear_layers, num_slots, verify_rows, dtype, device)
        self.stack = DecoderStack(spec, blocks, cache, linear_states=states)
        self.rope = RopeTable(hf_config, spec.rope_dim, max_len, dtype, device, headroom)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def vocab_size(self) -> int:
        return int(self.head.lm_head.shape[0])

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kv_bytes_per_token(self) -> int:
        return self.stack.cache.bytes_per_token

    @property
    def max_verify_rows(self) -> int | None:
        """The widest verify a slot can roll back within (None: any width)."""
        states = self.stack.linear_states
        return states.verify_rows if states is not None else None

    @property
    def state_bytes_per_slot(self) -> int:
        """What a slot holds besides its KV cache: the linear layers' states
        and a full verify's pending rows (``linear_state.py``); 0 without them."""
        states = self.stack.linear_states
        return states.bytes // self._num_slots if states is not None else 0

    @property
    def copies_prefixes(self) -> bool:
        """Whether a slot can start from another's prefix (``copy_prefix``):
        not with gated DeltaNet layers, whose state is kept at each
        sequence's end only, never at a prefix of it."""
        return self.stack.linear_states is None

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Positions ``0..length-1`` of slot ``source``'s cache into ``slot``."""
        assert self.copies_prefixes, "no prefix copies with linear-attention layers"
        self.stack.cache.copy_prefix(source, slot, length)

    def plan(self, segments: Sequence[Segment]) -> RowPlan:
        return plan_rows(
            segments, self._num_slots, self._max_len, self._device, self.spec.sliding_window
        )

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput:
        plan = self.plan(segments)
        x = self.head.embed(plan.token_ids)  # [num_tokens, hidden]
        linear = self._linear_batch(segments, plan)
        hidden = self._mtp_hidden(
            self.stack.run(x, plan, self.rope, linear)
        )  # [num_tokens, hidden]
        rows = hidden if logits == "all" else hidden.index_select(0, plan.last_rows)
        return ForwardOutput(logits=self.logits(rows), hidden=hidden)

    def _linear_batch(self, segments: Sequence[Segment], plan: RowPlan) -> LinearBatch | None:
        if self.stack.linear_states is None:
            return None
        lengths = [len(s.token_ids) for s in segments]
        firsts = list(itertools.accumulate(lengths, initial=0))[:-1]
        device = self._device
        return LinearBatch(
            slots=plan.slot_ids,
            starts=torch.tensor([s.start for s in segments], dtype=torch.long, device=device),
            lengths=torch.tensor(lengths, dtype=torch.long, device=device),
            rows=list(zip(firsts, lengths, strict=True)),
            max_rows=plan.max_rows,
            pad_index=plan.pad_index,
            host_slots=tuple(s.slot for s in segments),
        )

    def _mtp_hidden(self, residual: torch.Tensor) -> torch.Tensor:
        """The hidden rows a forward returns: the final residual, or its final
        norm where the family's MTP layer takes that (``ArchSpec.hidden_normed``)."""
        if not self.spec.hidden_normed:
            return residual
        return rms_norm(residual, self.head.norm, self.spec.rms_norm_eps)

    def prepare_static(self) -> bool:
        """``DecoderStack.prepare_static`` for the model's blocks."""
        return self.stack.prepare_static(self._device, self.dtype)

    @torch.inference_mode()
    def forward_static(
        self,
        tokens: torch.Tensor,  # [B, W] int64 on the device
        starts: torch.Tensor,  # [B] int64 on the device
        ctx: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device step's forward over slots ``0..B-1`` (``static_step.py``):
        ``(logits [B * W, vocab] float32, hidden [B * W, hidden])``, no host read."""
        width = tokens.shape[1]
        plan = static_plan(starts, width, ctx, self.spec.sliding_window)
        x = self.head.embed(tokens.reshape(-1))  # [B * W, hidden]
        linear = None
        if self.stack.linear_states is not None:
            linear = static_linear_batch(starts, width, self._max_len)
        hidden = self._mtp_hidden(self.stack.torch_ops().run(x, plan, self.rope, linear))
        return self.logits(hidden), hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm (unless ``hidden`` already had it) and LM head:
        ``[rows, hidden]`` -> ``[rows, vocab]`` float32."""
        if not self.spec.hidden_normed:
            hidden = rms_norm(hidden, self.head.norm, self.spec.rms_norm_eps)
        return linear(hidden, self.head.lm_head).float()
