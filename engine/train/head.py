"""A trainable MTP head over a frozen Llama-family model, and its chain evaluation.

Contract: ``TrainableHead`` holds the tensors of a standalone head (names and
shapes of ``mtp_head.head_tensor_shapes``) as float32 parameters and computes
exactly what the runtime's ``MtpLayer`` computes for a head loaded from them
(DeepSeek structure, see ``mtp.py``), for one whole sequence at a time with
plain causal attention instead of the slot KV cache:

    x_p = eh_proj(cat[enorm(embed(t_{p+1})), hnorm(h_p)]);  y = block(x);  logits = lm_head(norm(y))

The embedding, LM head and RoPE tables are the frozen model's and are never
trained. Everything computes in float32 (bfloat16 matmuls are very slow on
CPUs without AMX), whatever dtype the hidden states were cached in, on the
model's device: the parameters are initialised on the CPU from the seed (the
same head on every device) and moved there, and inputs, which the training
cache keeps on the CPU, move there as they come in. ``tensors()`` come back
on the CPU.

``chain_drafts`` reproduces the runtime's chain drafting for every position
of a sequence at once: the depth-``d`` draft at base position ``p`` sits at
position ``p + d - 1``, attends to the depth-1 keys of positions ``0..p`` (what
the module's cache holds after feeding verified positions) and to the chain's
own keys, and takes the previous depth's output hidden and draft as input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from metrale.engine.runtime.arch import ArchSpec
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.mtp_head import head_tensor_shapes
from metrale.engine.runtime.ops import as_dense, rms_norm
from metrale.engine.runtime.rope import apply_rope


class TrainableHead(torch.nn.Module):
    """Head parameters (float32) plus references to the frozen model's shared parts."""

    def __init__(self, model: LlamaModel, seed: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.spec: ArchSpec = model.spec
        # Cloned outside inference mode: the runtime's tensors are inference
        # tensors, which autograd refuses to save for backward.
        self.embed = model.head.embed.matrix().float().clone()  # [vocab, hidden], frozen
        lm_head = as_dense(model.head.lm_head)
        self.lm_head = self.embed if model.tied else lm_head.float().clone()
        self.cos = model.rope.cos.float().clone()  # [max_len, head_dim]
        self.sin = model.rope.sin.float().clone()
        self.device = self.embed.device
        gen = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterDict()
        for name, shape in sorted(head_tensor_shapes(self.spec).items()):
            # Norms start at one, the final norm too rather than at the model's
            # own (larger) scale, which trains worse early on.
            if name.endswith("norm.weight"):
                value = torch.ones(shape)
            elif name.endswith(".bias"):
                value = torch.zeros(shape)
            else:
                value = torch.randn(shape, generator=gen) * init_std
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    # residual branches start small so the block begins near identity
                    value = value / math.sqrt(2.0)
            # ParameterDict keys may not hold dots
            self.weights[_key(name)] = torch.nn.Parameter(value.to(self.device))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their file names (detached float32, on the CPU)."""
        return {_name(k): v.detach().cpu().clone() for k, v in self.weights.items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in tensors.items():
                self.weights[_key(name)].copy_(value.float())

    def w(self, name: str) -> torch.Tensor:
        return self.weights[_key(name)]

    # -- forward -------------------------------------------------------------

    def project(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``eh_proj(cat[enorm(embed(next)), hnorm(h)])``: ``[n]``, ``[n, hidden]`` -> ``[n, hidden]``."""
        eps = self.spec.rms_norm_eps
        next_ids, hidden = next_ids.to(self.device), hidden.to(self.device)
        emb = rms_norm(F.embedding(next_ids, self.embed), self.w("enorm.weight"), eps)
        hid = rms_norm(hidden.float(), self.w("hnorm.weight"), eps)
        return F.linear(torch.cat([emb, hid], dim=-1), self.w("eh_proj.weight"))

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention inputs of the block for ``x`` ``[n, hidden]`` at ``positions`` ``[n]``:
        q ``[n, heads, head_dim]``, k and v ``[n, kv_heads, head_dim]``, RoPE applied."""
        spec, eps = self.spec, self.spec.rms_norm_eps
        h = rms_norm(x, self.w("block.input_layernorm.weight"), eps)
        n = x.shape[0]
        parts = []
        for p, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads)):
            bias = self.w(f"block.self_attn.{p}_proj.bias") if spec.qkv_bias else None
            out = F.linear(h, self.w(f"block.self_attn.{p}_proj.weight"), bias)
            parts.append(out.view(n, heads, spec.head_dim))
        q, k, v = parts
        if spec.qk_norm:
            q = rms_norm(q, self.w("block.self_attn.q_norm.weight"), eps)
            k = rms_norm(k, self.w("block.self_attn.k_norm.weight"), eps)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish_block(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual adds and the MLP: ``x`` and ``attn`` ``[n, q_size]`` -> ``y`` ``[n, hidden]``."""
        eps = self.spec.rms_norm_eps
        x = x + F.linear(attn, self.w("block.self_attn.o_proj.weight"))
        h = rms_norm(x, self.w("block.post_attention_layernorm.weight"), eps)
        gate = F.linear(h, self.w("block.mlp.gate_proj.weight"))
        up = F.linear(h, self.w("block.mlp.up_proj.weight"))
        return x + F.linear(F.silu(gate) * up, self.w("block.mlp.down_proj.weight"))

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Depth-1 outputs ``y`` ``[n, hidden]`` for one sequence from position 0:
        ``next_ids[p]`` is token ``p+1``, ``hidden[p]`` the model's ``h_p``."""
        y, _, _ = self.forward_with_kv(next_ids, hidden)
        return y

    def forward_with_kv(
        self, next_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``forward``, also returning the block's keys and values (``[n, kv_heads, head_dim]``)."""
        n = next_ids.shape[0]
        x = self.project(next_ids, hidden)
        q, k, v = self.qkv(x, torch.arange(n, device=self.device))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )  # [heads, n, head_dim]
        return self.finish_block(x, out.transpose(0, 1).reshape(n, -1)), k, v

    def logits(self, y: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``lm_head(norm(y))`` ``[n, vocab]``, or only the vocabulary ``rows`` given."""
        normed = rms_norm(y, self.w("norm.weight"), self.spec.rms_norm_eps)
        head = self.lm_head if rows is None else self.lm_head.index_select(0, rows)
        return F.linear(normed, head)

    # -- chain evaluation ----------------------------------------------------

    @torch.no_grad()
    def chain_drafts(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, depth: int, start: int = 0
    ) -> torch.Tensor:
        """Greedy drafts ``[depth, n - start]``: row ``d-1`` holds, for each base
        position ``p >= start``, the depth-``d`` draft (a guess at token ``p + 1 + d``)."""
        spec = self.spec
        n = next_ids.shape[0]
        y, ctx_k, ctx_v = self.forward_with_kv(next_ids, hidden)
        y = y[start:]  # [m, hidden] only the base positions asked for
        m = n - start
        drafts = [self.logits(y).argmax(-1)]  # [m]
        group = spec.num_heads // spec.num_kv_heads
        ctx_k = ctx_k.repeat_interleave(group, dim=1)  # [n, heads, head_dim]
        ctx_v = ctx_v.repeat_interleave(group, dim=1)
        scale = 1.0 / math.sqrt(spec.head_dim)
        base = torch.arange(start, n, device=self.device)  # [m]
        ctx_mask = (
            base[:, None] >= torch.arange(n, device=self.device)[None, :]
        )  # [m, n]: p sees 0..p
        chain_k: list[torch.Tensor] = []
        chain_v: list[torch.Tensor] = []
        for d in range(2, depth + 1):
            positions = (base + d - 1).clamp(max=self.cos.shape[0] - 1)
            x = self.project(drafts[-1], y)
            q, k, v = self.qkv(x, positions)
            chain_k.append(k.repeat_interleave(group, dim=1))
            chain_v.append(v.repeat_interleave(group, dim=1))
            scores_ctx = torch.einsum("qhd,khd->hqk", q, ctx_k) * scale  # [heads, m, n]
            scores_ctx = scores_ctx.masked_fill(~ctx_mask, float("-inf"))
            own_k = torch.stack(chain_k, dim=2)  # [m, heads, d - 1, head_dim]
            scores_own = torch.einsum("qhd,qhcd->hqc", q, own_k) * scale  # [heads, m, d - 1]
            probs = torch.cat([scores_ctx, scores_own], dim=-1).softmax(-1)
            out = torch.einsum("hqk,khd->qhd", probs[..., :n], ctx_v)
            out = out + torch.einsum("hqc,qhcd->qhd", probs[..., n:], torch.stack(chain_v, 2))
            y = self.finish_block(x, out.reshape(m, -1))
            drafts.append(self.logits(y).argmax(-1))
        return torch.stack(drafts)


def _key(name: str) -> str:
    return name.replace(".", "__")


def _name(key: str) -> str:
    return key.replace("__", ".")
