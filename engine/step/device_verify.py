"""The device step: verify, acceptance and the MTP chain with one upload and one readback.

Contract: ``DeviceVerify.run(rows)`` takes each decoding sequence's verify row
(``[last_token] + drafts`` at ``seq_len``, in its slot) and does, on the
model's device and with no host read in between: one non-blocking upload of
every input from a pinned buffer; the static forward of slots ``0..B-1`` at
width ``W`` (``runtime/static_step.py``; a CUDA graph per shape on CUDA);
each row's chosen token (greedy: the argmax; sampled: drawn from the
target with the request's noise key at the row's position) and acceptance as
tensor ops (``spec/device_accept.py``); the MTP feed of every verified row
and a chain of ``depth`` drafts from each slot's last final row (greedy: the
argmax; sampled: drawn from the module's shaped distribution with the same
key at the draft's position; either stops where the module's probability of
its draft is below ``min_prob``); then one readback of accepted counts,
emitted tokens, the next drafts and, for requests that ask, the emitted
tokens' logprobs (``engine/logprobs.py``). The host does the rest: stop strings,
finish, prompt lookup and copies, and the next step's inputs.

Slots: the batch is slots ``0..B-1`` for the smallest bucket ``B`` holding
every decoding slot, so the engine hands out the lowest free slot; a slot
in that range that is not in ``rows`` (free, or prefilling) is pointed into
the cache's headroom and changes nothing (``static_step.py``).

The MTP feed runs every row of the verify at its static width. Module 0 at
row ``p`` reads the verify's hidden row ``p`` and the token emitted after it,
so rows up to the last accepted one are final; the rows past it read tokens
that were not emitted, and the next step's feed, which starts right after
the last final row, writes over them before anything reads them (the same
rule as the host drafter's: a draft row is never kept). The chain then runs
one row per depth at the positions after the last final row. One module
only: a checkpoint with several runs on the host step.

Why the first generated token comes from a verify: the device path's
prefill feeds ``prompt[:-1]`` and leaves the prompt's last token as the
sequence's ``last_token``, so the first verify samples the first token as
every later one samples the next, with no readback in the prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from metrale.engine.api import SamplingParams, TokenLogprob
from metrale.engine.config import EngineConfig, StepPathError
from metrale.engine.logprobs import assemble, logprob_tensors
from metrale.engine.runtime.model import ForwardOutput, LogitRows, Segment
from metrale.engine.runtime.static_step import (
    HEADROOM,
    MAX_GRAPHS,
    WIDTHS,
    GraphCache,
    batch_buckets,
    bucket,
    ctx_bucket,
)
from metrale.engine.runtime.syncs import host_buffer, readback
from metrale.engine.spec.device_accept import (
    DeviceAccepted,
    accept_rows,
    choose_rows,
    target_probs_rows,
)

# A device verify is at most this wide: its cache headroom (static_step.py).
MAX_WIDTH = HEADROOM


def device_verify_for(model: Any, mtp: Sequence[Any], config: EngineConfig) -> DeviceVerify | None:
    """The device step when ``config.step_path`` asks for it ("device"), or
    by default on CUDA for a model it can run; ``ValueError`` naming why
    when asked for a model it cannot run."""
    path = config.step_path
    if path == "host" or (path == "auto" and model.device.type != "cuda"):
        return None
    problem = device_verify_problem(model, mtp)
    if problem is not None:
        if path == "device":
            raise StepPathError(f"step_path: device cannot run this model: {problem}")
        return None
    module = mtp[0] if mtp else None
    # A MoE block whose experts cannot run grouped here reads its routing
    # counts on the host, every layer: such a step is not capturable.
    capturable = model.prepare_static() and (module is None or module.prepare_static())
    return DeviceVerify(
        model,
        module,
        num_slots=min(model.num_slots, config.max_batch),
        max_depth=min(config.mtp_ladder.longest, MAX_WIDTH - 1),
        min_prob=config.mtp_min_prob,
        graphs=capturable,
    )


def device_verify_problem(model: Any, mtp: Sequence[Any]) -> str | None:
    """Why the device step cannot run ``model`` with ``mtp``; None when it can."""
    spec = getattr(model, "spec", None)
    if spec is None or not hasattr(model, "forward_static"):
        return "this model has no static forward"
    if model.headroom < MAX_WIDTH:
        return (
            f"it needs {MAX_WIDTH} positions of cache headroom per slot; "
            f"the model was loaded with {model.headroom}"
        )
    if len(mtp) > 1:
        return f"{len(mtp)} stacked MTP modules run on the host step only (one module does)"
    return None


class StaticModel(Protocol):
    """What the device step needs of the main model (``LlamaModel``)."""

    headroom: int

    @property
    def num_slots(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def forward_static(
        self, tokens: torch.Tensor, starts: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class StaticModule(Protocol):
    """What the device step needs of an MTP module (``MtpLayer``)."""

    def forward_static(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        starts: torch.Tensor,
        ctx: int,
        rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, segments: Sequence[Segment], hidden: torch.Tensor, logits: LogitRows = "all"
    ) -> ForwardOutput: ...


@dataclass(frozen=True)
class VerifyRow:
    """One decoding sequence's part of a step (see module doc).

    ``key``: the request's noise key (``sampling.noise_key``; 0 when greedy).
    ``chain``: drafts to chain for the next step.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    params: SamplingParams
    key: int
    chain: int


