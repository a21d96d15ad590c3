"""A controllable fake of ``metrale.engine.runtime.model``'s ``Model`` and ``MtpModule``.

Contract: ``FakeModel`` is an n-gram language model over a slot KV cache. The
logits at position ``p`` are a fixed random function of the last ``context``
tokens of the slot's cache up to ``p`` (seeded, so the same context always
gives the same row; with ``counting`` the argmax is the last token plus one,
so a history that counts up is continued the way its copies predict), which
makes plain decoding cheap to compute with
``reference_greedy`` and exact distributions easy to enumerate. The cache is
real: a forward writes its segments' tokens at their positions and reads
positions ``[0, p]``, so an engine that feeds the wrong positions or forgets a
rollback gets different logits. ``hidden`` rows encode the context itself
(``context`` token ids as floats, ``-1`` before the start), which is what
``FakeMtp`` needs to predict the token after next exactly.

``FakeMtp`` predicts token ``p+2`` from ``h_p`` and token ``p+1``. In mode
``"right"`` its logits are the main model's at ``p+1`` (an oracle: greedy drafts
are always accepted); ``"wrong"`` moves the argmax to another token (greedy
drafts always rejected); ``"noisy"`` adds a fixed perturbation (sampled drafts
from a different ``q``); ``"mixed"`` is right in some contexts and wrong in
others. Both fakes record every forward for trace assertions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from metrale.engine.runtime.model import ForwardOutput, LogitRows, MtpLogitRows, Segment

MtpMode = Literal["right", "wrong", "noisy", "mixed"]


def _context_seed(context: tuple[int, ...], salt: int) -> int:
    value = salt * 1_000_003 + 17
    for token in context:
        value = (value * 1_000_033 + token + 7) % (2**61 - 1)
    return value


@dataclass
class FakeModel:
    vocab: int = 16
    num_slots: int = 4
    max_len: int = 128
    context: int = 2
    seed: int = 0
    scale: float = 3.0  # logit spread: larger makes the argmax more peaked
    counting: bool = False  # the argmax is always (last token + 1) % vocab
    forwards: list[list[Segment]] = field(default_factory=list)
    _rows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cache = torch.full((self.num_slots, self.max_len), -1, dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:  # [vocab]
        """The logits after ``tokens``: a function of their last ``context`` ids."""
        key = tuple(tokens[-self.context :])
        row = self._rows.get(key)
        if row is None:
            gen = torch.Generator().manual_seed(_context_seed(key, self.seed))
            row = torch.randn(self.vocab, generator=gen) * self.scale
            if self.counting and key:
                row[(key[-1] + 1) % self.vocab] = float(row.max()) + 1.0
            self._rows[key] = row
        return row

    def encode(self, tokens: Sequence[int]) -> list[float]:
        """The hidden row after ``tokens``: their last ``context`` ids, -1 padded."""
        tail = list(tokens[-self.context :])
        return [-1.0] * (self.context - len(tail)) + [float(t) for t in tail]

    def forward(self, segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput:
        self.forwards.append(list(segments))
        seen: set[int] = set()
        rows, hidden, last_rows = [], [], []
        for seg in segments:
            assert seg.slot not in seen, "a slot appears at most once per forward"
            seen.add(seg.slot)
            end = seg.start + len(seg.token_ids)
            assert end <= self.max_len, "segment ends beyond the slot"
            self._cache[seg.slot, seg.start : end] = torch.tensor(list(seg.token_ids))
            cache = self._cache[seg.slot].tolist()
            assert -1 not in cache[:end], "attends to a position never written"
            for p in range(seg.start, end):
                rows.append(self.next_logits(cache[: p + 1]))
                hidden.append(self.encode(cache[: p + 1]))
            last_rows.append(rows[-1])
        out = torch.stack(rows if logits == "all" else last_rows)
        return ForwardOutput(logits=out, hidden=torch.tensor(hidden))


@dataclass
class FakeMtp:
    """An MTP module over ``model``'s n-gram rule (see the module docstring)."""

    model: FakeModel
    mode: MtpMode = "right"
    max_len: int = 128
    # Tokens it may draft (a head's draft vocabulary); the rest get logit -inf.
    draft_vocab: tuple[int, ...] | None = None
    forwards: list[tuple[list[Segment], torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # What each position of each slot was last fed: (context at p, token p+1).
        self.fed: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        self._noise: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def num_slots(self) -> int:
        return self.model.num_slots

    def forward(
        self,
        segments: Sequence[Segment],
        hidden: torch.Tensor,  # [num_tokens, context]
        logits: MtpLogitRows = "all",
    ) -> ForwardOutput:
        self.forwards.append((list(segments), hidden.clone()))
        assert hidden.shape[0] == sum(len(s.token_ids) for s in segments), "one hidden row a token"
        rows, out_hidden, last_rows, i = [], [], [], 0
        for seg in segments:
            assert seg.start + len(seg.token_ids) <= self.max_len
            for k, token in enumerate(seg.token_ids):
                context = tuple(int(v) for v in hidden[i].tolist() if v >= 0)
                self.fed[(seg.slot, seg.start + k)] = (context, token)
                after = (*context, token)
                rows.append(self._draft_logits(after))
                out_hidden.append(self.model.encode(after))
                i += 1
            last_rows.append(rows[-1])
        if isinstance(logits, torch.Tensor):
            out = torch.stack([rows[i] for i in logits.tolist()])
        else:
            out = torch.stack(rows if logits == "all" else last_rows)
        return ForwardOutput(logits=out, hidden=torch.tensor(out_hidden))

    def _draft_logits(self, tokens: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        logits = self._unrestricted_logits(tokens)
        if self.draft_vocab is None:
            return logits
        restricted = torch.full_like(logits, float("-inf"))
        index = torch.tensor(self.draft_vocab)
        return restricted.index_copy_(0, index, logits[index])

    def _unrestricted_logits(self, tokens: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        true = self.model.next_logits(tokens)
        right = self.mode == "right" or (
            self.mode == "mixed" and _context_seed(tokens[-self.model.context :], 99) % 3 != 0
        )
        if right:
            return true
        if self.mode == "noisy":
            key = tokens[-self.model.context :]
            noise = self._noise.get(key)
            if noise is None:
                gen = torch.Generator().manual_seed(_context_seed(key, 7))
                noise = self._noise[key] = torch.randn(true.shape, generator=gen) * 1.5
            return true + noise
        # Wrong: the true argmax becomes the least likely token.
        wrong = true.clone()
        wrong[int(true.argmax())] = float(true.min()) - 10.0
        return wrong


def reference_greedy(
    model: FakeModel, prompt: Sequence[int], max_tokens: int, eos: Sequence[int] = ()
) -> list[int]:
    """Plain greedy decoding by the model's rule, without any cache."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(model.next_logits(tokens).argmax())
        out.append(token)
        tokens.append(token)
        if token in eos:
            break
    return out


def byte_decode(ids: Sequence[int]) -> str:
    """A stand-in tokenizer: token ``t`` is the character ``chr(ord('a') + t)``."""
    return "".join(chr(ord("a") + t) for t in ids)


@dataclass
class FakeClock:
    """A clock that moves only when a costed fake says it spent time."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def nearly_free_rows(rows: int) -> float:
    """Seconds of a verify where a row costs almost nothing beside the step (a
    GPU at small batch): the budget then verifies every source's drafts."""
    return 0.010 + 0.00001 * rows


@dataclass
class CostedModel(FakeModel):
    """A ``FakeModel`` whose forward takes ``cost(rows)`` seconds on ``clock``."""

    clock: FakeClock = field(default_factory=FakeClock)
    cost: Callable[[int], float] = lambda rows: 0.01 * rows

    def forward(self, segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput:
        self.clock.now += self.cost(sum(len(s.token_ids) for s in segments))
        return super().forward(segments, logits)


@dataclass
class CostedMtp(FakeMtp):
    """A ``FakeMtp`` whose forward takes ``cost`` seconds on its model's clock."""

    cost: float = 0.0

    def forward(
        self,
        segments: Sequence[Segment],
        hidden: torch.Tensor,  # [num_tokens, context]
        logits: MtpLogitRows = "all",
    ) -> ForwardOutput:
        assert isinstance(self.model, CostedModel)
        self.model.clock.now += self.cost
        return super().forward(segments, hidden, logits)
