"""The per-slot state of a model's gated DeltaNet layers, rolled back to exactly
the prefix a verify accepted.

Contract: like the KV cache (``model.py``), nothing here is told what a verify
accepted: the caller's next forward on a slot starts at the slot's new length,
and that start says it. Per slot, the store holds

- ``state`` ``[layers, slots, v_heads, k_dim, v_dim]`` float32 and ``conv``
  ``[layers, slots, channels, kernel - 1]`` (the conv1d's last inputs): the
  state *committed* at position ``base[slot]``, i.e. after tokens
  ``0..base-1``;
- the *pending* rows of the slot's last forward, when it was short (at most
  ``verify_rows`` tokens, a decode or verify row): per row, the conv input
  (``rows_x``) and what the recurrence consumed (the normalised key, the value,
  the decay and beta). A long forward (a prefill chunk) commits its final
  state at once and leaves nothing pending.

``settle(slots, starts)`` runs first in every forward: a slot fed from
``start`` with rows pending from ``base`` commits the first ``start - base``
of them by replaying the same recurrence step (``delta_rule.py``) the forward
ran on them, and rebuilds the conv window from their inputs. A start of 0 is
a new sequence in the slot: its state is reset. Any other start must lie in
``[base, base + pending]``; a rewind past that would need a state that was
never kept, and is refused.

Why replay rather than keep a state per row: a state is ``v_heads x k_dim x
v_dim`` numbers per layer, and a row's factors are ``channels + k + v + 2 x
v_heads``, about one part in thirty at the released sizes. Replaying costs one
recurrence step per accepted token and layer, small next to the projections
that produced the factors. ``bytes_per_slot`` counts both the state and a full
verify's pending rows, so the KV sizing budgets them.

Off the CPU nothing is read back: every slot of a forward replays, under a
mask, as many rows as any of them may have pending, a bound the store keeps
on the host from the widths it was fed (``rows_bound``). Static forwards
(``settle(..., live=...)``) keep shapes fixed: a slot that is not ``live``
(free or still prefilling, pointed into the cache's headroom) keeps its
state, window and pending rows untouched.
"""

from __future__ import annotations

import torch

from metrale.engine.runtime.arch import LinearAttnSpec
from metrale.engine.runtime.delta_rule import delta_rule_step

# Rows a verify of a model with linear layers may hold by default: one fed
# token and the device step's widest run of drafts (``static_step.WIDTHS``).
VERIFY_ROWS = 17


def keys_for_values(t: torch.Tensor, spec: LinearAttnSpec) -> torch.Tensor:
    """``t [..., num_k_heads, dim]`` as the key head each value head reads,
    ``[..., num_v_heads, dim]``: grouped, or tiled where ``spec.tiled_v_heads``
    (``LinearAttnSpec``)."""
    repeat = spec.num_v_heads // spec.num_k_heads
    if repeat == 1:
        return t
    if spec.tiled_v_heads:
        return t.repeat(*([1] * (t.dim() - 2)), repeat, 1)
    return t.repeat_interleave(repeat, dim=-2)


