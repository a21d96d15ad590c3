"""Training material for an MTP head: token sequences and where their loss applies.

Contract: every source becomes ``TrainSequence`` objects (token ids plus the
first position whose draft is trained). Three sources:

- **text files** (any suffix but ``.jsonl``): tokenized whole, cut into windows
  of ``window`` tokens; every position is trained.
- **JSONL prompts** (``messages`` in chat form, or a plain ``prompt``; optional
  ``max_tokens``): the frozen model answers each prompt itself, greedily, and
  the sequence is prompt + answer with the loss on the answer only. On its own
  greedy output the model's prediction for token ``t+2`` *is* token ``t+2``,
  so the head learns exactly what verification accepts. Prompts become ids
  exactly as ``generate`` makes them (``metrale.engine.prompts``): a head
  trained on other ids would learn to draft after prompts it is never served.
- **JSONL with a ``completion``** field: taken as written (prompt + completion,
  loss on the completion), so generations can be made once and reused.

Generated continuations are appended to a JSONL file as each request finishes,
so an interrupted generation resumes where it stopped. While generating, a
``HiddenRecorder`` wrapped around the model keeps the hidden state of every
position the engine computes, so a generated sequence arrives with its hidden
states (``TrainSequence.hidden``) and needs no second forward pass.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.engine.prompts import Tokenizer, record_prompt_ids
from metrale.engine.runtime.model import ForwardOutput, LogitRows, Model, Segment

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class TrainSequence:
    """``token_ids`` of one sequence; drafts are trained at positions
    ``p >= loss_start - 1`` whose target ``p + 2`` exists (see ``train_mtp``)."""

    token_ids: tuple[int, ...]
    loss_start: int = 0
    # The model's pre-norm hidden states of positions 0..len-2 ([len - 1, hidden],
    # bfloat16) when the sequence is the model's own greedy answer and they
    # were recorded while generating it.
    hidden: torch.Tensor | None = None
    # With ``hidden``: the model's argmax at each of those positions ([len - 1]),
    # its guess at the token after; None means only the greedy answer is known.
    predicted: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert 0 <= self.loss_start <= len(self.token_ids), "loss_start within the sequence"
        if self.hidden is not None:
            assert self.hidden.shape[0] == len(self.token_ids) - 1, "one hidden row per fed token"
        if self.predicted is not None:
            assert self.predicted.shape[0] == len(self.token_ids) - 1, "one argmax per fed token"


class HiddenRecorder:
    """A ``Model`` that forwards to ``inner`` and keeps, per slot and position,
    the last hidden state, token id and argmax computed there. A later forward
    at a position overwrites them, exactly as it overwrites the KV cache, so
    once a request finishes its slot holds what its final tokens gave.
    Prefill forwards are asked for every row's logits (the engine wants only
    the last), so prompt positions get the model's predictions too."""

    def __init__(self, inner: Model, hidden_size: int) -> None:
        self.inner = inner
        slots, length = inner.num_slots, inner.max_len
        self.hidden = torch.zeros(slots, length, hidden_size, dtype=torch.bfloat16)
        self.tokens = torch.full((slots, length), -1, dtype=torch.long)
        self.predicted = torch.full((slots, length), -1, dtype=torch.long)

    @property
    def num_slots(self) -> int:
        return self.inner.num_slots

    @property
    def max_len(self) -> int:
        return self.inner.max_len

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def forward(self, segments: Sequence[Segment], logits: LogitRows = "all") -> ForwardOutput:
        out = self.inner.forward(segments, "all")
        argmax = out.logits.argmax(-1).cpu()  # [num_tokens]
        row, last_rows = 0, []
        for seg in segments:
            n = len(seg.token_ids)
            end = seg.start + n
            self.hidden[seg.slot, seg.start : end] = out.hidden[row : row + n].cpu()
            self.tokens[seg.slot, seg.start : end] = torch.tensor(list(seg.token_ids))
            self.predicted[seg.slot, seg.start : end] = argmax[row : row + n]
            row += n
            last_rows.append(row - 1)
        if logits == "last":
            index = torch.tensor(last_rows, device=out.logits.device)
            out = ForwardOutput(logits=out.logits.index_select(0, index), hidden=out.hidden)
        return out

    def take(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hidden [len - 1, hidden], predicted [len - 1])`` of the slot that
        fed ``token_ids[:-1]``, or None if no slot did."""
        fed = torch.tensor(list(token_ids[:-1]))
        n = fed.shape[0]
        for slot in range(self.num_slots):
            if torch.equal(self.tokens[slot, :n], fed):
                return self.hidden[slot, :n].clone(), self.predicted[slot, :n].clone()
        return None


@dataclass(frozen=True)
class PromptRecord:
    """One prompt to answer: its id, the prompt's token ids, a token budget."""

    record_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int


