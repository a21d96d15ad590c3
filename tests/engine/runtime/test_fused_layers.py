"""All layers in one C call (engine/fused_layers.py): bit for bit the
layer-by-layer kernel path, for decode and verify steps of mixed segments,
with a sliding window, and through an MTP head's one-layer stack; layers
it cannot take (biases, q/k norms, dense weights) stay layer by layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.config import RuntimeConfig
from metrale.engine.kernels.binding import packed_kernel
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.llama import DecoderStack, LlamaModel
from metrale.engine.runtime.model import ForwardOutput, Model, Segment
from metrale.engine.runtime.mtp_head import head_tensor_shapes, load_mtp_head, save_mtp_head
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.packing import pack_checkpoint

RUNTIME = RuntimeConfig(device="cpu", dtype="float32", num_slots=4, max_len=96)


def packed_checkpoint(folder: Path, family: str, **kwargs: object) -> Path:
    write_tiny_checkpoint(folder, family, tie_embeddings=True, **kwargs)  # type: ignore[arg-type]
    pack_checkpoint(folder)
    return folder


def steps(model: Model, stack: DecoderStack, fused: bool) -> list[ForwardOutput]:
    """A prefill of three slots, then a decode step and a verify of mixed rows."""
    keep = stack.fused
    if not fused:
        stack.fused = None
    try:
        ids = torch.randint(3, 200, (3, 50), generator=torch.Generator().manual_seed(1)).tolist()
        model.forward([Segment(s, 0, ids[s][:30]) for s in range(3)])
        first = model.forward([Segment(s, 30, ids[s][30:31]) for s in range(3)])
        verify = model.forward(
            [
                Segment(0, 31, ids[0][31:35]),
                Segment(2, 31, ids[2][31:32]),
                Segment(1, 31, ids[1][31:40]),
            ]
        )
        return [first, verify]
    finally:
        stack.fused = keep


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window
def test_one_call_gives_the_bits_of_the_layer_by_layer_path(tmp_path: Path, family: str) -> None:
    folder = packed_checkpoint(tmp_path / family, family, num_layers=3)
    model = load_model(folder, RUNTIME).model
    stack = model.stack  # type: ignore[attr-defined]
    assert stack.fused is not None, "packed Llama-style layers on the CPU in float32"
    for one, each in zip(steps(model, stack, True), steps(model, stack, False), strict=True):
        assert torch.equal(one.logits, each.logits)
        assert torch.equal(one.hidden, each.hidden)


def test_an_mtp_head_runs_its_layer_in_one_call(tmp_path: Path) -> None:
    # A standalone head in bfloat16, as metrale ships them: its layer runs packed.
    folder = packed_checkpoint(tmp_path / "base", "llama")
    model = load_model(folder, RUNTIME).model
    assert isinstance(model, LlamaModel)
    gen = torch.Generator().manual_seed(2)
    tensors = {
        name: (torch.randn(shape, generator=gen) * 0.1).to(torch.bfloat16)
        for name, shape in head_tensor_shapes(model.spec).items()
    }
    weights, _ = save_mtp_head(tmp_path / "head", tensors, model.spec, base_model="tiny")
    head = load_mtp_head(weights, model, packed_kernel())
    assert head.stack.fused is not None, "a packed bfloat16 layer"
    hidden = torch.randn(3, model.spec.hidden_size, generator=gen)
    outputs = []
    for fused in (head.stack.fused, None):
        keep, head.stack.fused = head.stack.fused, fused
        head.forward([Segment(0, 0, [5, 6, 7])], hidden)  # a prefill: layer by layer
        outputs.append(head.forward([Segment(0, 3, [8, 9])], hidden[:2]))
        head.stack.fused = keep
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].hidden, outputs[1].hidden)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_layers_it_cannot_take_run_layer_by_layer(tmp_path: Path, family: str) -> None:
    folder = packed_checkpoint(tmp_path / family, family)
    assert load_model(folder, RUNTIME).model.stack.fused is None  # type: ignore[attr-defined]


def test_dense_weights_run_layer_by_layer(tmp_path: Path) -> None:
    folder = packed_checkpoint(tmp_path / "dense", "llama")
    model = load_model(folder, RuntimeConfig(**{**vars(RUNTIME), "weights": "dense"})).model
    assert model.stack.fused is None  # type: ignore[attr-defined]
