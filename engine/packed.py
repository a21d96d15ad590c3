"""Weights kept packed in memory and multiplied in float32.

Contract: a checkpoint folder may carry ``packed.safetensors`` beside its
``model.safetensors``: for some ``[n, k]`` linear weights, the same values in
a smaller exact encoding (GGUF Q4_1 or Q8_0 blocks, or bfloat16). Decoding a
packed weight gives, bit for bit, the float32 tensor ``model.safetensors``
holds under the same name, so the dense and packed runtimes load one model.
The embedded default model is written with one (its GGUF is Q4_1/Q8_0).
A checkpoint stored in bfloat16 needs no such file: ``Bf16Source`` runs its
bfloat16 linear weights packed as they are (widening to float32 is exact),
half the bytes of the float32 copy the dense path would make.

``packed.safetensors`` holds ``{name}.data`` (uint8 ``[n, row_bytes]``) and
``{name}.scales`` (float32 ``[n, row_scales]``) per weight, and the header
metadata maps each name to its format.

``PackedWeight.matmul`` runs ``x @ w.T`` in the C kernel for up to
``KERNEL_ROWS`` rows (decode and verify steps, bound by memory: a quarter
to a sixth of the bytes of float32 to stream), and decodes the weight once
and hands it to BLAS above that (prefill, bound by arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from metrale.engine.checkpoint import WeightStore
from metrale.engine.packed_kernel import FORMATS, PackedKernel

PACKED_FILE = "packed.safetensors"

# Above this many rows BLAS on the decoded float32 weight is faster than the
# kernel. Measured over the default model's 120 projections, 2 cores: kernel
# / decode+BLAS = 0.43 at 16 rows, 0.78 at 32, 0.78 at 48, 1.07 at 64, 1.6
# at 128 (3-6x faster than float32 BLAS at 1-4 rows).
KERNEL_ROWS = 48


_BYTES_PER_VALUE = {"q4_1": 0.5, "q8_0": 1.0, "bf16": 2.0}


@dataclass(frozen=True)
class PackedWeight:
    """A ``[n, k]`` linear weight in ``fmt`` (``q4_1``, ``q8_0`` or ``bf16``)."""

    fmt: str
    data: torch.Tensor  # [n, row_bytes] uint8
    scales: torch.Tensor  # [n, row_scales] float32; [n, 0] for bf16
    kernel: PackedKernel
    shape: tuple[int, int] = field(init=False)  # [n, k] of the weight it stands for

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown packed format {self.fmt!r}; known: {', '.join(FORMATS)}")
        if self.data.dtype != torch.uint8 or self.scales.dtype != torch.float32:
            raise ValueError("packed data must be uint8 and scales float32")
        # Read on every product: computed once (frozen, hence object.__setattr__).
        rows, row_bytes = self.data.shape
        object.__setattr__(self, "shape", (rows, int(row_bytes / _BYTES_PER_VALUE[self.fmt])))

    def dense(self) -> torch.Tensor:
        """The float32 weight ``[n, k]``."""
        n, k = self.shape
        return self.kernel.decode(self.fmt, self.data, self.scales, n, k)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, k]`` float32 -> ``[rows, n]``. Rows
        computed by the kernel (up to ``KERNEL_ROWS``) are batch-invariant."""
        n, k = self.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
            raise ValueError(
                f"a packed [{n}, {k}] weight takes float32 CPU rows of {k}, "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        if x.shape[0] > KERNEL_ROWS:
            return F.linear(x, self.dense())
        return self.kernel.linear(self.fmt, x.contiguous(), self.data, self.scales, n)

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The weight's rows ``index`` (int64), in that order."""
        return PackedWeight(
            self.fmt,
            self.data.index_select(0, index),
            self.scales.index_select(0, index),
            self.kernel,
        )

    @staticmethod
    def stack(parts: list[PackedWeight]) -> PackedWeight:
        """Rows of several weights of one format and width, as one (q/k/v, gate/up)."""
        first = parts[0]
        if any(p.fmt != first.fmt or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only packed weights of one format and width can be stacked")
        data = torch.cat([p.data for p in parts])
        scales = torch.cat([p.scales for p in parts])
        return PackedWeight(first.fmt, data, scales, first.kernel)


# The byte size of the dense model.safetensors the packed file was written
# beside; a mismatch means the dense weights changed and the file is stale.
DENSE_SIZE_KEY = "metrale.dense_size"


def packed_is_current(folder: Path) -> bool:
    """Whether ``folder`` has a packed file written for its dense weights."""
    file = folder / PACKED_FILE
    if not file.exists():
        return False
    with safe_open(str(file), framework="pt") as handle:
        return (handle.metadata() or {}).get(DENSE_SIZE_KEY) == _dense_size(folder)


def _dense_size(folder: Path) -> str:
    dense = folder / "model.safetensors"
    return str(dense.stat().st_size) if dense.exists() else "none"


class PackedSource(Protocol):
    """Where the runtime asks for a linear weight in packed form first."""

    def get(self, name: str) -> PackedWeight | None: ...


class PackedStore:
    """The packed weights of a folder, read on demand."""

    def __init__(self, file: Path, formats: dict[str, str], kernel: PackedKernel) -> None:
        self.file = file
        self.formats = formats
        self.kernel = kernel

    @classmethod
    def open(cls, folder: Path, kernel: PackedKernel) -> PackedStore | None:
        """The folder's packed weights; ``None`` when it has none, or when they
        were written for another ``model.safetensors`` (a folder whose dense
        weights changed since: its packed copy would be a different model)."""
        if not packed_is_current(folder):
            return None
        file = folder / PACKED_FILE
        with safe_open(str(file), framework="pt") as handle:
            formats = dict(handle.metadata() or {})
        for key in ("format", DENSE_SIZE_KEY):
            formats.pop(key, None)
        return cls(file, formats, kernel)

    def get(self, name: str) -> PackedWeight | None:
        if name not in self.formats:
            return None
        with safe_open(str(self.file), framework="pt") as handle:
            data = handle.get_tensor(f"{name}.data")
            scales = handle.get_tensor(f"{name}.scales")
        return PackedWeight(self.formats[name], data, scales, self.kernel)


class Bf16Source:
    """The bfloat16 ``[n, k]`` weights of a store, packed as they are."""

    def __init__(self, store: WeightStore, kernel: PackedKernel) -> None:
        self.store = store
        self.kernel = kernel

    def get(self, name: str) -> PackedWeight | None:
        if name not in self.store:
            return None
        value = self.store.get(name)
        if value.dtype != torch.bfloat16 or value.dim() != 2 or value.shape[1] % 32:
            return None
        rows = value.shape[0]
        data = value.contiguous().view(torch.uint8).reshape(rows, -1)  # [n, 2 * k]
        return PackedWeight("bf16", data, torch.zeros(rows, 0, dtype=torch.float32), self.kernel)


def save_packed(weights: dict[str, tuple[str, torch.Tensor, torch.Tensor]], file: Path) -> None:
    """Writes ``{name: (fmt, data, scales)}`` in the layout ``PackedStore`` reads,
    tied to the ``model.safetensors`` beside ``file`` (written first)."""
    tensors: dict[str, torch.Tensor] = {}
    formats = {"format": "pt", DENSE_SIZE_KEY: _dense_size(file.parent)}
    for name, (fmt, data, scales) in weights.items():
        tensors[f"{name}.data"] = data.contiguous()
        tensors[f"{name}.scales"] = scales.contiguous()
        formats[name] = fmt
    save_file(tensors, str(file), metadata=formats)
