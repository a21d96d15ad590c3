"""The device step, forced on the CPU: same outputs as the host step, one readback a step.

The device-style path (``EngineConfig(step_path="device")``) runs the code a
GPU runs, in torch ops on the CPU; what it must show here is what the issue
asks of it: greedy output identical to the host step's (itself identical to
transformers'), MTP drafts equal to the host drafter's wherever both draft
at the same position, a sampled run reproducible by its seed, and exactly one
device-to-host read and no blocking upload per decode step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from metrale.engine.api import Grammar, Request, SamplingParams
from metrale.engine.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.runtime.mtp import detect_mtp, load_checkpoint_mtp
from metrale.engine.runtime.syncs import count_syncs
from metrale.engine.step.device_verify import MAX_WIDTH
from tests.support.checkpoints import (
    EOS_ID,
    build_runtime,
    load_reference_model,
    random_ids,
    write_tiny_checkpoint,
)
from tests.support.moe_checkpoints import write_moe_checkpoint, write_with_mtp

MAX_LEN = 96


def _engine(
    path: Path, step_path: str, slots: int = 4, eos: tuple[int, ...] = (EOS_ID,), **config: Any
) -> Engine:
    ckpt = read_checkpoint(path)
    model = build_runtime(path, num_slots=slots, max_len=MAX_LEN, headroom=MAX_WIDTH)
    found = detect_mtp(ckpt.raw_config, ckpt.weights.names(), ckpt.spec.num_layers)
    mtp = load_checkpoint_mtp(model, ckpt.weights, found) if found else []
    # A random module is rarely sure of a draft: chain whatever it gives.
    config.setdefault("mtp_min_prob", 0.0)
    config.setdefault("draft_policy", "fixed")
    settings = EngineConfig(step_path=step_path, max_batch=slots, **config)
    return Engine(model, None, settings, mtp=mtp, eos_token_ids=eos)


def _requests(count: int, params: SamplingParams, repeat: bool = False) -> list[Request]:
    ids = random_ids(count, 24, seed=11).tolist()
    requests = []
    for i, row in enumerate(ids):
        # Repeated text gives prompt lookup copies to take.
        prompt = (row[:6] * 4)[: 8 + i] if repeat else row[: 5 + 3 * i]
        requests.append(Request(request_id=f"r{i}", prompt_ids=prompt, params=params))
    return requests


def _outputs(engine: Engine, requests: list[Request]) -> dict[str, tuple[int, ...]]:
    return {r.request_id: r.output_ids for r in engine.generate(requests)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device")
    return {
        "llama": write_tiny_checkpoint(root / "llama", "llama"),
        "qwen3": write_tiny_checkpoint(root / "qwen3", "qwen3"),
        "mimo": write_tiny_checkpoint(root / "mimo", "qwen2", mtp_layout="mimo"),
    }


@pytest.mark.parametrize("family", ["llama", "qwen3", "mimo"])
@pytest.mark.parametrize("lookup", [True, False])
def test_greedy_output_equals_the_host_step(
    family: str, lookup: bool, checkpoints: dict[str, Path]
) -> None:
    params = SamplingParams(max_tokens=20)
    config: dict[str, Any] = {} if lookup else {"prompt_lookup": None}
    requests = _requests(6, params, repeat=lookup)  # 6 requests over 4 slots: reuse
    host = _engine(checkpoints[family], "host", **config)
    want = _outputs(host, requests)
    engine = _engine(checkpoints[family], "device", **config)
    assert engine.step_path == "device"
    assert _outputs(engine, requests) == want
    stats = engine.stats()
    if family == "mimo":
        assert stats.mtp_proposed > 0, "the device chain drafted"
    else:
        # Without MTP both steps take the same copies.
        assert stats.prompt_lookup == host.stats().prompt_lookup
    if lookup and family == "llama":
        assert stats.prompt_lookup.total.accepted > 0, "copies were verified and kept"


def test_mtp_on_equals_mtp_off_on_the_device_step(checkpoints: dict[str, Path]) -> None:
    requests = _requests(4, SamplingParams(max_tokens=24))
    on = _outputs(_engine(checkpoints["mimo"], "device"), requests)
    off = _outputs(_engine(checkpoints["mimo"], "device", mtp=False), requests)
    assert on == off


def _drafts_by_position(
    engine: Engine, requests: list[Request]
) -> dict[tuple[str, int], list[int]]:
    """The MTP drafts each verify checked, by (request, seq_len)."""
    seen: dict[tuple[str, int], list[int]] = {}
    step = engine._path
    verify = step._verify  # type: ignore[attr-defined]

    def traced(batch: Any, *rest: Any) -> Any:
        for seq in batch:
            if seq.pending_drafts:
                seen[(seq.request.request_id, seq.seq_len)] = list(seq.pending_drafts)
        return verify(batch, *rest)

    step._verify = traced  # type: ignore[attr-defined]
    list(engine.generate(requests))
    return seen


@pytest.mark.parametrize("min_prob", [0.0, 0.02, 0.5])
def test_the_device_chain_drafts_what_the_host_drafter_drafts(
    min_prob: float, checkpoints: dict[str, Path]
) -> None:
    requests = _requests(3, SamplingParams(max_tokens=24))
    config: dict[str, Any] = {"prompt_lookup": None, "mtp_min_prob": min_prob}
    host = _drafts_by_position(_engine(checkpoints["mimo"], "host", **config), requests)
    device = _drafts_by_position(_engine(checkpoints["mimo"], "device", **config), requests)
    shared = set(host) & set(device)
    if min_prob < 0.5:
        assert len(shared) >= 10, "both paths drafted at many of the same positions"
    else:
        assert not host and not device, "no draft of a random module is that sure"
    for key in shared:
        assert device[key] == host[key], key


def _syncs_per_decode_step(engine: Engine) -> list[tuple[int, int]]:
    """(readbacks, blocking uploads) of each decode step of four requests,
    after the step that admits and prefills them all."""
    engine._queues.waiting.extend(_requests(4, SamplingParams(max_tokens=16), repeat=True))
    engine._step()  # admission and prefill: every prompt fits one chunk
    assert not engine._queues.prefilling
    counts: list[tuple[int, int]] = []
    while engine._queues.decoding:
        with count_syncs() as syncs:
            engine._step()
        counts.append((syncs.readbacks, syncs.uploads))
    return counts


def test_one_readback_and_no_blocking_upload_per_decode_step(
    checkpoints: dict[str, Path],
) -> None:
    engine = _engine(checkpoints["mimo"], "device")
    counts = _syncs_per_decode_step(engine)
    assert len(counts) >= 5
    assert set(counts) == {(1, 0)}, counts
    assert engine.stats().mtp_proposed > 0 and engine.stats().prompt_lookup.total.proposed > 0


def test_a_prefill_step_reads_back_once_too(checkpoints: dict[str, Path]) -> None:
    engine = _engine(checkpoints["llama"], "device")
    engine._queues.waiting.extend(_requests(2, SamplingParams(max_tokens=8)))
    engine._step()  # prefill of both prompts
    engine._queues.waiting.extend(_requests(3, SamplingParams(max_tokens=8))[2:])
    with count_syncs() as syncs:
        engine._step()  # the third prompt's prefill beside the others' verify
    assert syncs.by_kind["readback"] == 1
    assert syncs.readbacks == 1


def test_a_sampled_run_is_reproduced_by_its_seeds(checkpoints: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    mixed = [*_requests(3, params), *_requests(2, SamplingParams(max_tokens=20))[:1]]
    mixed[-1] = Request(
        request_id="greedy", prompt_ids=mixed[-1].prompt_ids, params=mixed[-1].params
    )
    first = _outputs(_engine(checkpoints["mimo"], "device"), mixed)
    again = _outputs(_engine(checkpoints["mimo"], "device"), mixed)
    assert first == again
    greedy_alone = _outputs(_engine(checkpoints["mimo"], "host"), [mixed[-1]])
    assert first["greedy"] == greedy_alone["greedy"], "a greedy row in a sampled batch is greedy"


@pytest.mark.parametrize("repeat", [False, True], ids=["chains", "copies"])
def test_a_seeded_sample_is_the_same_on_either_step_path_with_or_without_drafts(
    repeat: bool, checkpoints: dict[str, Path]
) -> None:
    # Each token is drawn with the request's key at its position from the
    # target there, and a draft is kept when it equals it: the drafts, the
    # policy, the batch and the step path change how many verifies it takes.
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95)
    requests = [
        Request(r.request_id, r.prompt_ids, replace(params, seed=50 + i))
        for i, r in enumerate(_requests(5, params, repeat=repeat))
    ]
    path = checkpoints["mimo"]
    plain = _outputs(_engine(path, "host", mtp=False, prompt_lookup=None), requests)
    assert len(set(plain.values())) == len(plain)
    runs = {
        "host": _engine(path, "host"),
        "host auto": _engine(path, "host", draft_policy="auto"),
        "host batch 1": _engine(path, "host", slots=1),
        "device": _engine(path, "device"),
        "device auto": _engine(path, "device", draft_policy="auto"),
        "device no drafts": _engine(path, "device", mtp=False, prompt_lookup=None),
    }
    for name, engine in runs.items():
        assert _outputs(engine, requests) == plain, name
    drafted = runs["device"].stats()
    assert drafted.mtp_accepted + drafted.prompt_lookup.total.accepted > 0


def test_logprobs_come_back_with_the_one_readback_and_equal_the_host_steps(
    checkpoints: dict[str, Path],
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=4)
    mixed = [*_requests(3, params, repeat=True), *_requests(1, SamplingParams(max_tokens=12))]
    mixed[-1] = Request("plain", mixed[-1].prompt_ids, replace(mixed[-1].params, logprobs=0))
    host = {r.request_id: r for r in _engine(checkpoints["mimo"], "host").generate(mixed)}
    device = {r.request_id: r for r in _engine(checkpoints["mimo"], "device").generate(mixed)}
    for rid, want in host.items():
        got = device[rid]
        assert got.output_ids == want.output_ids, rid
        assert want.logprobs is not None and got.logprobs is not None
        assert [e.token_id for e in got.logprobs] == [e.token_id for e in want.logprobs]
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a.top, b.top, strict=True))
    engine = _engine(checkpoints["mimo"], "device")
    engine._queues.waiting.extend(mixed)
    engine._step()
    while engine._queues.decoding:
        with count_syncs() as syncs:
            engine._step()
        assert (syncs.readbacks, syncs.uploads) == (1, 0)


def test_a_grammar_is_refused_by_name_on_the_device_step(checkpoints: dict[str, Path]) -> None:
    engine = _engine(checkpoints["llama"], "device")
    ok, constrained = _requests(2, SamplingParams(max_tokens=4))
    constrained = Request(
        request_id="json",
        prompt_ids=constrained.prompt_ids,
        params=constrained.params,
        grammar=Grammar(kind="json_object"),
    )
    results = {r.request_id: r for r in engine.generate([ok, constrained])}
    assert results["json"].finish_reason == "error"
    assert "host step" in (results["json"].error or "")
    assert results[ok.request_id].finish_reason in ("length", "stop")


def test_a_model_the_device_step_cannot_run_is_refused_by_name(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "two", "qwen2", mtp_layout="mimo", num_mtp_layers=2)
    with pytest.raises(ValueError, match="step_path: device cannot run this model: 2 stacked MTP"):
        _engine(path, "device")
    # auto on the CPU runs the host step.
    assert _engine(path, "auto").step_path == "host"


def test_a_model_without_headroom_is_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "llama", "llama")
    model = build_runtime(path, num_slots=2, max_len=32)
    with pytest.raises(ValueError, match="needs 16 positions of cache headroom"):
        Engine(model, None, EngineConfig(step_path="device"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_step_with_graphs_equals_the_cpu_host_step(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["mimo"]
    ckpt = read_checkpoint(path)
    found = detect_mtp(ckpt.raw_config, ckpt.weights.names(), ckpt.spec.num_layers)
    model = build_runtime(path, num_slots=4, max_len=MAX_LEN, headroom=MAX_WIDTH, device="cuda")
    mtp = load_checkpoint_mtp(model, ckpt.weights, found) if found else []
    config = EngineConfig(max_batch=4, draft_policy="fixed", mtp_min_prob=0.0)
    engine = Engine(model, None, config, mtp=mtp, eos_token_ids=[EOS_ID])
    assert engine.step_path == "device"
    requests = _requests(6, SamplingParams(max_tokens=20), repeat=True)
    want = _outputs(_engine(path, "host"), requests)
    assert _outputs(engine, requests) == want
    assert engine.graph_shapes(), "the verify, feed and chain shapes were captured"


def test_generate_step_path_device_writes_what_the_host_step_writes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from metrale.cli.main import app

    path = write_tiny_checkpoint(tmp_path / "mimo", "qwen2", mtp_layout="mimo")
    lines = "".join(
        f'{{"id": "l{i}", "prompt": "{text}", "max_tokens": 12}}\n'
        for i, text in enumerate(["abc abc abc", "hello there", "x y x y x y"])
    )
    base = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float32"]
    outputs = {}
    for step in ("host", "device"):
        result = CliRunner().invoke(app, [*base, "--step-path", step], input=lines)
        assert result.exit_code == 0, result.output
        records = [orjson.loads(line) for line in result.stdout.splitlines()]
        outputs[step] = sorted((r["id"], r["text"], r["usage"]) for r in records)
    assert outputs["device"] == outputs["host"]
    two = write_tiny_checkpoint(tmp_path / "two", "qwen2", mtp_layout="mimo", num_mtp_layers=2)
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(two), "--device", "cpu", "--step-path", "device"],
        input=lines,
    )
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.replace("│", " ").split())  # the usage panel's lines joined
    assert "--step-path: device cannot run this model: 2 stacked MTP modules" in flat


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_moe_and_mla_with_mtp_give_the_host_steps_output(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, _, _ = write_with_mtp(tmp_path_factory.mktemp(family), family, 1)
    requests = _requests(5, SamplingParams(max_tokens=16), repeat=True)
    host = _engine(path, "host")
    want = _outputs(host, requests)
    device = _engine(path, "device")
    assert device.step_path == "device"
    assert _outputs(device, requests) == want
    assert device.stats().mtp_proposed > 0


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_a_moe_decode_step_reads_back_once_too(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Stacked experts run in grouped products: no routing count is read on the host."""
    if family == "deepseek_v3":
        path, _, _ = write_with_mtp(tmp_path_factory.mktemp(family), family, 1)
    else:
        path = write_moe_checkpoint(tmp_path_factory.mktemp(family), family)
    engine = _engine(path, "device")
    engine._queues.waiting.extend(_requests(3, SamplingParams(max_tokens=12), repeat=True))
    engine._step()
    counts = []
    while engine._queues.decoding:
        with count_syncs() as syncs:
            engine._step()
        counts.append((syncs.readbacks, syncs.uploads))
    assert len(counts) >= 5 and set(counts) == {(1, 0)}, counts


