"""The block-FP8 twins of the hybrid test checkpoints (``tests.support.hybrid_fp8``)
are what they claim: the FP8 folder quantized as the Qwen FP8 releases are,
its twin exactly the dequantized FP8 and close to the original weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.support.hybrid_checkpoints import NESTED, write_hybrid_checkpoint
from tests.support.hybrid_fp8 import dequantize_fp8, dequantized_twin, write_fp8_twin

pytestmark = pytest.mark.usefixtures("one_thread")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def config_of(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


@pytest.fixture(
    scope="module", params=[("qwen3_5_moe", (32, 32)), ("qwen3_next", (32, 48))], ids=str
)
def fp8(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, tuple[int, int]]:
    """(source folder, FP8 folder, block); blocks of 32 x 48 leave partial ones."""
    family, block = request.param
    root = tmp_path_factory.mktemp("fp8")
    src = write_hybrid_checkpoint(root / "src" / family, family)
    return src, write_fp8_twin(src, root / family, block), block


def test_the_fp8_twin_holds_exactly_the_dequantized_fp8_weights(
    fp8: tuple[Path, Path, tuple[int, int]],
) -> None:
    src, dst, block = fp8
    stored, twin, original = tensors(dst), tensors(dequantized_twin(dst)), tensors(src)
    quantized = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert twin.keys() == original.keys() == {n for n in stored if not n.endswith("_scale_inv")}
    assert "mtp.layers.0.self_attn.q_proj.weight" in quantized
    for name in quantized:
        q, scale = stored[name], stored[name + "_scale_inv"]
        rows, cols = q.shape[-2:]
        assert scale.shape == (*q.shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
        assert torch.equal(twin[name], dequantize_fp8(q, scale, block))
    for name in original.keys() - quantized:
        assert torch.equal(stored[name], original[name]) and torch.equal(twin[name], original[name])


def test_the_fp8_config_lists_every_matrix_left_in_float(
    fp8: tuple[Path, Path, tuple[int, int]],
) -> None:
    src, dst, block = fp8
    stored = tensors(dst)
    config = config_of(dst)["quantization_config"]  # at the top, as released
    assert "quantization_config" not in config_of(dequantized_twin(dst))
    assert {k: v for k, v in config.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    plain = set(config["modules_to_not_convert"])
    for name, tensor in stored.items():
        if tensor.dim() < 2 or name.endswith("_scale_inv"):
            continue
        owner = "model.visual" if name.startswith("model.visual.") else name.removesuffix(".weight")
        assert (owner in plain) == (tensor.dtype != torch.float8_e4m3fn), name
    assert {"lm_head", "mtp.fc"} <= plain and not any(".experts." in m for m in plain)
    assert ("model.visual" in plain) == (src.name in NESTED)


def test_fp8_dequantized_weights_are_close_to_the_originals(
    fp8: tuple[Path, Path, tuple[int, int]],
) -> None:
    src, dst, _ = fp8
    twin, original = tensors(dequantized_twin(dst)), tensors(src)
    for name, w in original.items():
        # e4m3 keeps 3 mantissa bits (error <= |w| / 16), subnormals 2^-9 of the scale
        bound = w.abs() / 16 + w.abs().max() / 448 / 512
        assert ((twin[name] - w).abs() <= bound).all(), name
