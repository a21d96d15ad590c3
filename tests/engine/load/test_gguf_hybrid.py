"""A Qwen3.5 or Qwen3.5-MoE GGUF, as llama.cpp writes it, is the model its
checkpoint is, MTP layer included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.gguf_config import GgufError
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.runtime.model import Segment
from tests.support.gguf_files import dequantized_twin
from tests.support.hybrid_checkpoints import write_hybrid_checkpoint
from tests.support.hybrid_gguf import write_hybrid_gguf

DENSE = RuntimeConfig(device="cpu", dtype="float32", num_slots=3, max_len=128, weights="dense")
PACKED = RuntimeConfig(device="cpu", dtype="float32", num_slots=3, max_len=128)
PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [40, 2, 2, 17], [8, 8, 8, 8, 9, 10, 11, 12, 13]]
FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")


pytestmark = pytest.mark.usefixtures("cache_root")


def logits(loaded: LoadedModel) -> torch.Tensor:
    segments = [Segment(s, 0, ids) for s, ids in enumerate(PROMPTS)]
    return loaded.model.forward(segments).logits  # [num_tokens, vocab]


def generate(loaded: LoadedModel, mtp: bool) -> tuple[list[tuple[int, ...]], int]:
    """Greedy outputs of ``PROMPTS``, and the MTP drafts verified."""
    config = EngineConfig(
        max_batch=3, prompt_lookup=None, mtp=mtp, draft_policy="fixed", mtp_min_prob=0.0
    )
    engine = Engine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=12)
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(PROMPTS)]
    results = sorted(engine.generate(requests), key=lambda r: int(r.request_id))
    return [r.output_ids for r in results], engine.stats().mtp_proposed


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hybrid_gguf_converts_back_to_its_checkpoint_and_runs_it(
    tmp_path: Path, family: str
) -> None:
    # F32, four value heads over two key heads: llama.cpp's tiled value
    # heads, its +1 norms, -exp(A_log), squeezed conv1d and appended MTP
    # block all come back as the model the checkpoint is.
    source = write_hybrid_checkpoint(tmp_path / "source", family)
    path = write_hybrid_gguf(source, tmp_path / "m.gguf")
    ours = load_model(str(path), DENSE)
    original = load_file(str(source / "model.safetensors"))
    converted = load_file(str(ours.folder / "model.safetensors"))
    assert sorted(converted) == sorted(original)  # the MTP layer's keys too
    theirs = load_model(source, DENSE)
    assert len(ours.mtp) == len(theirs.mtp) == 1
    torch.testing.assert_close(logits(ours), logits(theirs), rtol=1e-5, atol=1e-5)
    assert generate(ours, mtp=False)[0] == generate(theirs, mtp=False)[0]
    with_mtp, drafted = generate(ours, mtp=True)
    assert with_mtp == generate(theirs, mtp=False)[0] and drafted > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_quantized_hybrid_gguf_runs_packed_as_its_dequantized_twin(
    tmp_path: Path, family: str
) -> None:
    # Q8_0 projections in the kernel (rows of 64 and 128). out_proj stays
    # F32: llama.cpp quantizes its columns in tiled order, so a twin
    # quantized in the checkpoint's order would hold other blocks.
    source = write_hybrid_checkpoint(tmp_path / "source", family)
    mix = {"out_proj": "F32"}
    twin = dequantized_twin(source, tmp_path / "twin", "Q8_0", mix)
    path = write_hybrid_gguf(source, tmp_path / "m.gguf", "Q8_0", mix)
    packed = load_model(str(path), PACKED)
    assert "packed" in packed.info.weights
    expected = logits(load_model(twin, DENSE))
    torch.testing.assert_close(logits(load_model(str(path), DENSE)), expected, rtol=1e-5, atol=1e-5)
    assert generate(packed, mtp=True)[0] == generate(load_model(twin, DENSE), mtp=False)[0]


def test_a_quantized_norm_is_refused_by_name(tmp_path: Path) -> None:
    source = write_hybrid_checkpoint(tmp_path / "source", "qwen3_5_text")
    path = write_hybrid_gguf(source, tmp_path / "m.gguf")
    from gguf import GGUFReader

    from metrale.engine.load.gguf_convert import check_tensors

    tensors = GGUFReader(str(path)).tensors
    check_tensors(tensors, path, 8)  # as written: every changed tensor is F32

    class Quantized:
        def __init__(self, tensor: object) -> None:
            self.name, self.shape = tensor.name, tensor.shape  # type: ignore[attr-defined]
            self.tensor_type = type("T", (), {"name": "Q8_0"})()

    norm = next(t for t in tensors if t.name == "blk.0.attn_norm.weight")
    with pytest.raises(GgufError, match=r"blk\.0\.attn_norm\.weight is Q8_0"):
        check_tensors([Quantized(norm)], path, 8)
