"""Block-FP8 weights: what a checkpoint declares, and the float32 they stand for.

Contract: a ``BlockFp8`` says how a checkpoint's FP8 weights are laid out (it
is read from ``config.json`` by ``load/quant.py``). Each quantized weight
``{name}`` is ``float8_e4m3fn`` ``[..., out, in]`` beside a float scale
``{name}{scale_suffix}`` of ``[..., ceil(out / b0), ceil(in / b1)]``, one per
``b0 x b1`` block of ``block = (b0, b1)``; the last row and column of blocks
may be partial. The weight it stands for is, element by element,
``q.float() * scale`` of the element's block (``dequantize``), so a
dequantized weight is exact in float32 and independent of the device.

FP8 weights are dequantized on every device, CUDA included: the runtime has
no scaled FP8 matmul yet, so there is nothing to keep them as FP8 for.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

import torch

from metrale.engine.runtime.arch import CheckpointError

FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn


@dataclass(frozen=True)
class BlockFp8:
    """Block-FP8 weights. ``method``: the config's ``quant_method`` (``fp8``
    or ``compressed-tensors``), for messages and ``metrale info``.
    ``scale_suffix``: the scale of ``x.weight`` is ``x.weight{scale_suffix}``
    (``_scale_inv`` in ``fp8`` releases, ``_scale`` in compressed-tensors).
    ``skip``: the modules the config lists as kept unquantized (stored in
    plain floats, so nothing is done with them; kept to be shown)."""

    block: tuple[int, int] = (128, 128)
    method: str = "fp8"
    scale_suffix: str = "_scale_inv"
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.block) != 2 or min(self.block) < 1:
            raise CheckpointError(
                f"weight_block_size must be two positive sizes, got {list(self.block)}"
            )

    def scale_name(self, name: str) -> str:
        return name + self.scale_suffix

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale shape a weight of ``shape`` needs: one per block."""
        *lead, rows, cols = shape
        return (*lead, ceil(rows / self.block[0]), ceil(cols / self.block[1]))

    def check_scale(self, name: str, shape: tuple[int, ...], scale: tuple[int, ...] | None) -> None:
        """Raises unless ``scale`` (``None``: absent) is the shape ``name`` needs."""
        if len(shape) < 2:
            raise CheckpointError(
                f"tensor {name!r} is stored in FP8 but is {len(shape)}-D "
                "(block FP8 quantizes matrices only)"
            )
        expected = list(self.scale_shape(shape))
        if scale is None:
            raise CheckpointError(
                f"FP8 tensor {name!r} {list(shape)} has no {self.scale_name(name)!r} "
                f"(expected a scale of shape {expected} for blocks of {list(self.block)})"
            )
        if list(scale) != expected:
            raise CheckpointError(
                f"FP8 tensor {name!r} {list(shape)}: {self.scale_name(name)!r} is "
                f"{list(scale)}, expected {expected} for blocks of {list(self.block)}"
            )


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * scale`` of each element's block, in float32.

    Example: ``q`` ``[3, 5]``, ``block`` ``(2, 4)``, ``scale`` ``[2, 2]``:
    rows 0-1 take scale row 0 and row 2 scale row 1; columns 0-3 take scale
    column 0 and column 4 scale column 1.
    """
    rows, cols = q.shape[-2:]
    per_element = (
        scale.float()
        .repeat_interleave(block[0], dim=-2)[..., :rows, :]
        .repeat_interleave(block[1], dim=-1)[..., :cols]
    )  # [..., rows, cols]
    return q.float() * per_element
