"""Block-FP8 twins of the hybrid Qwen checkpoints, as the Qwen FP8 releases
quantize them.

Contract: ``write_fp8_twin(src, dst)`` writes ``src`` quantized to block
FP8 into ``dst`` and its dequantized float32 twin at
``dequantized_twin(dst)``; ``quantize_fp8`` / ``dequantize_fp8`` are the
block arithmetic, independent of metrale's reader.
"""

from __future__ import annotations

import json
import re
import shutil
from math import ceil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Matrices the Qwen FP8 releases keep in bf16 (the vision tower too).
FP8_PLAIN = re.compile(
    r"(embed_tokens|lm_head|mlp\.gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba"
    r"|conv1d|mtp\.fc)\.weight$"
)


def write_fp8_twin(src: Path, dst: Path, block: tuple[int, int] = (32, 32)) -> Path:
    """``src`` quantized to block FP8 into ``dst``; its dequantized twin beside it.

    Every matrix of the language model and MTP layer becomes
    ``float8_e4m3fn`` beside ``{name}_scale_inv`` [ceil(out/b0),
    ceil(in/b1)] (per block ``scale = amax / 448``, ``q = w / scale``);
    stacked experts [E, out, in] get scales [E, ...]. Kept in float and
    listed in ``modules_to_not_convert`` (module names, as the releases list
    them): embeddings, ``lm_head``, routers (``mlp.gate``),
    ``shared_expert_gate``, the DeltaNet's ``in_proj_a`` / ``in_proj_b``
    (``in_proj_ba``) and ``conv1d``, ``mtp.fc`` and ``model.visual``.
    ``quantization_config`` goes at the top of ``config.json``. The twin, at
    ``dequantized_twin(dst)``, holds ``q.float() * scale`` in float32 and no
    ``quantization_config``: a runtime must run the two as the same model.
    """
    twin_path = dequantized_twin(dst)
    for folder in (dst, twin_path):
        shutil.copytree(src, folder)
    stored: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    plain: set[str] = set()
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.visual."):
            plain.add("model.visual")
            stored[name] = twin[name] = w
        elif w.dim() < 2:
            stored[name] = twin[name] = w
        elif FP8_PLAIN.search(name):
            plain.add(name.removesuffix(".weight"))
            stored[name] = twin[name] = w
        else:
            q, scale = quantize_fp8(w, block)
            stored[name], stored[name + "_scale_inv"] = q, scale
            twin[name] = dequantize_fp8(q, scale, block)
    save_file(stored, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": sorted(plain),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def dequantized_twin(fp8_path: Path) -> Path:
    """Where ``write_fp8_twin`` puts the float32 twin of ``fp8_path``."""
    return fp8_path.with_name(fp8_path.name + "-dequantized")


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] -> ``q`` float8_e4m3fn [..., out, in] and ``scale``
    [..., ceil(out/b0), ceil(in/b1)]. An all-zero block gets a tiny scale, not
    0, so its ``q`` is 0, not NaN."""
    b0, b1 = block
    *lead, rows, cols = w.shape
    grid = (ceil(rows / b0), ceil(cols / b1))
    padded = torch.nn.functional.pad(w.float(), (0, grid[1] * b1 - cols, 0, grid[0] * b0 - rows))
    tiles = padded.reshape(*lead, grid[0], b0, grid[1], b1)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp_min(1e-12)  # [..., *grid]
    q = (w.float() / _per_element(scale, block, (rows, cols))).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * scale`` of each element's block: float32 [..., out, in]."""
    return q.float() * _per_element(scale, block, tuple(q.shape[-2:]))


def _per_element(
    scale: torch.Tensor, block: tuple[int, int], size: tuple[int, ...]
) -> torch.Tensor:
    """``scale`` [..., R, C] spread over its blocks: [..., rows, cols]."""
    rows, cols = size
    spread = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return spread.repeat_interleave(block[1], dim=-1)[..., :cols]
