"""Mixture-of-experts MLPs: routing, and expert products grouped by expert.

Contract: ``moe_mlp(x, w, spec)`` gives, for packed rows ``x`` ``[rows,
hidden]``, what the MoE block of the checkpoint's family gives: the routed
experts' SwiGLU outputs weighted by the router, plus the shared experts'.
``route`` is the router alone, a pure function of the rows (``MoeSpec``
documents both routings); the choice of experts depends on each row only, so
a row routes the same whatever rows share its forward, and a verify of k rows
equals k single-row steps.

Compute is grouped by expert: the (row, expert) pairs are sorted by expert
and each expert that got any rows runs one gate/up and one down product over
the rows gathered for it, its outputs scaled by their routing weights and
added back at their rows. The Python loop is over active experts, never over
rows; a decode step of one row runs ``experts_per_token`` products, a prefill
chunk at most ``num_experts``. Products go through ``linear``, so an expert
held packed (a bfloat16 checkpoint on the CPU) runs in the packed kernel.

Expert weights come from the public per-expert keys
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), gate and up
stacked into one ``[2 * expert_size, hidden]`` weight per expert at load.

The device step (``step/device_verify.py``) cannot afford that loop: its length is
the number of active experts, which only the host knows after reading the
router's counts, one sync per layer, and a CUDA graph cannot hold it.
``stack_experts`` therefore stacks a block's experts into ``[experts, ...]``
tensors once (each expert's weights become views of them, so nothing is held
twice), and ``moe_mlp`` then runs every expert in two grouped products
(``torch._grouped_mm``, with the per-expert row offsets computed on the
device): no host read, one shape per row count. It is the same sum, in the
same float32 or bfloat16 arithmetic, up to the order of additions within a
product.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metrale.engine.runtime.arch import CheckpointError, MoeSpec
from metrale.engine.runtime.ops import Weight, linear
from metrale.engine.runtime.weights import WeightStore


@dataclass
class SwigluWeights:
    """A dense SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, gate and up stacked."""

    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


@dataclass
class MoeWeights:
    """One MoE block. ``router`` is kept in float32 (the families route in it);
    ``score_bias`` is DeepSeek's ``e_score_correction_bias`` (choice only)."""

    router: torch.Tensor  # [num_experts, hidden] float32
    score_bias: torch.Tensor | None  # [num_experts] float32
    experts: list[SwigluWeights]  # num_experts
    shared: SwigluWeights | None
    shared_gate: torch.Tensor | None  # [1, hidden] (Qwen2-MoE)
    # [num_experts, 2 * intermediate, hidden] and [num_experts, hidden,
    # intermediate] once ``stack_experts`` ran; each expert's weights are views.
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None


def route(x: torch.Tensor, w: MoeWeights, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, both ``[rows, experts_per_token]``; weights in
    ``x``'s dtype for softmax routing (as the Qwen MoE families cast them),
    float32 for sigmoid routing."""
    k = spec.experts_per_token
    if spec.routing == "softmax":
        logits = F.linear(x, w.router.to(x.dtype))  # [rows, num_experts]
        top, ids = logits.softmax(dim=-1, dtype=torch.float32).topk(k, dim=-1)
        if spec.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids
    scores = F.linear(x.float(), w.router).sigmoid()  # [rows, num_experts]
    choice = scores if w.score_bias is None else scores + w.score_bias
    choice = _best_groups_only(choice, spec.num_groups, spec.topk_groups)
    ids = choice.topk(k, dim=-1, sorted=False).indices  # [rows, k]
    top = scores.gather(1, ids)
    if spec.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * spec.routed_scaling_factor, ids


def _best_groups_only(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """``choice`` ``[rows, experts]`` with every expert outside the ``keep``
    best groups set to -inf; a group scores the sum of its two best experts."""
    if keep >= groups:
        return choice
    rows, experts = choice.shape
    per_group = choice.view(rows, groups, experts // groups)
    group_scores = per_group.topk(min(2, experts // groups), dim=-1).values.sum(dim=-1)
    best = group_scores.topk(keep, dim=-1, sorted=False).indices  # [rows, keep]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return per_group.masked_fill(~allowed[:, :, None], float("-inf")).view(rows, experts)


def swiglu(x: torch.Tensor, w: SwigluWeights) -> torch.Tensor:
    gate, up = linear(x, w.gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w.down)


def moe_mlp(x: torch.Tensor, w: MoeWeights, spec: MoeSpec) -> torch.Tensor:
    """The block's output ``[rows, hidden]`` for ``x`` ``[rows, hidden]`` (module doc)."""
    weights, ids = route(x, w, spec)  # [rows, k] each
    k = spec.experts_per_token
    flat = ids.flatten()  # [rows * k], pair i is (row i // k, expert flat[i])
    order = flat.argsort(stable=True)  # pairs grouped by expert
    pair_weights = weights.flatten()[order]  # [rows * k]
    pair_rows = order // k
    if w.stacked is not None:
        out = _grouped(x, w.stacked, flat, pair_rows, pair_weights, spec.num_experts)
    else:
        out = _by_expert(x, w, flat, pair_rows, pair_weights, spec.num_experts)
    if w.shared is not None:
        shared = swiglu(x, w.shared)  # [rows, hidden]
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, w.shared_gate)) * shared
        out = out + shared
    return out


