"""Properties of MTP head training (``metrale.engine.train.trainer``) on tiny random models,
and of the head shipped for the default model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.loader import HEADS_DIR, LoadedModel, load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.mtp_head import load_mtp_head, save_mtp_head
from metrale.engine.train.data import (
    PromptRecord,
    TrainSequence,
    generate_continuations,
    read_jsonl,
    text_sequences,
)
from metrale.engine.train.head import TrainableHead
from metrale.engine.train.trainer import (
    TrainConfig,
    Trainer,
    cache_sequences,
    draft_vocabulary,
    evaluate,
    train_mtp,
)
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "qwen2")
    return load_model(path, RuntimeConfig(num_slots=2, max_len=MAX_LEN, dtype="float32"))


def model_of(loaded: LoadedModel) -> LlamaModel:
    assert isinstance(loaded.model, LlamaModel)
    return loaded.model


def corpus(num: int = 6, length: int = 64, seed: int = 0) -> list[TrainSequence]:
    """Repetitive byte text: enough structure for a head to learn in a few steps."""
    gen = torch.Generator().manual_seed(seed)
    words = [torch.randint(97, 123, (4,), generator=gen).tolist() for _ in range(5)]
    out = []
    for _ in range(num):
        picks = torch.randint(0, len(words), (length // 5 + 1,), generator=gen).tolist()
        ids = [t for w in picks for t in [*words[w], 32]][:length]
        out.append(TrainSequence(tuple(ids), loss_start=4))
    return out


def small_config(**overrides: object) -> TrainConfig:
    fields: dict[str, object] = dict(
        epochs=4, batch_tokens=120, lr=3e-3, warmup_steps=2, heldout=0.0, eval_every=0
    )
    fields.update(overrides)
    return TrainConfig(**fields)  # type: ignore[arg-type]


def test_training_lowers_loss_and_raises_agreement_on_the_training_text(
    tiny: LoadedModel,
) -> None:
    model = model_of(tiny)
    cached = cache_sequences(model, corpus())
    trainer = Trainer(model, cached, small_config(epochs=8, feature_weight=0.5))
    before = evaluate(trainer.head, cached, 1).accepted[0]
    losses = [trainer.run_step()[0] for _ in range(trainer.total_steps)]
    after = evaluate(trainer.head, cached, 1).accepted[0]
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert after > before + 0.2, (before, after)


def test_the_target_is_the_models_own_prediction_two_tokens_ahead(tiny: LoadedModel) -> None:
    model = model_of(tiny)
    seq = corpus(num=1)[0]
    (cached,) = cache_sequences(model, [seq])
    out = model.forward([Segment(0, 0, list(seq.token_ids))], logits="all")
    # targets[p] is the model's argmax at position p + 1, i.e. its guess at token p + 2
    assert torch.equal(cached.targets, out.logits.argmax(-1)[1:])
    assert cached.next_ids.tolist() == list(seq.token_ids[1:])
    assert cached.first == seq.loss_start - 1


def test_a_saved_head_reloads_to_identical_outputs(tiny: LoadedModel, tmp_path: Path) -> None:
    model = model_of(tiny)
    result = train_mtp(model, corpus(), small_config(max_steps=3))
    path = tmp_path / "head"
    save_mtp_head(path, result.tensors, model.spec, base_model="tiny", fields={"steps": 3})
    layer = load_mtp_head(path, model)
    head = TrainableHead(model, seed=1)
    head.load_tensors(result.tensors)
    ids = list(corpus(num=1, seed=3)[0].token_ids[:40])
    main = model.forward([Segment(1, 0, ids)], logits="all")
    runtime = layer.forward([Segment(1, 0, ids[1:])], main.hidden[:-1])
    with torch.no_grad():
        trained = head.logits(head(torch.tensor(ids[1:]), main.hidden[:-1]))
    torch.testing.assert_close(runtime.logits, trained, atol=1e-4, rtol=1e-4)
    again = load_mtp_head(path, model).forward([Segment(1, 0, ids[1:])], main.hidden[:-1])
    assert torch.equal(runtime.logits, again.logits)


def test_chain_evaluation_matches_the_runtimes_chain_drafting(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    model = model_of(tiny)
    result = train_mtp(model, corpus(), small_config(max_steps=2))
    head = TrainableHead(model, seed=1)
    head.load_tensors(result.tensors)
    save_mtp_head(tmp_path / "head", result.tensors, model.spec, base_model="tiny")  # float32
    layer = load_mtp_head(tmp_path / "head", model)
    ids = list(corpus(num=1, seed=5)[0].token_ids[:30])
    main = model.forward([Segment(0, 0, ids)], logits="all")
    drafts = head.chain_drafts(torch.tensor(ids[1:]), main.hidden[:-1], depth=3)
    later = head.chain_drafts(torch.tensor(ids[1:]), main.hidden[:-1], depth=3, start=10)
    assert torch.equal(later, drafts[:, 10:])
    for p in (3, 10, 20):
        # The runtime feeds verified positions 0..p, then chains on its own outputs.
        out = layer.forward([Segment(0, 0, ids[1 : p + 2])], main.hidden[: p + 1], "last")
        chain = [int(out.logits[0].argmax())]
        hidden = out.hidden[-1:]
        for d in range(1, 3):
            out = layer.forward([Segment(0, p + d, [chain[-1]])], hidden, "last")
            chain.append(int(out.logits[0].argmax()))
            hidden = out.hidden[-1:]
        assert chain == drafts[:, p].tolist(), p


def test_the_same_seed_gives_the_same_head(tiny: LoadedModel) -> None:
    model = model_of(tiny)
    first = train_mtp(model, corpus(), small_config(max_steps=3, seed=7)).tensors
    second = train_mtp(model, corpus(), small_config(max_steps=3, seed=7)).tensors
    other = train_mtp(model, corpus(), small_config(max_steps=3, seed=8)).tensors
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_resuming_from_a_checkpoint_continues_the_same_run(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    model = model_of(tiny)
    whole = train_mtp(model, corpus(), small_config(epochs=2), tmp_path / "whole")
    work = tmp_path / "interrupted"
    cut = train_mtp(model, corpus(), small_config(epochs=2, max_steps=3), work)
    assert cut.steps == 3 < whole.steps
    resumed = train_mtp(model, corpus(), small_config(epochs=2), work)
    assert resumed.steps == whole.steps
    assert all(torch.equal(whole.tensors[k], resumed.tensors[k]) for k in whole.tensors)


def test_heldout_sequences_are_never_trained_on(tiny: LoadedModel) -> None:
    model = model_of(tiny)
    data = corpus(num=10)
    result = train_mtp(model, data, small_config(heldout=0.3, max_steps=1))
    assert result.heldout_eval is not None and result.heldout_eval.positions > 0
    trained = sum(len(s.token_ids) - s.loss_start for s in data)
    assert result.train_tokens + result.heldout_tokens == trained
    assert result.heldout_tokens == sum(len(s.token_ids) - s.loss_start for s in data[:3])


def test_text_and_jsonl_sources(tiny: LoadedModel, tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("abcdefghij" * 5)
    windows = text_sequences(text, tiny.tokenizer, window=16)
    assert [len(w.token_ids) for w in windows] == [16, 16, 16]  # the 2-token tail is dropped
    lines = tmp_path / "p.jsonl"
    lines.write_text(
        '{"prompt": "hi", "completion": " there"}\n{"id": "q", "prompt": "why", "max_tokens": 5}\n'
    )
    done, todo = read_jsonl(lines, tiny.tokenizer)
    assert done[0].loss_start == len(tiny.tokenizer.encode("hi"))
    assert [(p.record_id, p.max_tokens) for p in todo] == [("q", 5)]


def test_generated_answers_carry_the_hidden_states_a_forward_computes(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    model = model_of(tiny)
    prompts = [
        PromptRecord(f"p{i}", tuple(s.token_ids[:20]), max_tokens=12)
        for i, s in enumerate(corpus(num=3, seed=11))
    ]
    store = tmp_path / "generated.jsonl"
    sequences = generate_continuations(tiny, prompts, store, max_batch=2)
    assert len(sequences) == 3
    for seq, prompt in zip(sequences, prompts, strict=True):
        assert seq.token_ids[:20] == prompt.prompt_ids and seq.loss_start == 20
        assert seq.hidden is not None
        fresh = model.forward([Segment(0, 0, list(seq.token_ids[:-1]))], "all")
        torch.testing.assert_close(seq.hidden.float(), fresh.hidden, atol=0.05, rtol=0.02)
        # greedy: the model's argmax at each answer position is the next token
        assert fresh.logits[19:].argmax(-1).tolist() == list(seq.token_ids[20:])
        # and prompt positions carry the model's own argmax too
        assert seq.predicted is not None
        assert seq.predicted.tolist() == fresh.logits.argmax(-1).tolist()
    calls: list[int] = []
    again = generate_continuations(tiny, prompts, store, on_done=lambda d, t: calls.append(d))
    assert not calls, "stored answers are not generated again"
    assert [s.token_ids for s in again] == [s.token_ids for s in sequences]
    assert all(
        a.hidden is not None and b.hidden is not None and torch.equal(a.hidden, b.hidden)
        for a, b in zip(again, sequences, strict=True)
    )
    # A prompt edited under the same id is answered anew, not served the old answer.
    edited = [prompts[0], replace(prompts[1], prompt_ids=prompts[1].prompt_ids[:15]), prompts[2]]
    anew = generate_continuations(tiny, edited, store, on_done=lambda d, t: calls.append(d))
    assert len(calls) == 1 and anew[1].loss_start == 15
    assert anew[1].token_ids[:15] == edited[1].prompt_ids
    reread = generate_continuations(tiny, edited, store)  # the newer line wins
    assert [s.token_ids for s in reread] == [s.token_ids for s in anew]
    assert reread[1].hidden is not None and anew[1].hidden is not None
    assert torch.equal(reread[1].hidden, anew[1].hidden)


@pytest.mark.slow
def test_the_shipped_head_loads_with_the_default_model_and_drafts() -> None:
    if not (HEADS_DIR / "smollm2-135m-instruct.safetensors").exists():
        pytest.fail("the shipped head engine/heads/smollm2-135m-instruct.safetensors is missing")
    loaded = load_model(None, RuntimeConfig(num_slots=1, max_len=128))
    assert loaded.info.mtp_layout == "head" and len(loaded.mtp) == 1
    assert loaded.info.mtp_draft_vocab == 8192  # the LM head rows it drafts from
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about the sea."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    if not isinstance(prompt, list):
        prompt = prompt["input_ids"]
    params = SamplingParams(max_tokens=12, eos_token_ids=loaded.eos_token_ids)
    request = Request("r", tuple(prompt), params)
    # The fixed policy: under auto whether a chain drafts at all follows
    # this machine's timings of the head.
    config = EngineConfig(max_batch=1, prompt_lookup=None, draft_policy="fixed")
    engine = Engine.from_loaded(loaded, config)
    (result,) = list(engine.generate([request]))
    stats = engine.stats()
    assert stats.mtp_proposed > 0 and stats.mtp_accepted > 0
    plain = Engine.from_loaded(loaded, EngineConfig(max_batch=1, prompt_lookup=None, mtp=False))
    (expected,) = list(plain.generate([request]))
    assert result.output_ids == expected.output_ids


def test_the_draft_vocabulary_ranks_answers_then_prompts_then_low_ids() -> None:
    sequences = [
        TrainSequence((9, 8, 5, 5, 7), loss_start=2),  # prompt 9 8, answer 5 5 7
        TrainSequence((8, 6, 7, 5), loss_start=2),  # prompt 8 6, answer 7 5
    ]
    assert draft_vocabulary(sequences, 2, 20).tolist() == [5, 7]  # answers, most frequent
    assert draft_vocabulary(sequences, 3, 20).tolist() == [5, 7, 8]  # then the prompts
    assert draft_vocabulary(sequences, 7, 20).tolist() == [0, 1, 5, 6, 7, 8, 9]  # then low ids
    assert draft_vocabulary(sequences, 50, 20).tolist() == list(range(20))


def test_the_command_writes_a_head_and_card_that_load(tiny: LoadedModel, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from metrale.cli.main import app

    model_dir = tmp_path / "model"
    write_tiny_checkpoint(model_dir, "qwen2")
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 12)
    out = tmp_path / "heads" / "tiny"
    args = ["train-mtp", "--model", str(model_dir), "--data", str(text), "--out", str(out)]
    args += ["--epochs", "2", "--batch-tokens", "64", "--heldout", "0.3", "--max-len", "64"]
    args += ["--draft-vocab", "40"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    card = json.loads(out.with_suffix(".json").read_text())
    fields = card["fields"]
    assert fields["data"] == ["notes.txt"] and fields["steps"] > 0
    assert len(fields["heldout_acceptance_by_depth"]) == 3
    assert fields["draft_vocab"] == 40
    head = load_mtp_head(out, model_of(tiny))
    assert head.draft_vocab is not None and head.draft_vocab.numel() == 40
    missing = CliRunner().invoke(app, [*args[:4], "--data", "nope.txt", "--out", str(out)])
    assert missing.exit_code == 2
    # The head drafts for its model through `generate --mtp-head`, output
    # unchanged. The fixed policy: under auto whether a chain drafts at all
    # follows this machine's timings of the head.
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "the quick brown fox"}\n{"prompt": "over the lazy"}\n')
    base = ["generate", str(src), "--model", str(model_dir), "--max-tokens", "12"]
    base += ["--no-prompt-lookup", "--dtype", "float32", "--draft-policy", "fixed"]
    texts, proposed = {}, {}
    for name, extra in {"plain": ["--no-mtp"], "head": ["--mtp-head", str(out)]}.items():
        stats = tmp_path / f"{name}.json"
        ran = CliRunner().invoke(
            app, [*base, *extra, "--mtp-min-prob", "0", "--stats-json", str(stats)]
        )
        assert ran.exit_code == 0, ran.output
        texts[name] = [json.loads(line)["text"] for line in ran.stdout.splitlines()]
        proposed[name] = json.loads(stats.read_text())["mtp"]["proposed"]
    assert texts["head"] == texts["plain"] and len(texts["plain"]) == 2
    assert proposed["plain"] == 0 and proposed["head"] > 0
    wide = {"COLUMNS": "400"}  # the error box would fold the path
    refused = CliRunner().invoke(app, [*base, "--mtp-head", str(tmp_path / "no")], env=wide)
    assert refused.exit_code == 2, refused.output
    assert "--mtp-head" in refused.output and "no.safetensors not found" in refused.output
