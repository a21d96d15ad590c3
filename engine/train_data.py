"""Training material for an MTP head: token sequences and where their loss applies.

Contract: every source becomes ``TrainSequence`` objects (token ids plus the
first position whose draft is trained). Three sources:

- **text files** (any suffix but ``.jsonl``): tokenized whole, cut into windows
  of ``window`` tokens; every position is trained.
- **JSONL prompts** (``messages`` in chat form, or a plain ``prompt``; optional
  ``max_tokens``): the frozen model answers each prompt itself, greedily, and
  the sequence is prompt + answer with the loss on the answer only. On its own
  greedy output the model's prediction for token ``t+2`` *is* token ``t+2``,
  so the head learns exactly what verification accepts.
- **JSONL with a ``completion``** field: taken as written (prompt + completion,
  loss on the completion), so generations can be made once and reused.

Generated continuations are appended to a JSONL file as each request finishes,
so an interrupted generation resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.scheduler import Engine

if TYPE_CHECKING:
    from metrale.engine.loader import LoadedModel

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class TrainSequence:
    """``token_ids`` of one sequence; drafts are trained at positions
    ``p >= loss_start - 1`` whose target ``p + 2`` exists (see ``train_mtp``)."""

    token_ids: tuple[int, ...]
    loss_start: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.loss_start <= len(self.token_ids), "loss_start within the sequence"


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


def prompt_ids(record: dict[str, Any], tokenizer: Any) -> tuple[int, ...]:
    """The token ids a JSONL line asks the model to continue."""
    if "messages" in record:
        ids = tokenizer.apply_chat_template(
            record["messages"], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return tuple(int(i) for i in ids)
    if "prompt" in record:
        return tuple(int(i) for i in tokenizer.encode(record["prompt"]))
    raise ValueError("a training JSONL line needs `messages` or `prompt`")


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
    """Greedy answers to ``prompts`` by the frozen model, cached in ``store``.

    Prompts whose id is already in ``store`` are not generated again. Prompt
    lookup stays on (greedy output is identical, only faster); MTP is off, since
    the head being trained does not exist yet. ``on_done(done, total)`` is
    called after each finished prompt.
    """
    cached = dict(_read_store(store))
    wanted = {p.record_id for p in prompts}
    missing = [p for p in prompts if p.record_id not in cached]
    if missing:
        engine = Engine.from_loaded(loaded, EngineConfig(max_batch=max_batch, mtp=False))
        eos = tuple(loaded.eos_token_ids)
        requests = (
            Request(
                p.record_id,
                p.prompt_ids,
                SamplingParams(max_tokens=p.max_tokens, eos_token_ids=eos),
            )
            for p in missing
        )
        store.parent.mkdir(parents=True, exist_ok=True)
        with store.open("a", encoding="utf-8") as out:
            for result in engine.generate(requests):
                if result.error is not None:
                    continue
                by_id = next(p for p in missing if p.record_id == result.request_id)
                line = {"id": by_id.record_id, "prompt_ids": list(by_id.prompt_ids)}
                line["output_ids"] = list(result.output_ids)
                out.write(json.dumps(line) + "\n")
                out.flush()
                cached[by_id.record_id] = TrainSequence(
                    by_id.prompt_ids + result.output_ids, loss_start=len(by_id.prompt_ids)
                )
                if on_done is not None:
                    on_done(sum(1 for k in cached if k in wanted), len(prompts))
    return [cached[p.record_id] for p in prompts if p.record_id in cached]


def _read_store(store: Path) -> Iterator[tuple[str, TrainSequence]]:
    if not store.exists():
        return
    for line in store.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by an interrupt: generated again
            continue
        prompt = tuple(record["prompt_ids"])
        yield record["id"], TrainSequence(prompt + tuple(record["output_ids"]), len(prompt))


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
