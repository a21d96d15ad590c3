"""Runs of the engine the test modules share: the fake model's prompts and
prompt-lookup settings, the tiny checkpoints' text prompts, requests built
from prompts, outputs by request id, greedy outputs of a loaded checkpoint
and its twin, and the check that an engine's figures add up to its
results'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from metrale.engine.api import Request, Result, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.lookup import PromptLookupConfig

if TYPE_CHECKING:
    from metrale.engine.load.loader import LoadedModel

# Mixed lengths; some repeat themselves so prompt lookup finds copies.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3],
    [5],
    [3, 3, 7, 0, 12, 4, 9, 2, 2, 8, 11, 6],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3, 2],
    [14, 2],
    [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4],
    [6, 1, 15, 10],
    [2, 13, 0, 7, 7, 1, 2, 13, 0, 7, 7, 1, 2, 13],
]
LOOKUP = PromptLookupConfig(ngram=2, min_match=3, max_drafts=8)

# Text prompts for the tiny checkpoints' byte tokenizer.
CHECKPOINT_PROMPTS = ["def f(x):\n    return x", "abcabcabcabc", "hello", 'JSON {"a": 1, "b": 2}']
# Token prompts a GGUF file and its safetensors twin both decode.
TWIN_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42], list(range(60, 90))]


def requests(
    prompts: Sequence[Sequence[int]], max_tokens: int = 30, **params: object
) -> list[Request]:
    return [
        Request(str(i), tuple(p), SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]


def outputs(results: Sequence[Result]) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_ids) for r in results}


def check_figures_add_up(engine: Engine, results: Sequence[Result]) -> None:
    stats = engine.stats()
    assert stats.seq_verifies == sum(r.stats.verifies for r in results)
    assert stats.verify_tokens == sum(r.stats.verify_tokens for r in results)
    assert (
        stats.prompt_lookup.total.copies
        == sum(r.stats.prompt_lookup.total.copies for r in results)
        > 0
    )
    assert stats.mtp_proposed == sum(r.stats.mtp_proposed for r in results) > 0
    assert stats.mtp_accepted == sum(r.stats.mtp_accepted for r in results)
    accepted = stats.mtp_accepted + stats.prompt_lookup.total.accepted
    assert stats.verify_tokens == stats.seq_verifies + accepted
    assert list(stats.mtp_accepted_by_position) == sorted(
        stats.mtp_accepted_by_position, reverse=True
    )


def twin_greedy(loaded: LoadedModel, lookup: bool = False) -> dict[str, tuple[int, ...]]:
    """Greedy outputs of ``TWIN_PROMPTS`` on ``loaded``, without MTP."""
    config = EngineConfig(
        max_batch=3, mtp=False, prompt_lookup=PromptLookupConfig(min_match=2) if lookup else None
    )
    engine = Engine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=20)
    stream = (Request(str(i), tuple(p), params) for i, p in enumerate(TWIN_PROMPTS))
    return {r.request_id: r.output_ids for r in engine.generate(stream)}