def text_sequences(path: Path, tokenizer: Any, window: int) -> list[TrainSequence]:
    """A text file cut into windows of ``window`` tokens (the last may be shorter)."""
    ids = list(tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")))
    return [
        TrainSequence(tuple(ids[i : i + window]))
        for i in range(0, len(ids), window)
        if len(ids[i : i + window]) >= 3  # a draft needs h_t, t+1 and a target t+2
    ]


def prompt_ids(record: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The token ids a JSONL line asks the model to continue: the ids
    ``generate`` would serve for it, so the head learns to draft after them."""
    ids = record_prompt_ids(record, tokenizer)
    if ids is None:
        raise ValueError("a training JSONL line needs `messages` or `prompt`")
    return ids


def read_jsonl(path: Path, tokenizer: Any) -> tuple[list[TrainSequence], list[PromptRecord]]:
    """Lines with a ``completion`` become sequences; the others prompts to answer."""
    done: list[TrainSequence] = []
    todo: list[PromptRecord] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        ids = prompt_ids(record, tokenizer)
        if "completion" in record:
            answer = tuple(int(i) for i in tokenizer.encode(record["completion"]))
            done.append(TrainSequence(ids + answer, loss_start=len(ids)))
        else:
            record_id = str(record.get("id", f"{path.name}:{number}"))
            budget = int(record.get("max_tokens", DEFAULT_MAX_TOKENS))
            todo.append(PromptRecord(record_id, ids, budget))
    return done, todo


def generate_continuations(
    loaded: LoadedModel,
    prompts: Sequence[PromptRecord],
    store: Path,
    *,
    max_batch: int = 16,
    on_done: Callable[[int, int], None] | None = None,
) -> list[TrainSequence]:
    """Greedy answers to ``prompts`` by the frozen model, with their hidden
    states, cached in ``store`` (a JSONL file) and ``store``'s ``.hidden/`` folder.

    Prompts already stored under their id, with the same prompt tokens, are
    not generated again (an id whose prompt changed is answered anew, and the
    newer line wins when the store is read). Prompt lookup
    stays on (greedy output is identical, only faster); MTP is off, since the
    head being trained does not exist yet. ``on_done(done, total)`` is called
    after each finished prompt.
    """
    hidden_dir = store.with_suffix(".hidden")
    cached = dict(_read_store(store, hidden_dir))
    wanted = {p.record_id for p in prompts}
    missing = {p.record_id: p for p in prompts if not _answers(cached.get(p.record_id), p)}
    for record_id in missing:  # an answer to an edited prompt is no answer at all
        cached.pop(record_id, None)
    if missing:
        hidden_size = int(loaded.model.forward([Segment(0, 0, [0])], "last").hidden.shape[-1])
        recorder = HiddenRecorder(loaded.model, hidden_size)
        engine = Engine(
            recorder,
            loaded.tokenizer,
            EngineConfig(max_batch=max_batch, mtp=False),
            eos_token_ids=loaded.eos_token_ids,
            model_name=loaded.name,
        )
        eos = tuple(loaded.eos_token_ids)
        requests = (
            Request(
                p.record_id,
                p.prompt_ids,
                SamplingParams(max_tokens=p.max_tokens, eos_token_ids=eos),
            )
            for p in missing.values()
        )
        store.parent.mkdir(parents=True, exist_ok=True)
        hidden_dir.mkdir(parents=True, exist_ok=True)
        with store.open("a", encoding="utf-8") as out:
            for result in engine.generate(requests):
                prompt = missing[result.request_id]
                ids = prompt.prompt_ids + result.output_ids
                recorded = recorder.take(ids)
                if result.error is not None or recorded is None or len(ids) < 3:
                    continue
                hidden, predicted = recorded
                torch.save(
                    {"hidden": hidden, "predicted": predicted},
                    hidden_dir / _hidden_name(prompt.record_id),
                )
                line = {"id": prompt.record_id, "prompt_ids": list(prompt.prompt_ids)}
                line["output_ids"] = list(result.output_ids)
                out.write(json.dumps(line) + "\n")
                out.flush()
                cached[prompt.record_id] = TrainSequence(
                    ids, len(prompt.prompt_ids), hidden, predicted
                )
                if on_done is not None:
                    on_done(sum(1 for k in cached if k in wanted), len(prompts))
    return [cached[p.record_id] for p in prompts if p.record_id in cached]


def _answers(stored: TrainSequence | None, prompt: PromptRecord) -> bool:
    """Whether ``stored`` is the answer to ``prompt`` (same prompt tokens)."""
    if stored is None:
        return False
    return stored.token_ids[: stored.loss_start] == tuple(prompt.prompt_ids)


def _hidden_name(record_id: str) -> str:
    return hashlib.sha256(record_id.encode()).hexdigest()[:24] + ".pt"


def _read_store(store: Path, hidden_dir: Path) -> Iterator[tuple[str, TrainSequence]]:
    if not store.exists():
        return
    for line in store.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by an interrupt: generated again
            continue
        prompt = tuple(record["prompt_ids"])
        hidden_file = hidden_dir / _hidden_name(record["id"])
        saved = torch.load(hidden_file) if hidden_file.exists() else {}
        if isinstance(saved, torch.Tensor):  # hidden states only
            saved = {"hidden": saved}
        ids = prompt + tuple(record["output_ids"])
        hidden, predicted = saved.get("hidden"), saved.get("predicted")
        if hidden is not None and hidden.shape[0] != len(ids) - 1:
            # The file belongs to a later answer under this id (its prompt was
            # edited); that answer's line comes later and wins.
            hidden = predicted = None
        yield record["id"], TrainSequence(ids, len(prompt), hidden, predicted)


def load_sources(
    loaded: LoadedModel,
    paths: Sequence[Path],
    work_dir: Path,
    *,
    window: int = 512,
    max_batch: int = 16,
    on_generated: Callable[[int, int], None] | None = None,
) -> list[TrainSequence]:
    """All sequences of ``paths`` in order (see module doc); generations are
    cached in ``work_dir/generated.jsonl``."""
    sequences: list[TrainSequence] = []
    prompts: list[PromptRecord] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"training data {path} does not exist")
        if path.suffix == ".jsonl":
            done, todo = read_jsonl(path, loaded.tokenizer)
            sequences.extend(done)
            prompts.extend(todo)
        else:
            sequences.extend(text_sequences(path, loaded.tokenizer, window))
    if prompts:
        sequences.extend(
            generate_continuations(
                loaded,
                prompts,
                work_dir / "generated.jsonl",
                max_batch=max_batch,
                on_done=on_generated,
            )
        )
    return sequences
