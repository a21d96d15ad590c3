"""A Qwen2-MoE or Qwen3-MoE GGUF, experts stacked as llama.cpp writes them,
is the model its safetensors twin is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from metrale.engine.config import RuntimeConfig
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.runtime.model import Segment
from tests.support.engine_runs import TWIN_PROMPTS, twin_greedy
from tests.support.gguf_files import dequantized_twin, write_gguf
from tests.support.moe_checkpoints import write_moe_checkpoint

DENSE = RuntimeConfig(device="cpu", dtype="float32", num_slots=3, max_len=128, weights="dense")
PACKED = RuntimeConfig(device="cpu", dtype="float32", num_slots=3, max_len=128)
# Every layer's MLP made of experts: llama.cpp's qwen2moe/qwen3moe have no dense layers.
ALL_MOE: dict[str, dict[str, Any]] = {
    "qwen2_moe": {"decoder_sparse_step": 1},
    "qwen3_moe": {"mlp_only_layers": []},
}


pytestmark = pytest.mark.usefixtures("cache_root")


def logits(loaded: LoadedModel) -> torch.Tensor:
    segments = [Segment(s, 0, ids) for s, ids in enumerate(TWIN_PROMPTS)]
    return loaded.model.forward(segments).logits  # [num_tokens, vocab]


@pytest.mark.parametrize("family", list(ALL_MOE))
def test_a_moe_gguf_s_logits_equal_its_safetensors_twin_s(tmp_path: Path, family: str) -> None:
    # F32: the experts come back from their stacked [experts, rows, cols]
    # tensors key for key, the routers, Qwen2-MoE's shared expert and its
    # gate (a vector in the file) too, and the config routes as the twin's.
    twin = write_moe_checkpoint(tmp_path / "twin", family, **ALL_MOE[family])
    path = write_gguf(twin, tmp_path / "m.gguf")
    ours = load_model(str(path), DENSE)
    converted = load_file(str(ours.folder / "model.safetensors"))
    original = load_file(str(twin / "model.safetensors"))
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    theirs = load_model(twin, DENSE)
    assert ours.info.experts == theirs.info.experts
    assert torch.equal(logits(ours), logits(theirs))
    assert twin_greedy(ours) == twin_greedy(theirs)


def test_a_quantized_moe_gguf_runs_its_experts_packed_as_its_dequantized_twin(
    tmp_path: Path,
) -> None:
    # Q4_K experts (rows of 256) in the kernel: the greedy output of the
    # float32 model their blocks dequantize to.
    sizes = {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}
    source = write_moe_checkpoint(tmp_path / "source", "qwen3_moe", mlp_only_layers=[], **sizes)
    twin = dequantized_twin(source, tmp_path / "twin", "Q4_K")
    path = write_gguf(source, tmp_path / "m.gguf", "Q4_K")
    packed, dense = load_model(str(path), PACKED), load_model(twin, DENSE)
    assert packed.info.weights == "packed (q4_1)"
    assert torch.equal(logits(load_model(str(path), DENSE)), logits(dense))
    assert twin_greedy(packed) == twin_greedy(dense)


def test_a_token_streams_its_routed_experts_share_of_their_bytes(tmp_path: Path) -> None:
    # One more active expert a token: one more expert's bytes in each layer.
    streamed = {}
    for active in (1, 2):
        folder = write_moe_checkpoint(
            tmp_path / f"k{active}", "qwen3_moe", mlp_only_layers=[], num_experts_per_tok=active
        )
        streamed[active] = load_model(folder, DENSE).info.streamed_bytes
    weights = load_file(str(folder / "model.safetensors"))
    one_expert = sum(
        w.numel() * w.element_size() for k, w in weights.items() if ".mlp.experts.0." in k
    )
    assert streamed[2] - streamed[1] == one_expert  # summed over the layers