class LinearStates:
    """The store described in the module doc, for every linear layer of a stack."""

    def __init__(
        self,
        spec: LinearAttnSpec,
        num_layers: int,
        num_slots: int,
        verify_rows: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        assert verify_rows >= 1, "a decode row must stay pending until the next forward"
        self.spec = spec
        self.verify_rows = verify_rows
        f32, layers, rows = torch.float32, num_layers, verify_rows
        heads, k_dim, v_dim = spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
        window = spec.conv_kernel - 1

        def zeros(*shape: int, dt: torch.dtype = f32) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        self.state = zeros(layers, num_slots, heads, k_dim, v_dim)
        self.conv = zeros(layers, num_slots, spec.conv_channels, window, dt=dtype)
        self.rows_x = zeros(layers, num_slots, rows, spec.conv_channels, dt=dtype)
        self.rows_key = zeros(layers, num_slots, rows, spec.num_k_heads, k_dim)
        self.rows_value = zeros(layers, num_slots, rows, heads, v_dim)
        self.rows_decay = zeros(layers, num_slots, rows, heads)
        self.rows_beta = zeros(layers, num_slots, rows, heads)
        self.base = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.pending = torch.zeros(num_slots, dtype=torch.long, device=device)
        # Per slot, on the host: at least its pending rows (module doc).
        self.rows_bound = [0] * num_slots
        # Whether settle may read the device (the CPU); False runs the GPU's
        # masked replay, which tests do on the CPU too.
        self.reads_back = device.type == "cpu"

    @staticmethod
    def bytes_per_slot(
        spec: LinearAttnSpec, num_layers: int, verify_rows: int, dtype: torch.dtype
    ) -> int:
        """What one slot holds: the float32 state, the conv window and
        ``verify_rows`` pending rows, over ``num_layers`` linear layers."""
        size = torch.empty(0, dtype=dtype).element_size()
        window = (spec.conv_kernel - 1) * spec.conv_channels * size
        row_f32 = spec.key_size + spec.value_size + 2 * spec.num_v_heads
        row = spec.conv_channels * size + 4 * row_f32
        return num_layers * (4 * spec.state_numbers + window + verify_rows * row)

    @property
    def bytes(self) -> int:
        tensors = (
            self.state, self.conv, self.rows_x, self.rows_key,
            self.rows_value, self.rows_decay, self.rows_beta,
        )  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors)

    def settle(
        self,
        slots: torch.Tensor,  # [N] int64, distinct
        starts: torch.Tensor,  # [N] int64: where each slot's rows begin this forward
        live: torch.Tensor | None = None,  # [N] bool; None: every slot (see module doc)
        host_slots: list[int] | None = None,  # ``slots`` on the host, when known
    ) -> None:
        """Commits each slot's accepted prefix of its pending rows (module doc)."""
        base, pending = self.base[slots], self.pending[slots]
        fresh = starts == 0
        accepted = torch.where(fresh, 0, starts - base)  # [N]
        if live is not None:
            accepted = torch.where(live, accepted, 0)
            fresh = fresh & live
        if self.reads_back:
            bad = ~fresh & ((accepted < 0) | (accepted > pending))
            if live is not None:
                bad &= live
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise AssertionError(
                    f"slot {int(slots[i])} fed from position {int(starts[i])}, but its linear "
                    f"state is kept only for positions {int(base[i])}..{int(base[i] + pending[i])}"
                )
            replay = int(accepted.max()) if accepted.numel() else 0
        else:  # no host read: replay, under the mask, what any slot may hold
            held = host_slots if host_slots is not None else range(len(self.rows_bound))
            replay = max((self.rows_bound[s] for s in held), default=0)
        state, conv = self.state[:, slots], self.conv[:, slots]
        if replay > 0:
            for r in range(replay):
                step = (r < accepted).view(1, -1, 1, 1, 1)
                key = keys_for_values(self.rows_key[:, slots, r], self.spec)
                after = delta_rule_step(
                    state,
                    key,
                    self.rows_value[:, slots, r],
                    self.rows_decay[:, slots, r],
                    self.rows_beta[:, slots, r],
                )
                state = torch.where(step, after, state)
            # The window after the accepted rows: the last kernel-1 inputs of
            # [window, accepted rows], read at each slot's own offset.
            inputs = torch.cat([conv, self.rows_x[:, slots, :replay].transpose(-1, -2)], dim=-1)
            width = conv.shape[-1]
            at = accepted.view(1, -1, 1, 1) + torch.arange(width, device=slots.device)
            at = at.expand(inputs.shape[0], -1, inputs.shape[2], -1)
            conv = inputs.gather(-1, at)
        reset = fresh.view(1, -1, 1, 1, 1)
        self.state[:, slots] = torch.where(reset, 0.0, state)
        self.conv[:, slots] = torch.where(fresh.view(1, -1, 1, 1), 0.0, conv).to(self.conv.dtype)
        keep = live if live is not None else torch.ones_like(fresh)
        self.base[slots] = torch.where(keep, starts, base)
        self.pending[slots] = torch.where(keep, 0, pending)

    def mark_rows(
        self,
        slots: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        live: torch.Tensor | None = None,
    ) -> None:
        """After a forward: short segments leave their rows pending from their
        start; long ones committed their end (``deltanet.py`` wrote it)."""
        short = lengths <= self.verify_rows
        base = torch.where(short, starts, starts + lengths)
        pending = torch.where(short, lengths, 0)
        if live is not None:
            base = torch.where(live, base, self.base[slots])
            pending = torch.where(live, pending, self.pending[slots])
        self.base[slots] = base
        self.pending[slots] = pending

    def bound_rows(self, host_slots: list[int], widths: list[int], exact: bool) -> None:
        """The host's bound on each fed slot's pending rows after a forward:
        ``exact`` when every slot in ``host_slots`` was fed its width, else
        (a static forward, whose live slots the host does not know) no lower
        than it was."""
        for slot, width in zip(host_slots, widths, strict=True):
            rows = width if width <= self.verify_rows else 0
            self.rows_bound[slot] = rows if exact else max(self.rows_bound[slot], rows)