@dataclass(frozen=True)
class VerifyOut:
    """What the readback brought for one row: drafts kept, tokens emitted
    (``accepted + 1``: the kept drafts and the bonus), the next drafts, and
    the emitted tokens' logprobs when the request asked."""

    accepted: int
    emitted: list[int]
    drafts: list[int]
    logprobs: list[TokenLogprob] | None = None


class StaticStep:
    """The main model's static forward, through a graph per shape on CUDA."""

    def __init__(
        self, model: StaticModel, graphs: bool = True, max_graphs: int = MAX_GRAPHS
    ) -> None:
        self.model = model
        self.graphs = GraphCache(model.device, graphs, max_graphs)

    def forward(
        self, tokens: torch.Tensor, starts: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B * W, vocab], hidden [B * W, hidden])`` of slots ``0..B-1``."""
        key = ("verify", *tokens.shape, ctx)
        logits, hidden = self.graphs.run(key, self.model.forward_static, tokens, starts, ctx)
        return logits, hidden


class DeviceVerify:
    """Buffers, graphs and the step itself (module doc)."""

    def __init__(
        self,
        model: StaticModel,
        module: StaticModule | None,
        *,
        num_slots: int,
        max_depth: int,
        min_prob: float,
        graphs: bool,
    ) -> None:
        assert model.headroom >= MAX_WIDTH, "device_verify_for checks the headroom"
        self.model, self.module = model, module
        self.device = model.device
        self.num_slots = num_slots
        self.max_depth = max_depth if module is not None else 0
        self.min_prob = min_prob
        self.static = StaticStep(model, graphs)
        self._buckets = batch_buckets(num_slots)
        self._cache_len = model.max_len + model.headroom
        # Upload: per slot W tokens and 7 words (module doc of _upload).
        self._up = host_buffer((num_slots * (MAX_WIDTH + 7),), torch.int64, self.device)
        # Readback: accepted, W emitted, depth drafts and their count per slot.
        self._down = host_buffer(
            (num_slots * (MAX_WIDTH + self.max_depth + 2),), torch.int64, self.device
        )

    def graph_shapes(self) -> list[tuple[Any, ...]]:
        """``(role, batch, width, ctx)`` of each captured graph (none off CUDA)."""
        return [tuple(key) for key in self.static.graphs.captured()]  # type: ignore[arg-type]

    def feed_prompt(self, segments: Sequence[Segment], hidden: torch.Tensor) -> None:
        """Feeds prompt rows to the module (eager, like the prefill itself):
        ``hidden`` ``[num_tokens, hidden]`` the prefill's rows, in segment order."""
        if self.module is not None:
            self.module.forward(segments, hidden, logits="last")

    @torch.inference_mode()
    def run(self, rows: Sequence[VerifyRow]) -> list[VerifyOut]:
        """One step over ``rows`` (module doc); results in ``rows`` order."""
        batch = bucket(max(r.slot for r in rows) + 1, self._buckets)
        width = bucket(max(len(r.tokens) for r in rows), WIDTHS)
        depth = min(self.max_depth, max(r.chain for r in rows))
        needed = max(r.start for r in rows) + width + depth
        ctx = ctx_bucket(needed, self._cache_len)
        sampled = any(not r.params.greedy for r in rows)
        inputs = self._upload(rows, batch, width)
        tokens, starts, widths, keys, chain, top_k, temperature, top_p = inputs
        logits, hidden = self.static.forward(tokens, starts, ctx)
        # logits: [B * W, vocab]; hidden: [B * W, hidden]
        sampling = None
        if sampled:
            cuts = any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows)
            sampling = _Sampling((temperature, top_k, top_p), cuts, keys)
            # Each slot's parameters on its W rows (expand: no host read for the size).
            temps, ks, ps, row_keys = (
                p[:, None].expand(batch, width).reshape(-1)
                for p in (*sampling.params, sampling.keys)
            )
            target = target_probs_rows(logits, temps, ks, ps, cuts=cuts)
            # Row r of a slot chooses the token at position start + r + 1.
            offsets = torch.arange(1, width + 1, device=self.device)  # [W]
            positions = (starts[:, None] + offsets).reshape(-1)  # [B * W]
            chosen = choose_rows(target, row_keys, positions).view(batch, width)
        else:
            chosen = logits.argmax(dim=-1).view(batch, width)
        accepted = accept_rows(tokens, widths, chosen)
        out = [accepted.accepted, accepted.emitted.reshape(-1)]
        if depth > 0:
            drafts, counts = self._chain(accepted, hidden, starts, chain, ctx, depth, sampling)
            out += [drafts.reshape(-1), counts]
        top = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        if top is not None:
            # Every row's chosen token's, as float64 bits in the int64 readback.
            lps = logprob_tensors(logits, chosen.reshape(-1), top)
            out += [
                lps[0].double().view(torch.int64),
                lps[1].double().reshape(-1).view(torch.int64),
            ]
            out += [lps[2].reshape(-1)]
        packed = torch.cat(out)
        if packed.shape[0] > self._down.shape[0]:
            self._down = host_buffer((packed.shape[0],), torch.int64, self.device)
        values = readback(packed, self._down[: packed.shape[0]]).numpy()
        return _unpack(values, rows, (batch, width, depth, top))

    def _upload(self, rows: Sequence[VerifyRow], batch: int, width: int) -> list[torch.Tensor]:
        """Writes every input into the pinned buffer and sends it in one copy:
        ``tokens [B, W]``, then per slot ``start, width, key, chain, top_k``
        and, as float64 bits, ``temperature, top_p``. A slot with no row
        starts in the headroom, at width 0."""
        size = batch * (width + 7)
        host = self._up[:size]
        # Written through numpy: a tensor __setitem__ a field costs microseconds.
        values = host.numpy()
        values[:] = 0
        grid = values[: batch * width].reshape(batch, width)
        fields = values[batch * width :].reshape(7, batch)
        floats = fields[5:].view(np.float64)  # temperature, top_p
        fields[0] = self._cache_len - MAX_WIDTH  # the headroom (module doc)
        floats[1] = 1.0
        for r in rows:
            grid[r.slot, : len(r.tokens)] = r.tokens
            fields[:5, r.slot] = (r.start, len(r.tokens), r.key, r.chain, r.params.top_k)
            floats[:, r.slot] = (r.params.temperature, r.params.top_p)
        # Safe to rewrite next step: every step ends in an event sync on this
        # stream, after this copy. On the CPU a copy too, so that nothing the
        # step computes shares the host buffer (the sync counter exempts it).
        sent = host.to(self.device, non_blocking=True, copy=True)
        tokens = sent[: batch * width].view(batch, width)
        words = sent[batch * width :].view(7, batch)
        real = words[5:].view(torch.float64)  # float64: top_p near 1 must stay below it
        return [
            tokens,
            words[0],
            words[1],
            words[2],
            words[3],
            words[4],
            real[0],
            real[1],
        ]

    def _chain(
        self,
        verified: DeviceAccepted,  # accepted [B]; emitted [B, W]: the token after each row
        hidden: torch.Tensor,  # [B * W, hidden]
        starts: torch.Tensor,  # [B]
        chain: torch.Tensor,  # [B] drafts asked for
        ctx: int,
        depth: int,
        sampling: _Sampling | None,  # None: a greedy batch
    ) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [B, depth], counts [B]
        """Feeds every verified row to the module and chains ``depth`` drafts
        from each slot's last final row (module doc)."""
        module = self.module
        assert module is not None
        accepted, emitted = verified.accepted, verified.emitted
        batch, width = emitted.shape
        graphs, slots = self.static.graphs, torch.arange(batch, device=self.device)
        # The last final row of each slot, row `accepted` of its W, drafts next.
        logits, out = graphs.run(
            ("module", batch, width, ctx),
            module.forward_static,
            emitted,
            hidden,
            starts,
            ctx,
            accepted,
        )  # [B, vocab], [B * W, hidden]
        row_hidden = out.view(batch, width, -1)[slots, accepted]  # [B, hidden]
        first_row = torch.zeros_like(accepted)
        position = starts + accepted + 1  # where the chain's next row goes
        last = self._cache_len - 1
        drafts, sure = [], []
        for k in range(depth):
            # Draft k is the token at position + 1 + k.
            draft, keep = self._draft(logits, position + 1 + k, sampling)
            drafts.append(draft)
            sure.append(keep)
            if k + 1 == depth:
                break
            logits, row_hidden = graphs.run(
                ("module", batch, 1, ctx),
                module.forward_static,
                draft[:, None],
                row_hidden,
                torch.clamp(position + k, max=last),
                ctx,
                first_row,
            )
        kept = torch.stack(sure, dim=1).long().cumprod(dim=1).sum(dim=1)  # [B]
        return torch.stack(drafts, dim=1), torch.minimum(kept, chain)

    def _draft(
        self,
        logits: torch.Tensor,  # [B, vocab] the module's logits at one chain position
        positions: torch.Tensor,  # [B] the position of the token each slot drafts
        sampling: _Sampling | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # draft [B], sure [B] bool
        """One chain position's draft and whether the chain may keep it: while
        the module's probability of its draft reaches ``min_prob`` (greedy:
        its top probability; sampled: of the drawn token, under the shaped
        distribution it was drawn from, with the target's key)."""
        probs = logits.softmax(dim=-1)  # [B, vocab]
        if sampling is None:
            return logits.argmax(dim=-1), probs.amax(dim=-1) >= self.min_prob
        temperature, top_k, top_p = sampling.params
        # [B, vocab]; greedy slots one-hot, so their draft is the argmax
        q = target_probs_rows(logits, temperature, top_k, top_p, cuts=sampling.cuts)
        draft = choose_rows(q, sampling.keys, positions)  # [B]
        drawn = q.gather(1, draft[:, None])[:, 0]  # [B]
        confidence = torch.where(temperature == 0, probs.amax(dim=-1), drawn)
        return draft, confidence >= self.min_prob


@dataclass(frozen=True)
class _Sampling:
    """A sampled batch's per-slot ``(temperature, top_k, top_p)``, whether
    any row cuts by top-k or top-p, and each slot's noise key ``[B]``."""

    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    cuts: bool
    keys: torch.Tensor


def _unpack(
    values: np.ndarray,  # [packed] int64, the readback
    rows: Sequence[VerifyRow],
    shape: tuple[int, int, int, int | None],  # batch, width, depth, top (None: no logprobs)
) -> list[VerifyOut]:
    """Each row's results from the readback's flat ``accepted [B], emitted
    [B * W]``, when ``depth`` ``drafts [B * depth], counts [B]``, and when
    ``top`` the logprobs of every row's chosen token ``[B * W]``, the top
    ones ``[B * W * top]`` (both float64 bits) and their ids."""
    batch, width, depth, top = shape
    parts = [batch, batch * width] + ([batch * depth, batch] if depth else [])
    if top is not None:
        parts += [batch * width, batch * width * top, batch * width * top]
    pieces = np.split(values, np.cumsum(parts)[:-1])
    accepted, emitted = pieces[0].tolist(), pieces[1].tolist()
    drafts, counts = (pieces[2].tolist(), pieces[3].tolist()) if depth else ([], [])
    results = []
    for r in rows:
        n = accepted[r.slot]
        own = drafts[r.slot * depth : (r.slot + 1) * depth] if depth else []
        tokens = emitted[r.slot * width : r.slot * width + n + 1]
        logprobs = None
        if top is not None and r.params.logprobs is not None:
            lp, top_v, top_i = (
                p.reshape(batch, width, size)[r.slot, : n + 1]
                for p, size in zip(pieces[-3:], (1, top, top), strict=True)
            )
            k = r.params.logprobs
            logprobs = assemble(
                tokens,
                lp.view(np.float64)[:, 0].tolist(),
                top_v.view(np.float64)[:, :k].tolist(),
                top_i[:, :k].tolist(),
            )
        results.append(
            VerifyOut(
                accepted=n,
                emitted=tokens,
                drafts=own[: counts[r.slot]] if depth else [],
                logprobs=logprobs,
            )
        )
    return results