def test_the_device_steps_sampled_tokens_follow_the_model(checkpoints: dict[str, Path]) -> None:
    """The second token of many seeded runs, which the device step samples by
    speculative sampling against the MTP module's sampled draft (its
    distribution kept on the device, column by column), is distributed as the
    model's own two-token marginal: a chi-square test at 0.999."""
    path, trials, prompt = checkpoints["mimo"], 3000, (40, 41, 42, 40, 41)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=seed) for seed in range(trials)]
    requests = [
        Request(request_id=str(i), prompt_ids=prompt, params=p) for i, p in enumerate(params)
    ]
    engine = _engine(path, "device", slots=16, eos=(), prompt_lookup=None)
    seconds = [r.output_ids[1] for r in engine.generate(requests)]
    stats = engine.stats()
    assert 0 < stats.mtp_accepted < stats.mtp_proposed, "sampled drafts were tested and some kept"
    # The exact marginal: sum over the first token of p(t1) p(t2 | t1).
    reference = load_reference_model(path)
    with torch.no_grad():
        first = reference(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [vocab]
        vocab = first.shape[0]
        grown = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], dim=1)
        then = reference(grown).logits[:, -1].softmax(-1)  # [vocab, vocab]: p(t2 | t1)
    exact = (first[:, None] * then).sum(0).double()  # [vocab]
    counts = torch.bincount(torch.tensor(seconds), minlength=vocab).double()
    expected = exact * trials
    big = expected >= 5
    stat = float((((counts - expected) ** 2 / expected)[big]).sum())
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    stat += (rest_obs - rest_exp) ** 2 / rest_exp if rest_exp > 0 else 0.0
    df = int(big.sum()) + (1 if rest_exp > 0 else 0) - 1
    bound = df * (1 - 2 / (9 * df) + 3.090 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < bound, (stat, bound)
    # The test has power: the first token's own distribution, drawn as often, fails it.
    wrong = torch.multinomial(first, trials, True, generator=torch.Generator().manual_seed(0))
    wrong_counts = torch.bincount(wrong, minlength=vocab).double()
    assert float((((wrong_counts - expected) ** 2 / expected)[big]).sum()) > bound


def test_the_draft_budget_runs_on_the_device_step_and_changes_no_greedy_token(
    checkpoints: dict[str, Path],
) -> None:
    requests = _requests(4, SamplingParams(max_tokens=24), repeat=True)
    device = _engine(checkpoints["mimo"], "device", draft_policy="auto")
    assert device.policy.name == "auto"
    on_device = _outputs(device, requests)
    host = _outputs(_engine(checkpoints["mimo"], "host", draft_policy="fixed"), requests)
    assert on_device == host
    stats = device.stats()
    assert stats.budget is not None and stats.budget.steps == stats.verifies
    assert stats.mtp_proposed + stats.prompt_lookup.total.proposed > 0


def test_the_draft_budget_on_the_device_step_reads_back_once_a_step(
    checkpoints: dict[str, Path],
) -> None:
    engine = _engine(checkpoints["mimo"], "device", draft_policy="auto")
    engine.calibrate()
    counts = _syncs_per_decode_step(engine)
    assert len(counts) >= 5
    assert set(counts) == {(1, 0)}, counts
