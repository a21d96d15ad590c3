"""`train-mtp --device`: the head trains where the model runs, its training cache
and its written tensors stay on the CPU, and the same seed gives the same head
on every device (the CUDA comparison is `gpu`-marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from metrale.cli import train as train_module
from metrale.cli.main import app
from metrale.engine.config import RuntimeConfig
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.train.data import TrainSequence
from metrale.engine.train.head import TrainableHead
from metrale.engine.train.trainer import TrainConfig, cache_sequences, train_mtp
from tests.support.checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "qwen2")


def loaded_on(folder: Path, device: str) -> LoadedModel:
    runtime = RuntimeConfig(device=device, dtype="float32", num_slots=2, max_len=64, mtp=False)
    return load_model(folder, runtime)


def model_of(loaded: LoadedModel) -> LlamaModel:
    assert isinstance(loaded.model, LlamaModel)
    return loaded.model


def sequences() -> list[TrainSequence]:
    gen = torch.Generator().manual_seed(0)
    return [
        TrainSequence(tuple(torch.randint(97, 110, (40,), generator=gen).tolist()), 8)
        for _ in range(4)
    ]


def train(model: LlamaModel) -> dict[str, torch.Tensor]:
    config = TrainConfig(epochs=1, batch_tokens=64, heldout=0.25, eval_every=0, draft_vocab=0)
    return train_mtp(model, sequences(), config).tensors


def test_the_cache_and_the_trained_tensors_live_on_the_cpu(folder: Path) -> None:
    model = model_of(loaded_on(folder, "cpu"))
    cached = cache_sequences(model, sequences())
    for seq in cached:
        assert {seq.next_ids.device.type, seq.hidden.device.type, seq.targets.device.type} == {
            "cpu"
        }
    head = TrainableHead(model, seed=0)
    assert head.device == model.device
    assert all(p.device == model.device for p in head.parameters())
    assert all(t.device.type == "cpu" for t in train(model).values())


def test_train_mtp_hands_its_device_to_the_runtime(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[RuntimeConfig] = []

    def run_training(*args: Any) -> None:
        seen.append(args[-1])

    monkeypatch.setattr(train_module, "run_training", run_training)
    text = tmp_path / "notes.txt"
    text.write_text("some text")
    args = ["train-mtp", "--model", str(folder), "--data", str(text), "--out", str(tmp_path / "h")]
    result = CliRunner().invoke(app, [*args, "--device", "cpu"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert seen[-1].device == "cpu" and not seen[-1].mtp
    from_env = CliRunner().invoke(app, args, env={**WIDE, "METRALE_DEVICE": "cuda:1"})
    assert from_env.exit_code == 0 and seen[-1].device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is there: cuda is a valid device")
def test_train_mtp_on_cuda_without_cuda_is_a_usage_error_on_the_flag(
    folder: Path, tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("some text")
    args = ["train-mtp", "--model", str(folder), "--data", str(text), "--out", str(tmp_path / "h")]
    result = CliRunner().invoke(app, [*args, "--device", "cuda"], env=WIDE)
    assert result.exit_code == 2
    assert "Invalid value for --device: must be cpu here (CUDA is not available)" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_same_seed_trains_the_same_head_on_cuda_as_on_the_cpu(folder: Path) -> None:
    on_cpu = train(model_of(loaded_on(folder, "cpu")))
    on_cuda = train(model_of(loaded_on(folder, "cuda")))
    assert on_cpu.keys() == on_cuda.keys()
    for name, value in on_cpu.items():
        assert on_cuda[name].device.type == "cpu"
        # float32 on both; kernels differ in summation order, not in the head.
        torch.testing.assert_close(on_cuda[name], value, rtol=1e-3, atol=1e-4, msg=name)