def _by_expert(
    x: torch.Tensor,  # [rows, hidden]
    w: MoeWeights,
    flat: torch.Tensor,  # [pairs] expert of each (row, expert) pair
    pair_rows: torch.Tensor,  # [pairs] row of each pair, sorted by expert
    pair_weights: torch.Tensor,  # [pairs]
    num_experts: int,
) -> torch.Tensor:
    """The routed experts' sum, one product per active expert (module doc)."""
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros_like(x)
    at = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = pair_rows[at : at + count]  # [count]
        y = swiglu(x.index_select(0, rows), w.experts[expert])  # [count, hidden]
        y = y * pair_weights[at : at + count, None].to(y.dtype)
        out.index_add_(0, rows, y)
        at += count
    return out


def _grouped(
    x: torch.Tensor,  # [rows, hidden]
    stacked: tuple[torch.Tensor, torch.Tensor],
    flat: torch.Tensor,  # [pairs]
    pair_rows: torch.Tensor,  # [pairs], sorted by expert
    pair_weights: torch.Tensor,  # [pairs]
    num_experts: int,
) -> torch.Tensor:
    """The routed experts' sum in two grouped products, no host read (module doc)."""
    gate_up, down = stacked  # [E, 2I, H], [E, H, I]
    # Rows per expert by a scatter, not bincount: bincount sizes its output on the host.
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's rows
    gathered = x.index_select(0, pair_rows)  # [pairs, hidden]
    both = torch._grouped_mm(gathered, gate_up.transpose(1, 2), offs=offsets)  # [pairs, 2I]
    gate, up = both.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [pairs, H]
    y = y * pair_weights[:, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, pair_rows, y)


def grouped_experts_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` serves the stacked path here: on the CPU
    in any dtype, on CUDA in bfloat16 on a Hopper (sm 9.0) or later, where
    torch has the kernel."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def stack_experts(w: MoeWeights) -> bool:
    """Stacks ``w``'s experts for the grouped path (module doc), once; False
    (and nothing changed) when an expert is held packed, or its products'
    sizes are not the multiples of 16 bytes ``_grouped_mm`` needs."""
    if w.stacked is not None:
        return True
    gates = [e.gate_up for e in w.experts if isinstance(e.gate_up, torch.Tensor)]
    downs = [e.down for e in w.experts if isinstance(e.down, torch.Tensor)]
    if len(gates) < len(w.experts) or len(downs) < len(w.experts):
        return False
    sizes = (*gates[0].shape, *downs[0].shape)
    if any(n * gates[0].element_size() % 16 for n in sizes):
        return False
    gate_up, down = torch.stack(gates), torch.stack(downs)
    for expert, e in enumerate(w.experts):
        e.gate_up, e.down = gate_up[expert], down[expert]
    w.stacked = (gate_up, down)
    return True


def load_moe(
    store: WeightStore,
    prefix: str,
    spec: MoeSpec,
    weight: Callable[..., Weight],
    get: Callable[[str], torch.Tensor],
    device: torch.device,
) -> MoeWeights:
    """Reads the MoE block ``{prefix}mlp.``. ``weight(*names)`` loads linear
    weights named relative to ``prefix``, stacked along their rows (packed
    where possible); ``get(name)`` a plain tensor in the compute dtype."""
    if f"{prefix}mlp.experts.0.gate_proj.weight" not in store:
        raise CheckpointError(
            f"{prefix}mlp.experts.0.gate_proj.weight is missing: metrale reads MoE experts "
            "from their per-expert keys (mlp.experts.{e}.gate_proj/up_proj/down_proj.weight)"
        )

    def swiglu_at(at: str) -> SwigluWeights:
        return SwigluWeights(
            weight(f"{at}gate_proj.weight", f"{at}up_proj.weight"), weight(f"{at}down_proj.weight")
        )

    def float32(name: str) -> torch.Tensor:
        return store.get(prefix + name).to(device=device, dtype=torch.float32)

    shared = next(
        (
            f"mlp.{n}."
            for n in ("shared_experts", "shared_expert")
            if f"{prefix}mlp.{n}.gate_proj.weight" in store
        ),
        None,
    )
    bias = "mlp.gate.e_score_correction_bias"
    return MoeWeights(
        router=float32("mlp.gate.weight"),
        score_bias=float32(bias) if prefix + bias in store else None,
        experts=[swiglu_at(f"mlp.experts.{e}.") for e in range(spec.num_experts)],
        shared=swiglu_at(shared) if shared is not None else None,
        shared_gate=get("mlp.shared_expert_gate.weight") if spec.shared_gate else None,
    )
