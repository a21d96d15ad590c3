"""The device step: verify, acceptance and the MTP chain on the model's device.

Contract: ``DeviceStep.run`` reads top to bottom as the step's phases, the
host step's with two differences (``device_verify.py`` has the device side):

1. prefill one chunk, stopping one token short of each prompt: the prompt's
   last token is the sequence's ``last_token``, so the first verify samples
   the first token as every later verify samples the next, with no readback
   in the prefill; the MTP module is fed the prompt's rows on the device;
2. drafts: as on the host (the policy's choice among the chain read back
   last step and a copy, cut to the device verify's width);
3. one upload, the verify, acceptance and the next chain on the device, one
   readback; then each sequence's bookkeeping on the host (``books.py``),
   exactly as the host step does it, and the policy is told the chain;
4. settle the copies and tell the policy what the verify did.

The batch is the lowest slots (the device runs slots ``0..B-1``), so the
engine hands out the lowest free slot. Grammars run on the host step only.
"""

from __future__ import annotations

import dataclasses

import torch

from metrale.engine.api import Request
from metrale.engine.runtime.model import Segment
from metrale.engine.sequence import SeqState
from metrale.engine.spec.copies import settle_copies
from metrale.engine.spec.mtp import mark_declined
from metrale.engine.step import Queues, StepTimes
from metrale.engine.step.books import StepSetup, prompt_chunk, take_drafts
from metrale.engine.step.device_verify import MAX_WIDTH, DeviceVerify, VerifyRow
from metrale.lookup import PromptLookupConfig


def device_lookup(cfg: PromptLookupConfig | None) -> PromptLookupConfig | None:
    """Copies cut to what a device verify takes: at most ``MAX_WIDTH`` rows."""
    if cfg is None:
        return None
    return dataclasses.replace(cfg, max_drafts=min(cfg.max_drafts, MAX_WIDTH - 1))


class DeviceStep:
    """The step on the device (module doc)."""

    name = "device"

    def __init__(self, setup: StepSetup, device: DeviceVerify, has_mtp: bool) -> None:
        self.model, self.policy = setup.model, setup.policy
        self.books, self.copies, self.shared = setup.books, setup.copies, setup.shared
        self.prefill_chunk, self.forced_drafts = setup.prefill_chunk, setup.forced_drafts
        self.device, self.has_mtp = device, has_mtp

    def admit(self, seq: SeqState, queues: Queues) -> None:
        if seq.seq_len == seq.prompt_len - 1:  # nothing before its last token to prefill
            mark_declined(seq, self.has_mtp)  # no chain yet: a copy may stand in
            queues.decoding.append(seq)
        else:
            queues.prefilling.append(seq)

    def rejection(self, request: Request) -> str | None:
        if request.grammar is not None:
            return (
                "structured outputs (a grammar) run on the host step only; this run uses "
                "the device step (--step-path device or CUDA): run it with --step-path host"
            )
        return None

    def run(self, queues: Queues, times: StepTimes) -> list[SeqState]:
        # 1. Prefill one chunk, up to each prompt's last token.
        self._prefill(queues, times)
        batch = [s for s in queues.decoding if not s.finished]
        if not batch:
            return []
        # 2. Drafts, as on the host.
        took = take_drafts(self.policy, batch, queues, self.forced_drafts)
        # 3. Verify, accept and draft on the device; bookkeeping on the host.
        self._verify(batch, self.policy.chain_cap(len(batch)), times)
        # 4. Settle the copies; the policy learns what the verify did.
        settle_copies(took, self.shared, self.copies)
        self.policy.verified(times)
        return []

    def _prefill(self, queues: Queues, times: StepTimes) -> None:
        segments, chunked = prompt_chunk(queues.prefilling, self.prefill_chunk, short=1)
        if not segments:
            return
        began = self.policy.clock()
        out = self.model.forward(segments, logits="last")
        # out.hidden: [num_tokens, hidden_size]
        self.books.counters.prefills += 1
        fed: list[Segment] = []
        rows: list[int] = []
        at = 0
        for seq, seg in zip(chunked, segments, strict=True):
            start, size = seq.seq_len, len(seg.token_ids)
            seq.seq_len += size
            if seq.seq_len == seq.prompt_len - 1:
                queues.prefilling.remove(seq)
                mark_declined(seq, self.has_mtp)  # its first verify has no chain yet
                queues.decoding.append(seq)
            if self.has_mtp:
                fed.append(Segment(seq.slot, start, seq.history[start + 1 : seq.seq_len + 1]))
                rows.extend(range(at, at + size))
            at += size
        if fed:
            index = torch.tensor(rows, dtype=torch.long, device=out.hidden.device)
            self.device.feed_prompt(fed, out.hidden[index])
        times.prefill_s = self.policy.clock() - began

    def _verify(self, batch: list[SeqState], chain: int, times: StepTimes) -> None:
        rows = [
            VerifyRow(
                slot=seq.slot,
                start=seq.seq_len,
                tokens=[seq.last_token, *seq.pending_drafts],
                params=seq.request.params,
                key=seq.noise_key or 0,
                chain=chain,
            )
            for seq in batch
        ]
        self.books.counters.verifies += 1
        began = self.policy.clock()
        outs = self.device.run(rows)
        times.verify_s = self.policy.clock() - began
        times.verify_rows = sum(len(row.tokens) for row in rows)
        times.produced = {}
        for seq, out in zip(batch, outs, strict=True):
            times.produced[seq.slot] = out.emitted
            self.books.settle(seq, out.emitted, out.logprobs)
            # No chain this time (none sure enough): a copy may stand in, as on the host.
            mark_declined(seq, chain > 0 and not out.drafts)
            if not seq.finished and out.drafts:
                seq.set_drafts(out.drafts)
                self.policy.chain_drafted(seq, out.drafts)
