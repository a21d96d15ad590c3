"""MoE families (Qwen2-MoE, Qwen3-MoE, GLM-4.5, and with MLA DeepSeek-V3 and
GLM-4.7-Flash) against transformers' own classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.arch import CheckpointError, MoeSpec
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.moe import MoeWeights, route
from tests.support.checkpoints import (
    EOS_ID,
    build_runtime,
    load_reference_model,
    random_ids,
    reference_logits,
)
from tests.support.moe_checkpoints import CLASSES, write_moe_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CLASSES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_the_config_is_read_as_the_family_defines_it(checkpoint: Path) -> None:
    spec = read_checkpoint(checkpoint).spec
    assert spec.moe is not None
    family = spec.family
    dense = {"qwen3_moe": {1}, "qwen2_moe": {0, 2}}.get(family, {0})
    assert spec.moe.dense_layers == frozenset(dense)
    if family == "glm4_moe":
        assert spec.rotary_dim == spec.head_dim // 2 and spec.qk_norm and spec.qkv_bias
        assert spec.moe.routing == "sigmoid_grouped" and spec.moe.num_groups == 2
    elif family in ("deepseek_v3", "glm4_moe_lite"):
        assert spec.mla is not None and spec.moe.routing == "sigmoid_grouped"
        assert spec.mla.q_lora_rank == (24 if family == "deepseek_v3" else None)
    else:
        assert spec.moe.routing == "softmax" and spec.rotary_dim is None


def test_prefill_logits_equal_transformers(checkpoint: Path) -> None:
    ids = random_ids(1, 40)
    expected = reference_logits(checkpoint, ids)[0]
    out = build_runtime(checkpoint).forward([Segment(0, 0, ids[0].tolist())])
    assert (out.logits - expected).abs().max().item() <= TOL


def test_ragged_verify_rows_of_several_sequences_equal_transformers(checkpoint: Path) -> None:
    ids = random_ids(3, 48, seed=2)
    expected = reference_logits(checkpoint, ids)
    model = build_runtime(checkpoint)
    model.forward([Segment(2, 0, ids[0, :30].tolist()), Segment(0, 0, ids[1, :20].tolist())])
    model.forward([Segment(3, 0, ids[2, :10].tolist())])
    rows = [(3, 10, 2, 48), (2, 30, 0, 34), (0, 20, 1, 21)]  # a chunk, a verify of 4, a decode
    out = model.forward([Segment(s, a, ids[q, a:e].tolist()) for s, a, q, e in rows])
    got = out.logits.split([e - a for _, a, _, e in rows])
    for (_, start, seq, end), logits in zip(rows, got, strict=True):
        assert (logits - expected[seq, start:end]).abs().max().item() <= TOL


def test_ragged_rows_equal_each_sequence_alone(checkpoint: Path) -> None:
    ids = random_ids(3, 24, seed=7)
    starts = (12, 5, 20)
    alone = []
    for seq in range(3):
        model = build_runtime(checkpoint)
        model.forward([Segment(1, 0, ids[seq, : starts[seq]].tolist())])
        alone.append(model.forward([Segment(1, starts[seq], ids[seq, starts[seq] :].tolist())]))
    together = build_runtime(checkpoint)
    slots = (3, 0, 2)
    together.forward([Segment(slots[q], 0, ids[q, : starts[q]].tolist()) for q in range(3)])
    out = together.forward(
        [Segment(slots[q], starts[q], ids[q, starts[q] :].tolist()) for q in range(3)]
    )
    for seq, logits in enumerate(out.logits.split([24 - s for s in starts])):
        assert torch.allclose(logits, alone[seq].logits, atol=1e-5)


def test_greedy_output_equals_transformers_generate(checkpoint: Path) -> None:
    loaded = load_model(checkpoint, RuntimeConfig(device="cpu", num_slots=3, max_len=128))
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (9, 17, 5)]
    reference = load_reference_model(checkpoint)
    params = SamplingParams(max_tokens=16, eos_token_ids=(EOS_ID,))
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(prompts)]
    engine = Engine.from_loaded(loaded, EngineConfig(max_batch=3))
    got = {r.request_id: list(r.output_ids) for r in engine.generate(requests)}
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=EOS_ID
            )
        assert got[str(i)] == out[0, len(prompt) :].tolist()


def test_grouped_routing_picks_only_from_the_best_groups() -> None:
    spec = MoeSpec(
        num_experts=8,
        experts_per_token=3,
        expert_size=4,
        routing="sigmoid_grouped",
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        num_groups=4,
        topk_groups=2,
    )
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(8, generator=gen) * 0.1
    weights = MoeWeights(
        router=torch.randn(8, 16, generator=gen),
        score_bias=bias,
        experts=[],
        shared=None,
        shared_gate=None,
    )
    x = torch.randn(50, 16, generator=gen)
    top, ids = route(x, weights, spec)
    choice = torch.sigmoid(x @ weights.router.T) + bias  # [50, 8]
    group_scores = choice.view(50, 4, 2).sum(-1)  # two experts a group: the sum of both
    best_groups = group_scores.topk(2, dim=-1).indices  # [50, 2]
    for row in range(50):
        allowed = {int(g) * 2 + e for g in best_groups[row] for e in range(2)}
        assert set(ids[row].tolist()) <= allowed
        # the three best allowed experts by the biased score, weighted by the unbiased one
        ranked = sorted(allowed, key=lambda e: -float(choice[row, e]))[:3]
        assert set(ids[row].tolist()) == set(ranked)
    assert torch.allclose(top.sum(-1), torch.full((50,), 2.0), atol=1e-5)


def test_a_layer_whose_weights_disagree_with_the_config_is_refused(tmp_path: Path) -> None:
    path = write_moe_checkpoint(tmp_path, "qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    config["mlp_only_layers"] = []  # now layer 1 should be MoE, but its weights are dense
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp.*MoE block"):
        build_runtime(path)


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ({"model_type": "mamba2"}, "unsupported architecture mamba2"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention"),
        ({"model_type": "mixtral"}, "unsupported architecture mixtral"),
        ({"scoring_func": "softmax"}, "scoring_func"),
    ],
)
def test_layers_and_routings_it_cannot_run_are_refused_by_name(
    tmp_path: Path, change: dict[str, object], cause: str
) -> None:
    path = write_moe_checkpoint(tmp_path, "glm4_moe")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=cause):
        read_checkpoint(path)


def test_info_shows_attention_experts_and_the_kv_bytes_the_cache_stores(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from metrale.cli.main import app

    mla = write_moe_checkpoint(tmp_path / "mla", "deepseek_v3")
    result = CliRunner().invoke(app, ["info", str(mla), "--no-mtp"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the table may fold long values
    assert "MLA, 4 heads, latent 16 + rope key 8 cached, q rank 24" in text
    assert "8 routed, 1 shared, 2 routed active per token (sigmoid grouped); 1 dense layer" in text
    assert "quantization none" in text
    # 3 layers x (latent 16 + rope key 8) float32 numbers, not per-head keys and values
    assert f"KV bytes per token {3 * (16 + 8) * 4:,} (as the cache stores it)" in text
    glm = write_moe_checkpoint(tmp_path / "glm", "glm4_moe")
    result = CliRunner().invoke(app, ["info", str(glm)])
    assert result.exit_code == 0, result.output
    assert "GQA, 4 query / 2 kv heads of 16, 50% rotary" in " ".join(result.output.split())


def test_a_bfloat16_moe_checkpoint_runs_its_experts_packed_and_as_its_dense_twin(
    tmp_path: Path,
) -> None:
    """On the CPU in float32, a bfloat16 checkpoint's expert weights run in the
    packed-weight kernel (widening bfloat16 is exact), with the logits of the
    same weights held dense."""
    from safetensors.torch import load_file, save_file

    from metrale.engine.runtime.packed import PackedWeight

    path = write_moe_checkpoint(tmp_path / "bf16", "qwen3_moe")
    weights = {
        k: v.to(torch.bfloat16) for k, v in load_file(str(path / "model.safetensors")).items()
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    packed = load_model(path, RuntimeConfig(device="cpu", dtype="float32", num_slots=2))
    dense = load_model(
        path, RuntimeConfig(device="cpu", dtype="float32", num_slots=2, weights="dense")
    )
    block = packed.model.stack.blocks[0]  # type: ignore[attr-defined]
    assert block.moe is not None and isinstance(block.moe.experts[0].gate_up, PackedWeight)
    ids = random_ids(1, 20, seed=4)[0].tolist()
    ours = packed.model.forward([Segment(0, 0, ids)]).logits
    theirs = dense.model.forward([Segment(0, 0, ids)]).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
