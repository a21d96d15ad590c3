"""MTP layers of the MoE families in the DeepSeek layout, against transformers' MtpModel.

The checkpoint's MTP layers are drawn in transformers' own ``MtpModel`` (the
module ``generate(use_mtp=True)`` drafts with) and written under the public
keys a hub checkpoint uses: ``model.layers.{num_hidden_layers + i}.{enorm,
hnorm, eh_proj, shared_head.norm}`` and the full block (MLA or GQA attention,
MoE experts under their per-expert keys) beside them. With two layers
(``num_nextn_predict_layers: 2``) they run in order, layer 1 one position
ahead on layer 0's output, as ``MtpModel.forward`` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.model import Segment
from metrale.engine.sequence import SeqState
from metrale.engine.spec.mtp import DraftFeed, MtpDrafter
from metrale.engine.stats import EngineStats
from metrale.lookup import PromptLookupConfig
from tests.support.checkpoints import EOS_ID
from tests.support.moe_checkpoints import write_with_mtp

FAMILIES = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def with_mtp(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, Any]:
    """A checkpoint with one MTP layer, and transformers' model and MtpModel of it."""
    return write_with_mtp(tmp_path_factory.mktemp(request.param), request.param, 1)


@pytest.fixture(scope="module", params=FAMILIES)
def with_two_mtp(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, Any]:
    """A checkpoint with two MTP layers, and transformers' model and MtpModel of them."""
    return write_with_mtp(tmp_path_factory.mktemp(request.param), request.param, 2)


