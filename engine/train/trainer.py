"""Self-distillation of one MTP head on a frozen model: cache, training loop, evaluation.

Contract: ``train_mtp(model, sequences, config, work_dir)`` trains a
``TrainableHead`` (``head.py``) so that, at position ``p``, its draft
matches the frozen model's own prediction for token ``p + 2``, i.e. the argmax
of the model's logits at position ``p + 1``. The head therefore learns what
verification will accept, not the corpus (on the model's own greedy output
the two coincide).

- **Cache.** One forward of the frozen model per sequence gives the pre-norm
  hidden states ``h`` (stored in bfloat16) and the argmax targets; they are
  computed once, saved in ``work_dir``, and reused by every epoch and resume
  (``cache.py``).
- **Steps.** A step packs whole sequences until ``batch_tokens`` trained
  positions; the batch order of epoch ``e`` depends only on ``(seed, e)``.
  With ``vocab="seen"`` the softmax runs over the tokens that occur as targets
  in the training set (the LM head is frozen, so only its rows for those
  tokens matter to the loss); evaluation always uses the full vocabulary.
- **Determinism and resume.** Initialisation, batch order and the schedule
  follow from ``seed`` and the step number, and a checkpoint in ``work_dir``
  holds the head, the optimizer and the step: an interrupted run resumed from
  it ends with the same head as an uninterrupted one.
- **Evaluation.** On held-out sequences (never trained on), the greedy
  acceptance of chain drafts at depths ``1..chain_depth``: the depth-``d``
  figure counts base positions whose drafts ``1..d`` all equal the model's
  predictions, as the engine's ``accepted_by_position`` does.

Progress goes through callbacks; nothing here prints.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.train.cache import (
    CachedSequence,
    ProgressFn,
    TrainProgress,
    atomic_save,
    cache_sequences,
    num_trained,
    split_heldout,
)
from metrale.engine.train.data import TrainSequence
from metrale.engine.train.head import TrainableHead

__all__ = [
    "CachedSequence",
    "EvalReport",
    "TrainConfig",
    "TrainProgress",
    "TrainResult",
    "Trainer",
    "cache_sequences",
    "draft_vocabulary",
    "evaluate",
    "train_mtp",
]


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    batch_tokens: int = 4096  # trained positions per optimizer step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    seed: int = 0
    heldout: float = 0.05  # fraction of sequences kept for evaluation
    eval_every: int = 100  # steps between held-out evaluations (0: only at the end)
    checkpoint_every: int = 20  # steps between checkpoints (0: none)
    chain_depth: int = 3
    vocab: Literal["seen", "full"] = "seen"
    # Loss weight of positions inside a prompt (0: answers only). Their hidden
    # states are cached anyway, and the model's predictions there are still
    # what the head must imitate, so they are extra data at no forward cost.
    prompt_weight: float = 0.0
    # Weight of an EAGLE-style feature loss: the head's normalised output at p
    # against the model's normalised h_{p+1}. It is a dense target (the model's
    # whole next-next distribution lives in it) and keeps the output close to
    # what the head itself takes as input, which is what chaining feeds it.
    feature_weight: float = 0.0
    max_steps: int | None = None  # stop early (the schedule still spans every epoch)
    # Tokens the saved head drafts from (its `draft_vocab`, see draft_vocabulary);
    # 0: the whole vocabulary.
    draft_vocab: int = 8192

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ValueError("epochs must be at least 1")
        if self.batch_tokens < 1:
            raise ValueError("batch_tokens must be at least 1")
        if not self.lr > 0:
            raise ValueError("lr must be positive")
        if not 0.0 <= self.heldout < 1.0:
            raise ValueError("heldout must be in [0, 1)")
        if self.chain_depth < 1:
            raise ValueError("the evaluated chain depth must be at least 1")
        if not 0.0 <= self.prompt_weight <= 1.0:
            raise ValueError("prompt_weight must be in [0, 1]")
        if self.feature_weight < 0:
            raise ValueError("feature_weight must be 0 (off) or more")
        if self.vocab not in ("seen", "full"):
            raise ValueError("vocab must be 'seen' or 'full'")
        if self.draft_vocab < 0:
            raise ValueError("draft_vocab must be 0 (the whole vocabulary) or more")


def draft_vocabulary(
    sequences: Sequence[TrainSequence], size: int, vocab_size: int
) -> torch.Tensor:
    """The ``size`` tokens a head trained on ``sequences`` should draft from,
    as sorted ids: the most frequent in the answers first, then in the
    prompts, then the lowest ids (BPE merges come roughly in frequency order).
    A token the head never saw as a target is one it rarely predicts well, and
    every row left out of its LM head is time saved on each draft. Counted
    over every sequence given: train-mtp passes the held-out ones too (its
    held-out figures use the whole vocabulary, so they do not see this)."""
    size = min(size, vocab_size)
    answers: Counter[int] = Counter()
    prompts: Counter[int] = Counter()
    for seq in sequences:
        answers.update(seq.token_ids[seq.loss_start :])
        prompts.update(seq.token_ids[: seq.loss_start])
    ranked = sorted(answers, key=lambda t: (-answers[t], t))
    ranked += sorted(set(prompts) - set(answers), key=lambda t: (-prompts[t], t))
    chosen = set(ranked[:size])
    for token in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


@dataclass(frozen=True)
class EvalReport:
    positions: int
    accepted: tuple[float, ...]  # by chain depth 1.., fraction of positions

    @property
    def tokens_per_verify(self) -> float:
        """Expected tokens per verify at this chain length, counting the bonus token."""
        return 1.0 + sum(self.accepted)


@dataclass
class TrainResult:
    tensors: dict[str, torch.Tensor]
    steps: int
    train_tokens: int  # trained positions per epoch
    heldout_tokens: int  # answer positions of the held-out sequences
    seconds: float
    final_loss: float
    heldout_eval: EvalReport | None
    train_eval: EvalReport | None


EvalFn = Callable[[int, EvalReport], None]


class Trainer:
    """The optimisation state of one run (see module doc)."""

    def __init__(self, model: LlamaModel, train: Sequence[CachedSequence], config: TrainConfig):
        self.config = config
        self.first = 0 if config.prompt_weight > 0 else None  # None: each sequence's own
        self.train = [s for s in train if num_trained(s, self.first) > 0]
        if not self.train:
            raise ValueError("no training positions: the data is empty or too short")
        self.head = TrainableHead(model, config.seed)
        self.rows: torch.Tensor | None = None  # [num_rows] vocabulary rows in the softmax
        self.row_of: torch.Tensor | None = None  # [vocab] target id -> index in rows
        if config.vocab == "seen":
            seen = torch.cat([s.targets[self._first(s) :] for s in self.train])
            rows = torch.unique(seen[seen >= 0])
            row_of = torch.full((self.head.lm_head.shape[0],), -1, dtype=torch.long)
            row_of[rows] = torch.arange(rows.shape[0])
            self.rows, self.row_of = rows.to(self.head.device), row_of.to(self.head.device)
        self.plans = [self._epoch_batches(e) for e in range(config.epochs)]
        self.total_steps = sum(len(p) for p in self.plans)
        self.optimizer = torch.optim.AdamW(
            self.head.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.step = 0

    def _epoch_batches(self, epoch: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
        batches: list[list[int]] = [[]]
        filled = 0
        for i in torch.randperm(len(self.train), generator=gen).tolist():
            if filled >= self.config.batch_tokens:
                batches.append([])
                filled = 0
            batches[-1].append(i)
            filled += num_trained(self.train[i], self.first)
        return batches

    def _first(self, seq: CachedSequence) -> int:
        return seq.first if self.first is None else self.first

    def batch(self, step: int) -> list[int]:
        for plan in self.plans:
            if step < len(plan):
                return plan[step]
            step -= len(plan)
        raise IndexError("step beyond the planned epochs")

    def lr_at(self, step: int) -> float:
        cfg = self.config
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        span = max(self.total_steps - cfg.warmup_steps, 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min((step - cfg.warmup_steps) / span, 1.0)))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)

    def run_step(self) -> tuple[float, int]:
        """One optimizer step; returns ``(mean loss, trained positions)``."""
        indices = self.batch(self.step)
        weights_of = {i: self._weights(self.train[i]) for i in indices}
        total = float(sum(float(w.sum()) for w in weights_of.values()))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        # Summed on the device (in float64, as Python floats would be): one
        # read a step, not one a sequence.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.head.device)
        for i in indices:
            seq = self.train[i]
            start = self._first(seq)
            y = self.head(seq.next_ids, seq.hidden)[start:]  # [m, hidden]
            targets = seq.targets[start:].to(self.head.device)  # [m]
            if self.rows is not None and self.row_of is not None:
                logits = self.head.logits(y, self.rows)  # [m, num_rows]
                targets = torch.where(targets >= 0, self.row_of[targets.clamp(min=0)], -1)
            else:
                logits = self.head.logits(y)  # [m, vocab]
            # target -1: no known prediction there (a recorded prompt position)
            per_token = F.cross_entropy(logits, targets, reduction="none", ignore_index=-1)
            weights = weights_of[i].to(self.head.device)
            if self.config.feature_weight > 0:
                per_token = per_token + self.config.feature_weight * self._feature_loss(seq, y)
            loss = (per_token * weights).sum() / total
            loss.backward()
            loss_sum += loss.detach().double()
        self.optimizer.step()
        self.step += 1
        return float(loss_sum), sum(num_trained(self.train[i], self.first) for i in indices)

    def _feature_loss(self, seq: CachedSequence, y: torch.Tensor) -> torch.Tensor:
        """Per position ``[m]``: mean squared distance between the RMS-normalised
        ``y_p`` and ``h_{p+1}`` (0 at the last position, whose ``h_{p+1}`` is not cached)."""
        start = self._first(seq)
        want = seq.hidden[start + 1 :].to(y.device).float()  # [m - 1, hidden]
        got = y[: want.shape[0]]
        dist = (F.rms_norm(got, got.shape[-1:]) - F.rms_norm(want, want.shape[-1:])).pow(2)
        return F.pad(dist.mean(-1), (0, 1))

    def _weights(self, seq: CachedSequence) -> torch.Tensor:
        """Loss weight of each trained position ``[m]``: 1 in the answer,
        ``prompt_weight`` before it."""
        start = self._first(seq)
        weights = torch.ones(seq.targets.shape[0] - start)
        weights[: seq.first - start] = self.config.prompt_weight
        return weights * (seq.targets[start:] >= 0)

    def evaluate(self, sequences: Sequence[CachedSequence]) -> EvalReport:
        return evaluate(self.head, sequences, self.config.chain_depth)

    def state(self) -> dict[str, object]:
        return {
            "step": self.step,
            "tensors": self.head.tensors(),
            "optimizer": self.optimizer.state_dict(),
            "config": asdict(self.config),
        }

    def restore(self, state: dict[str, object]) -> None:
        saved = dict(state["config"])  # type: ignore[call-overload]
        ignore = ("eval_every", "checkpoint_every", "max_steps", "draft_vocab")
        if {k: v for k, v in saved.items() if k not in ignore} != {
            k: v for k, v in asdict(self.config).items() if k not in ignore
        }:
            raise ValueError("the checkpoint was made with other settings; use a new --work-dir")
        self.head.load_tensors(state["tensors"])  # type: ignore[arg-type]
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.step = int(state["step"])  # type: ignore[call-overload]


def evaluate(head: TrainableHead, sequences: Sequence[CachedSequence], depth: int) -> EvalReport:
    """Chain acceptance by depth over every base position with a full chain of targets."""
    counts = torch.zeros(depth)
    positions = 0
    for seq in sequences:
        n = seq.targets.shape[0]
        last = n - depth  # base positions first..last have targets for every depth
        if last < seq.first:
            continue
        # [depth, n - first]: drafts of base positions first..n-1
        drafts = head.chain_drafts(seq.next_ids, seq.hidden, depth, start=seq.first).cpu()
        base = torch.arange(seq.first, last + 1)
        ok = torch.ones(base.shape[0], dtype=torch.bool)
        for d in range(depth):
            ok = ok & (drafts[d, base - seq.first] == seq.targets[base + d])
            counts[d] += ok.sum()
        positions += base.shape[0]
    accepted = tuple(float(c) / positions if positions else 0.0 for c in counts)
    return EvalReport(positions, accepted)


def train_mtp(
    model: LlamaModel,
    sequences: Sequence[TrainSequence],
    config: TrainConfig,
    work_dir: Path | None = None,
    *,
    on_progress: ProgressFn | None = None,
    on_eval: EvalFn | None = None,
) -> TrainResult:
    """The whole run (see module doc); resumes from ``work_dir/checkpoint.pt``."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    cached = cache_sequences(model, sequences, work_dir, on_progress)
    train, heldout = split_heldout(cached, config.heldout, config.seed)
    trainer = Trainer(model, train, config)
    checkpoint = work_dir / "checkpoint.pt" if work_dir is not None else None
    if checkpoint is not None and checkpoint.exists():
        # On the CPU first: a run resumed on another device than it began on
        # (the optimizer's state follows its parameters as it loads).
        trainer.restore(torch.load(checkpoint, weights_only=False, map_location="cpu"))
    stop = min(trainer.total_steps, config.max_steps or trainer.total_steps)
    loss, tick = math.nan, time.perf_counter()
    report: EvalReport | None = None
    while trainer.step < stop:
        loss, num_tokens = trainer.run_step()
        now = time.perf_counter()
        if on_progress is not None:
            rate = num_tokens / max(now - tick, 1e-9)
            on_progress(TrainProgress("train", trainer.step, stop, loss, rate))
        tick = now
        every = config.checkpoint_every
        if checkpoint is not None and every and trainer.step % every == 0:
            atomic_save(trainer.state(), checkpoint)
        if heldout and config.eval_every and trainer.step % config.eval_every == 0:
            report = trainer.evaluate(heldout)
            if on_eval is not None:
                on_eval(trainer.step, report)
            tick = time.perf_counter()  # evaluation time is not training throughput
    if checkpoint is not None:
        atomic_save(trainer.state(), checkpoint)
    if heldout and (report is None or trainer.step % max(config.eval_every, 1) != 0):
        report = trainer.evaluate(heldout)
        if on_eval is not None:
            on_eval(trainer.step, report)
    return TrainResult(
        tensors=trainer.head.tensors(),
        steps=trainer.step,
        train_tokens=sum(num_trained(s, trainer.first) for s in trainer.train),
        heldout_tokens=sum(num_trained(s) for s in heldout),
        seconds=time.perf_counter() - started,
        final_loss=loss,
        heldout_eval=report if heldout else None,
        train_eval=None,
    )
