"""The hybrid family's MTP layer and whole runs of the engine on it.

The MTP reference is built independently from transformers' own layer
classes (``tests.support.hybrid_checkpoints.ReferenceMtp``): it feeds the
main model's final-normed hidden state, as vLLM does and as the released
layers were trained, and chains on its own normed output. Greedy output
equals transformers' ``generate`` with MTP and copies on and off, under both
draft policies and on both step paths; a checkpoint whose MTP layer is exact
by construction has every MTP draft accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.runtime.model import Segment
from metrale.lookup import PromptLookupConfig
from tests.support.checkpoints import EOS_ID, random_ids
from tests.support.hybrid_checkpoints import write_exact_mtp_checkpoint, write_hybrid_checkpoint
from tests.support.hybrid_references import (
    load_reference,
    reference_mtp_chain,
    reference_mtp_logits,
)

# Byte prompts, two of them repeating themselves so copies are proposed.
PROMPTS = [
    list(b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"),
    list(b"hello there"),
    list(b"abcabcabcabcabcabc"),
]
MAX_TOKENS = 14
# A random model rarely repeats a long n-gram: copy after any one token seen
# before, so copies are proposed, and mostly rejected, which is what a
# rollback must survive. No miss backoff, so they keep coming.
LOOKUP = PromptLookupConfig(ngram=1, min_match=1, max_drafts=8, miss_backoff=0)


def _load(path: Path, slots: int = 3) -> LoadedModel:
    return load_model(path, RuntimeConfig(device="cpu", num_slots=slots, max_len=160))


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next", "qwen3_5"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[str, list[int]]:
    """transformers' greedy continuation of every prompt, stopping at the ids
    metrale stops at."""
    model = load_reference(checkpoint)
    eos = list(_load(checkpoint, slots=1).eos_token_ids)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
            )
        out[str(i)] = ids[0, len(prompt) :].tolist()
    return out


def _run(loaded: LoadedModel, **config: object) -> tuple[dict[str, list[int]], Engine]:
    params = SamplingParams(max_tokens=MAX_TOKENS, eos_token_ids=(EOS_ID,))
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(PROMPTS)]
    engine = Engine.from_loaded(loaded, EngineConfig(max_batch=3, **config))  # type: ignore[arg-type]
    got = {r.request_id: list(r.output_ids) for r in engine.generate(requests)}
    return got, engine


def test_the_mtp_layer_takes_the_final_normed_hidden_as_the_reference_does(
    checkpoint: Path,
) -> None:
    loaded = _load(checkpoint, slots=1)
    assert loaded.info.mtp_layout == "qwen3_next" and len(loaded.mtp) == 1
    ids = random_ids(1, 24, seed=9)[0]
    out = loaded.model.forward([Segment(0, 0, ids.tolist())])
    drafted = loaded.mtp[0].forward([Segment(0, 0, ids[1:].tolist())], out.hidden[:-1])
    want = reference_mtp_logits(checkpoint, ids)
    torch.testing.assert_close(drafted.logits, want, rtol=0, atol=1e-4)
    raw = reference_mtp_logits(checkpoint, ids, hidden_source="raw")
    assert (drafted.logits - raw).abs().max() > 1e-2, "the raw hidden would give other drafts"


def test_mtp_chain_drafts_equal_the_reference_chain(checkpoint: Path) -> None:
    """After a prompt, the engine's drafter chains three drafts; they equal
    the reference's chain fed back on the layer's normed output."""
    loaded = _load(checkpoint, slots=1)
    ids = random_ids(1, 20, seed=10)[0]
    want = reference_mtp_chain(checkpoint, ids, depth=3)
    out = loaded.model.forward([Segment(0, 0, ids.tolist())], logits="last")
    token = int(out.logits[-1].argmax())
    module = loaded.mtp[0]
    feed = module.forward([Segment(0, 0, [*ids[1:].tolist(), token])], out.hidden, logits="last")
    drafts = [int(feed.logits[-1].argmax())]
    hidden = feed.hidden[-1:]
    for depth in range(1, 3):
        step = module.forward([Segment(0, len(ids) - 1 + depth, [drafts[-1]])], hidden)
        drafts.append(int(step.logits[-1].argmax()))
        hidden = step.hidden[-1:]
    assert drafts == want


@pytest.mark.parametrize("policy", ["fixed", "auto"])
@pytest.mark.parametrize(("mtp", "lookup"), [(True, True), (True, False), (False, True)])
def test_greedy_output_equals_transformers_generate(
    checkpoint: Path, expected: dict[str, list[int]], policy: str, mtp: bool, lookup: bool
) -> None:
    loaded = _load(checkpoint)
    cfg = LOOKUP if lookup else None
    # A random MTP layer is rarely sure of a draft: draft whatever its odds.
    got, engine = _run(loaded, mtp=mtp, prompt_lookup=cfg, draft_policy=policy, mtp_min_prob=0.0)
    assert got == expected
    stats = engine.stats()
    if mtp and policy == "fixed":
        assert stats.mtp_proposed > 0, "the MTP layer drafted"
    if lookup and policy == "fixed":
        assert stats.prompt_lookup.total.copies > 0, "copies were verified"


def test_the_device_step_gives_the_host_steps_output(
    checkpoint: Path, expected: dict[str, list[int]]
) -> None:
    loaded = _load(checkpoint)
    got, engine = _run(loaded, step_path="device", prompt_lookup=LOOKUP, mtp_min_prob=0.0)
    assert engine.step_path == "device"
    assert got == expected


def test_an_exact_mtp_layer_has_every_draft_accepted(tmp_path: Path) -> None:
    """The MTP layer of this checkpoint predicts the main model's token after
    next by construction: wired right, no MTP draft is ever rejected."""
    path = write_exact_mtp_checkpoint(tmp_path, "qwen3_5_moe")
    got, engine = _run(_load(path), draft_policy="fixed", prompt_lookup=None, mtp_min_prob=0.0)
    stats = engine.stats()
    assert stats.mtp_proposed > 3 * len(PROMPTS)
    assert stats.mtp_accepted == stats.mtp_proposed
    assert all(len(out) == MAX_TOKENS for out in got.values())


def test_two_mtp_layers_run_in_order_and_keep_the_output(tmp_path: Path) -> None:
    """``mtp_num_hidden_layers: 2``: modules share fc and norms, module ``i``
    runs ``mtp.layers.{i}``; drafting with both never changes the output."""
    path = write_hybrid_checkpoint(tmp_path, "qwen3_next", mtp_layers=2)
    loaded = _load(path)
    assert loaded.info.mtp_count == 2
    with_mtp, engine = _run(loaded, draft_policy="fixed", prompt_lookup=None, mtp_min_prob=0.0)
    assert engine.stats().mtp_proposed > 0
    without, _ = _run(_load(path), mtp=False, prompt_lookup=None)
    assert with_mtp == without
