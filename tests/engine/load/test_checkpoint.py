"""Checkpoint folders: reading, loading through ``load_model``, and ``metrale info``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.engine.config import RuntimeConfig
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.load.loader import choose_max_len, load_model
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.model import Segment
from tests.support.checkpoints import EOS_ID, write_tiny_checkpoint

SMALL = RuntimeConfig(num_slots=2, max_len=32)


def test_sharded_weights_load_the_same_model(tmp_path: Path) -> None:
    single = write_tiny_checkpoint(tmp_path / "one", "qwen3", seed=3)
    sharded = write_tiny_checkpoint(tmp_path / "three", "qwen3", seed=3, num_shards=3)
    assert (sharded / "model.safetensors.index.json").exists()
    assert not (sharded / "model.safetensors").exists()
    segment = [Segment(0, 0, [1, 2, 3, 4, 5])]
    a = load_model(single, SMALL).model.forward(segment)
    b = load_model(sharded, SMALL).model.forward(segment)
    assert torch.allclose(a.logits, b.logits, atol=1e-6)  # equal up to kernel alignment


def test_load_model_reports_what_it_loaded(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "tiny-llama", "llama", num_layers=3)
    loaded = load_model(path, RuntimeConfig(num_slots=3, max_len=40, mtp=True))
    info = loaded.info
    expected_params = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    assert info.parameters == expected_params
    assert (info.name, info.architecture, info.dtype, info.device) == (
        "tiny-llama",
        "llama",
        "float32",
        "cpu",
    )
    assert (info.context_len, info.max_len, info.num_slots) == (512, 40, 3)
    assert info.mtp_layout is None and info.mtp_count == 0 and loaded.mtp == []
    # keys + values, 3 layers, 2 kv heads of 16, float32
    assert info.kv_bytes_per_token == 2 * 3 * 2 * 16 * 4
    assert loaded.eos_token_ids == (EOS_ID, EOS_ID + 2)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("héllo")) == "héllo"
    assert (loaded.model.num_slots, loaded.model.max_len, loaded.model.vocab_size) == (3, 40, 260)


def test_kv_budget_caps_positions_per_slot(tmp_path: Path) -> None:
    spec = read_checkpoint(write_tiny_checkpoint(tmp_path, "llama")).spec
    per_position = 2 * spec.num_layers * spec.kv_size * 4  # bytes, one slot
    budget = RuntimeConfig(num_slots=4, kv_budget_mb=per_position * 4 * 100 / 2**20)
    assert choose_max_len(spec, budget, torch.float32, num_stacks=1) == 100
    tiny = RuntimeConfig(num_slots=4, kv_budget_mb=1e-6)
    with pytest.raises(CheckpointError, match="KV budget"):
        choose_max_len(spec, tiny, torch.float32, num_stacks=1)
    with pytest.raises(CheckpointError, match="context length 512"):
        choose_max_len(spec, RuntimeConfig(max_len=513), torch.float32, num_stacks=1)


def test_a_source_that_is_no_folder_is_refused_without_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A hub id is looked up in the Hugging Face cache; offline, a miss is refused.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct", SMALL)
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_model(tmp_path, SMALL)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        read_checkpoint(tmp_path)


def test_info_prints_architecture_and_mtp(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "m", "llama", mtp_layout="deepseek", num_mtp_layers=2)
    result = CliRunner().invoke(app, ["info", str(path)], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "llama" in result.output
    assert "deepseek x 2" in result.output
    assert "context length" in result.output and "512" in result.output
    assert "prefix cache on: a line reuses the longest prompt prefix" in " ".join(
        result.output.split()
    )


def test_info_on_a_bad_model_exits_2_with_the_reason(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["info", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "not a checkpoint folder" in result.output
