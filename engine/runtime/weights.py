"""Named tensors read on demand from safetensors files.

Contract: a ``WeightStore`` maps tensor names to the file that holds them and
reads one tensor (or one header) per call, so no more than one weight is held
by the store at a time. A name that is missing, or a file that cannot be read,
raises ``CheckpointError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from metrale.engine.runtime.arch import CheckpointError


class WeightStore:
    """Names -> safetensors file; tensors are read on demand."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    @classmethod
    def open_folder(cls, folder: Path) -> WeightStore:
        """``model.safetensors``, or the shards ``model.safetensors.index.json`` names."""
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            return cls({name: folder / file for name, file in weight_map.items()})
        if single.exists():
            return cls.open_file(single)
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json "
            "(only safetensors weights are read)"
        )

    @classmethod
    def open_file(cls, file: Path) -> WeightStore:
        try:
            with safe_open(str(file), framework="pt") as handle:
                return cls(dict.fromkeys(handle.keys(), file))
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {file}: {exc}") from exc

    def names(self) -> list[str]:
        return sorted(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, read from the header only."""
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())
