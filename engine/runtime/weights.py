"""Named tensors read on demand from safetensors files.

Contract: a ``WeightStore`` maps tensor names to the file that holds them and
reads one tensor (or one header) per call, so no more than one weight is held
by the store at a time. A name that is missing, or a file that cannot be read,
raises ``CheckpointError`` naming it.

The store is the one place that knows how weights are stored. Built with a
``BlockFp8`` (``runtime/fp8.py``), ``get`` returns each FP8 weight
dequantized to float32 from its scale, and the scales are not weights:
``names()``, ``in`` and ``get`` know them not. Every other tensor comes back
in the dtype it is stored in; callers cast.

A damaged file (truncated, a corrupt header, an index naming a shard that is
absent or leaving out shards of its series) is refused when the store opens
or reads its headers, before any weight is read, with the file and the fault
(``load/file_checks.py``).

A store may present stored names under other names (``renamed``): Qwen3.5's
``model.language_model.*`` read as ``model.*``, with its vision tower left out.
``headers`` still lists every stored tensor under its stored name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from metrale.engine.load.file_checks import AGAIN, index_problem, safetensors_problem
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.fp8 import BlockFp8, dequantize


@dataclass(frozen=True)
class TensorHeader:
    """A stored tensor as its safetensors header gives it."""

    dtype: str  # safetensors' name: "F32", "BF16", "F8_E4M3", "I32", ...
    shape: tuple[int, ...]


class WeightStore:
    """Names -> safetensors file; tensors are read on demand."""

    def __init__(
        self,
        files: dict[str, Path],
        quant: BlockFp8 | None = None,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        """``files``: every stored tensor, scales included; ``quant``: how FP8
        weights are laid out (``None``: the checkpoint declares no quantization);
        ``rename``: the name a stored tensor is read under (None: left out)."""
        self.quant = quant
        self.stored = files
        scales = {quant.scale_name(n) for n in files} & files.keys() if quant else set()
        self._source: dict[str, str] = {}
        for name in files:
            shown = rename(name) if rename is not None else name
            if name not in scales and shown is not None:
                self._source[shown] = name
        self.files = {shown: files[name] for shown, name in self._source.items()}

    def renamed(self, rename: Callable[[str], str | None]) -> WeightStore:
        """This store's tensors under ``rename``'s names (module doc)."""
        return WeightStore(self.stored, self.quant, rename)

    @classmethod
    def open_folder(cls, folder: Path, quant: BlockFp8 | None = None) -> WeightStore:
        """``model.safetensors``, or the shards ``model.safetensors.index.json`` names."""
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.exists():
            weight_map = _weight_map(index)
            problem = index_problem(index, set(weight_map.values()))
            if problem is not None:
                raise CheckpointError(problem)
            return cls({name: folder / file for name, file in weight_map.items()}, quant)
        if single.exists():
            return cls.open_file(single, quant)
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json "
            "(only safetensors weights are read)"
        )

    @classmethod
    def open_file(cls, file: Path, quant: BlockFp8 | None = None) -> WeightStore:
        try:
            with safe_open(str(file), framework="pt") as handle:
                return cls(dict.fromkeys(handle.keys(), file), quant)
        except Exception as exc:  # safetensors raises its own error types
            raise _unreadable(file, exc) from exc

    def names(self) -> list[str]:
        return sorted(self.files)

    def stored_name(self, name: str) -> str:
        """The name ``name`` is stored under (itself unless ``renamed``)."""
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        return self._source[name]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        stored = self._source[name]
        tensor = self._read(stored)
        if tensor.dtype == torch.float8_e4m3fn:
            return self._dequantized(stored, tensor)
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``, read from the header only."""
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(self._source[name]).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype of ``name`` (safetensors' name, e.g. ``"BF16"``),
        read from the header only."""
        if name not in self.files:
            raise CheckpointError(f"weight {name!r} is missing from the checkpoint")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            return str(handle.get_slice(self._source[name]).get_dtype())

    def headers(self) -> dict[str, TensorHeader]:
        """Every stored tensor, scales included, from the headers only (each
        file is opened once)."""
        by_file: dict[Path, list[str]] = {}
        for name, file in self.stored.items():
            by_file.setdefault(file, []).append(name)
        out: dict[str, TensorHeader] = {}
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    held = set(handle.keys())
                    for name in names:
                        if name not in held:
                            raise CheckpointError(
                                f"{file} does not hold {name!r}, which the index puts there; "
                                f"{AGAIN}"
                            )
                        piece = handle.get_slice(name)
                        out[name] = TensorHeader(piece.get_dtype(), tuple(piece.get_shape()))
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error types
                raise _unreadable(file, exc) from exc
        return out

    def _read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.stored[name]), framework="pt") as handle:
            tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def _dequantized(self, name: str, q: torch.Tensor) -> torch.Tensor:
        """``q`` [..., out, in] as the float32 its block scales make of it."""
        if self.quant is None:
            raise CheckpointError(
                f"tensor {name!r} is stored in FP8 but config.json declares no quantization_config"
            )
        scale_name = self.quant.scale_name(name)
        scale = self._read(scale_name) if scale_name in self.stored else None
        found = None if scale is None else tuple(scale.shape)
        self.quant.check_scale(name, tuple(q.shape), found)
        assert scale is not None
        return dequantize(q, scale, self.quant.block)  # [..., out, in]


def _weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> shard file), checked."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{index} is not JSON ({exc}); {AGAIN}") from exc
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} has no weight_map object; {AGAIN}") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to files; {AGAIN}")
    return weight_map


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    """A file safetensors could not open: the fault in its framing when it
    has one (``file_checks.py``), else the library's words."""
    try:
        problem = safetensors_problem(file)
    except OSError as os_error:
        problem = f"cannot read {file}: {os_error.strerror or os_error}"
    return CheckpointError(problem or f"cannot read {file}: {exc}")