def reference_drafts(model: Any, mtp: Any, history: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' MtpModel drafts, one per layer, after ``history`` (tokens
    ``0..L``, token ``L`` not yet fed to the main model), from scratch: the
    main model's pre-norm hidden rows ``0..L-1``, then every layer in order.
    Returns the drafts and their logits ``[num_layers, vocab]``."""
    captured: dict[str, torch.Tensor] = {}

    def keep_pre_norm(_module: Any, args: tuple[torch.Tensor, ...], _out: Any) -> None:
        captured["h"] = args[0]  # returns None: the norm's output stays the model's

    hook = model.model.norm.register_forward_hook(keep_pre_norm)
    with torch.no_grad():
        model(torch.tensor([history[:-1]]))
        hook.remove()
        drafts, logits, _ = mtp(
            input_ids=torch.tensor([history[1:]]),
            last_hidden_states=captured["h"],
            attention_mask=None,
            position_ids=torch.arange(len(history) - 1)[None],
            mtp_cache=None,
        )
    assert drafts[0].tolist() == logits[0].argmax(dim=-1).tolist(), "greedy drafts are argmaxes"
    return drafts[0].tolist(), logits[0]


def reference_first_draft(model: Any, mtp: Any, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """transformers' greedy token after ``prompt``, then its MTP module's draft
    of the token after that, with its logits ``[vocab]``."""
    with torch.no_grad():
        token = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    _, logits = reference_drafts(model, mtp, [*prompt, token])
    return token, logits[0]


def test_the_first_mtp_draft_equals_transformers_mtp_module(
    with_mtp: tuple[Path, Any, Any],
) -> None:
    path, model, mtp = with_mtp
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=2, max_len=96))
    assert len(loaded.mtp) == 1 and loaded.info.mtp_layout == "deepseek"
    for n in (6, 13, 21):
        prompt = prompt_of(n)
        token, expected = reference_first_draft(model, mtp, prompt)
        main = loaded.model.forward([Segment(0, 0, prompt)])
        assert int(main.logits[-1].argmax()) == token
        ours = loaded.mtp[0].forward([Segment(0, 0, [*prompt[1:], token])], main.hidden, "last")
        assert (ours.logits[0] - expected).abs().max().item() <= 1e-4
        assert int(ours.logits[0].argmax()) == int(expected.argmax())


def prompt_of(n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def greedy_with_and_without_mtp(path: Path) -> tuple[dict[bool, dict[str, Any]], EngineStats]:
    """Greedy outputs of three prompts by MTP on and off, and the figures of the run with it."""
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=3, max_len=128))
    params = SamplingParams(max_tokens=24, eos_token_ids=(EOS_ID,))
    requests = [Request(str(n), tuple(prompt_of(n)), params) for n in (5, 11, 17)]
    outputs: dict[bool, dict[str, Any]] = {}
    stats = []
    # With MTP under the fixed ladder (whose figures the callers check), then
    # under the draft budget, then without: all three must agree.
    for mtp_on, policy in ((True, "fixed"), (True, "auto"), (False, "fixed")):
        config = EngineConfig(
            max_batch=3, mtp=mtp_on, mtp_min_prob=0.0, prompt_lookup=None, draft_policy=policy
        )
        engine = Engine.from_loaded(loaded, config)
        run = {r.request_id: r.output_ids for r in engine.generate(requests)}
        if mtp_on and policy == "auto":
            assert run == outputs[True], "the draft budget changed greedy output"
        else:
            outputs[mtp_on] = run
        stats.append(engine.stats())
    return outputs, stats[0]


def test_greedy_output_with_mtp_equals_without(with_mtp: tuple[Path, Any, Any]) -> None:
    outputs, stats = greedy_with_and_without_mtp(with_mtp[0])
    assert stats.mtp_proposed > 0
    assert outputs[True] == outputs[False]


def test_the_drafts_after_a_prefill_equal_transformers_mtp_model_layer_by_layer(
    with_two_mtp: tuple[Path, Any, Any],
) -> None:
    path, model, mtp = with_two_mtp
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=2, max_len=96))
    assert len(loaded.mtp) == 2
    drafter = MtpDrafter(loaded.mtp)
    for n in (6, 13, 21):
        prompt = prompt_of(n)
        main = loaded.model.forward([Segment(0, 0, prompt)])
        token = int(main.logits[-1].argmax())
        expected, expected_logits = reference_drafts(model, mtp, [*prompt, token])
        seq = SeqState(
            Request("r", tuple(prompt), SamplingParams(max_tokens=8)),
            0,
            96,
            frozenset(),
            None,
            None,
            history=[*prompt, token],
            seq_len=n,
        )
        drafter.feed_and_draft([DraftFeed(seq, 0, [*prompt[1:], token], 3)], main.hidden)
        # Two layers draft two tokens, though three were asked for.
        assert seq.pending_drafts == expected
        # Layer by layer on slot 1: layer 1 reads layer 0's rows and d_1. transformers
        # rotates its row p at p + 1, metrale at p: the scores are the same.
        next_ids = [*prompt[1:], token]
        first = loaded.mtp[0].forward([Segment(1, 0, next_ids)], main.hidden, "all")
        second = loaded.mtp[1].forward(
            [Segment(1, 0, [*next_ids[1:], expected[0]])], first.hidden, "last"
        )
        assert (first.logits[-1] - expected_logits[0]).abs().max().item() <= 1e-4
        assert (second.logits[0] - expected_logits[1]).abs().max().item() <= 1e-4


def test_drafts_after_engine_steps_equal_a_recomputation_from_the_verified_prefix(
    with_two_mtp: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copies are accepted now and then, so feeds of several rows (and, with a
    # short prefill chunk, prompts fed in pieces) reach the drafter as well.
    path, model, mtp = with_two_mtp
    loaded = load_model(path, RuntimeConfig(device="cpu", num_slots=3, max_len=128))
    seen: list[tuple[list[int], list[int]]] = []
    verified_rows: list[int] = []  # rows of each feed after a verify
    feed_and_draft = MtpDrafter.feed_and_draft

    def recording(self: MtpDrafter, feeds: Sequence[DraftFeed], hidden: torch.Tensor) -> None:
        feed_and_draft(self, feeds, hidden)
        for f in feeds:
            if f.start >= f.seq.prompt_len:
                verified_rows.append(len(f.next_ids))
            if f.num_drafts > 0:
                seen.append((f.seq.history[: f.end + 1], list(f.seq.pending_drafts)))

    monkeypatch.setattr(MtpDrafter, "feed_and_draft", recording)
    lookup = PromptLookupConfig(ngram=2, min_match=2)
    config = EngineConfig(
        max_batch=3, mtp_min_prob=0.0, prefill_chunk=8, prompt_lookup=lookup, draft_policy="fixed"
    )
    engine = Engine.from_loaded(loaded, config)
    prompts = [prompt_of(5), prompt_of(17), [7, 8, 9, 10] * 5]
    params = SamplingParams(max_tokens=32, eos_token_ids=(EOS_ID,))
    list(engine.generate([Request(str(i), tuple(p), params) for i, p in enumerate(prompts)]))
    assert max(verified_rows) > 1 and engine.stats().prefills > len(prompts)
    assert max(len(drafts) for _, drafts in seen) == 2 and len(seen) > 30
    for history, drafts in seen:
        assert drafts == reference_drafts(model, mtp, history)[0][: len(drafts)]


def test_greedy_output_with_two_mtp_layers_equals_without(
    with_two_mtp: tuple[Path, Any, Any],
) -> None:
    outputs, stats = greedy_with_and_without_mtp(with_two_mtp[0])
    proposed = stats.mtp_proposed_by_position
    assert len(proposed) == 2 and proposed[1] > 0  # one draft per layer, no more
    assert outputs[True] == outputs[False]
