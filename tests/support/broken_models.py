"""Damaged copies of a tiny checkpoint, each broken the way downloads and
disks break them.

Contract: ``write_broken_models(root)`` writes a sound tiny checkpoint
(``checkpoints.py``), a sharded one and a GGUF of it, then one damaged copy
per ``BROKEN`` entry, and returns each copy's path (a folder, or a ``.gguf``
file) with the file its error must name and the words that say what is
wrong with it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.gguf_files import write_gguf

SHARD_2 = "model-00002-of-00002.safetensors"


@dataclass(frozen=True)
class Broken:
    model: Path  # what --model is given
    culprit: Path  # the file the message must name
    fault: str  # words of the message that say what is wrong


def write_broken_models(root: Path) -> dict[str, Broken]:
    good = write_tiny_checkpoint(root / "good")
    sharded = write_tiny_checkpoint(root / "sharded", num_shards=2)
    gguf = write_gguf(good, root / "good.gguf")
    out: dict[str, Broken] = {}

    def copy(name: str, source: Path) -> Path:
        return Path(shutil.copytree(source, root / name))

    folder = copy("truncated-safetensors", good)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out["truncated safetensors"] = Broken(folder, weights, "is truncated")

    folder = copy("corrupt-safetensors", good)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header's first bytes
    weights.write_bytes(bytes(data))
    out["corrupt safetensors header"] = Broken(folder, weights, "is corrupt")

    folder = copy("shard-gone", sharded)
    (folder / SHARD_2).unlink()
    index = folder / "model.safetensors.index.json"
    out["shard named by the index is gone"] = Broken(folder, index, f"names {SHARD_2}")

    folder = copy("shard-not-indexed", sharded)
    index = folder / "model.safetensors.index.json"
    table = json.loads(index.read_text())
    table["weight_map"] = {k: v for k, v in table["weight_map"].items() if v != SHARD_2}
    index.write_text(json.dumps(table))
    out["shard missing from the index"] = Broken(folder, index, "leaves out 1 of the 2 shards")

    folder = copy("config-not-json", good)
    config = folder / "config.json"
    config.write_text(config.read_text()[:40])  # cut off mid-object
    out["config.json not JSON"] = Broken(folder, config, "is not JSON")

    truncated = root / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[:-1000])
    out["truncated gguf"] = Broken(truncated, truncated, "is truncated: its tensors need")

    corrupt = root / "corrupt.gguf"
    data = bytearray(gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # the tensor and field counts
    corrupt.write_bytes(bytes(data))
    out["corrupt gguf header"] = Broken(corrupt, corrupt, "is corrupt")
    return out
