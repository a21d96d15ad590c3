"""Logprobs are the model's raw log-probabilities, whatever the drafts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from metrale.engine.api import Grammar, Request, Result, SamplingParams, TokenLogprob
from metrale.engine.config import EngineConfig, MtpLadder
from metrale.engine.engine import Engine
from metrale.engine.logprobs import TokenBytes
from metrale.engine.spec.cost import CostModel
from metrale.lookup import PromptLookupConfig
from tests.support.fake_model import (
    CostedModel,
    FakeClock,
    FakeModel,
    FakeMtp,
    byte_decode,
    nearly_free_rows,
)
from tests.support.grammar_fakes import Vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [(0, 1, 2, 3, 0, 1, 2, 3, 0, 1), (5, 6, 7)]  # the first repeats: copies
TOP = 5


def results(policy: str | None, params: SamplingParams, max_batch: int = 8) -> dict[str, Result]:
    """Six requests with logprobs; ``policy`` None decodes without drafts."""
    clock = FakeClock()
    fake = CostedModel(vocab=12, num_slots=8, scale=2.0, seed=5, clock=clock, cost=nearly_free_rows)
    speculate = policy is not None
    config = EngineConfig(
        max_batch=max_batch,
        draft_policy=policy or "fixed",
        mtp_min_prob=0.0,
        mtp_ladder=MtpLadder(steps=((8, 3),), beyond=2),
        prompt_lookup=PromptLookupConfig(ngram=2, min_match=2, max_seqs=8, miss_backoff=0)
        if speculate
        else None,
    )
    mtp = [FakeMtp(fake, "mixed")] if speculate else []
    engine = Engine(fake, byte_decode, config, mtp=mtp, costs=CostModel(clock))
    stream = [
        Request(str(i), PROMPTS[i % 2], replace(params, seed=i, logprobs=TOP)) for i in range(6)
    ]
    return {r.request_id: r for r in engine.generate(stream)}


GREEDY = SamplingParams(max_tokens=14)
SAMPLED = SamplingParams(max_tokens=14, temperature=0.7, top_k=4, top_p=0.9)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_are_a_float32_log_softmax_of_the_models_logits(params: SamplingParams) -> None:
    rule = FakeModel(vocab=12, seed=5, scale=2.0)
    for result in results("fixed", params).values():
        assert result.logprobs is not None
        assert len(result.logprobs) == len(result.output_ids)
        history = list(PROMPTS[int(result.request_id) % 2])
        for token, entry in zip(result.output_ids, result.logprobs, strict=True):
            # Raw: before temperature, top-k and top-p.
            expected = torch.log_softmax(rule.next_logits(history).float(), dim=-1)
            assert entry.token_id == token
            assert abs(entry.logprob - float(expected[token])) < 1e-4
            ids = [i for i, _ in entry.top]
            values = [v for _, v in entry.top]
            assert ids == torch.topk(expected, TOP).indices.tolist()
            assert values == sorted(values, reverse=True), "likeliest first"
            assert all(abs(v - float(expected[i])) < 1e-4 for i, v in entry.top)
            history.append(token)
        # Each token the logprobs name is spelled.
        named = {e.token_id for e in result.logprobs} | {
            i for e in result.logprobs for i, _ in e.top
        }
        assert {i: result.token_bytes[i] for i in named} == {
            i: byte_decode([i]).encode() for i in named
        }


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logprobs_are_the_same_with_and_without_drafts(params: SamplingParams) -> None:
    def logprobs(policy: str | None, max_batch: int = 8) -> dict[str, tuple[TokenLogprob, ...]]:
        return {k: r.logprobs or () for k, r in results(policy, params, max_batch).items()}

    plain = logprobs(None)
    assert logprobs("fixed") == plain
    assert logprobs("auto", max_batch=3) == plain


def test_a_request_without_logprobs_gets_none_and_its_text_no_eos_entry() -> None:
    fake = FakeModel(vocab=12, seed=5, scale=2.0)
    engine = Engine(fake, byte_decode, EngineConfig(mtp=False), eos_token_ids=(3,))
    stream = [
        Request("plain", PROMPTS[0], SamplingParams(max_tokens=30)),
        Request("asked", PROMPTS[0], SamplingParams(max_tokens=30, logprobs=0)),
    ]
    out = {r.request_id: r for r in engine.generate(stream)}
    assert out["plain"].logprobs is None and out["plain"].token_bytes == {}
    asked = out["asked"]
    assert asked.logprobs is not None and all(e.top == () for e in asked.logprobs)
    # One entry a token of the text: an EOS that ended it has none.
    ended_by_eos = asked.output_ids[-1] == 3
    assert len(asked.logprobs) == len(asked.output_ids) - ended_by_eos


def test_a_grammar_masks_the_choice_not_the_logprobs() -> None:
    vocab = Vocabulary(("", "a", "b", "c"))
    fake = FakeModel(vocab=vocab.size, seed=3, scale=1.0)
    config = EngineConfig(mtp=False)
    engine = Engine(fake, vocab.decode, config, eos_token_ids=(0,), grammars=vocab.compiler())
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=4, logprobs=3)
    (result,) = engine.generate([Request("g", (1, 2, 3), params, grammar=Grammar("regex", "b+"))])
    assert result.error is None and result.logprobs is not None and set(result.text) == {"b"}
    history = [1, 2, 3]
    for entry in result.logprobs:
        raw = torch.log_softmax(fake.next_logits(history).float(), dim=-1)
        assert abs(entry.logprob - float(raw[entry.token_id])) < 1e-4  # not 0.0, the masked one
        history.append(entry.token_id)


def test_token_bytes_follow_a_byte_level_tokenizer(tmp_path: object) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.BPE(vocab={"a": 0, "Ġ": 1, "Ã": 2, "©": 3, "ðŁ": 4}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()

    class Wrapped:
        backend_tokenizer = backend

    spell = TokenBytes(Wrapped(), lambda ids: backend.decode(list(ids))).spell
    assert [spell(i) for i in range(5)] == [b"a", b" ", b"\xc3", b"\xa9", b"\xf0\x9f"]
