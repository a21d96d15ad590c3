"""A complete dense config.json read without transformers (load/plain_config.py)
builds the same architecture and rotary tables as transformers' config class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale.engine.load.checkpoint import FAMILIES, _arch_spec, transformers_config
from metrale.engine.load.plain_config import plain_config
from metrale.engine.runtime.rope import RopeTable
from tests.support.checkpoints import write_tiny_checkpoint

DENSE = ("llama", "mistral", "qwen2", "qwen3")


def raw_config(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


def assert_same_model(raw: dict[str, Any]) -> None:
    model_type = raw["model_type"]
    family = FAMILIES[model_type]
    plain = plain_config(raw, family)
    assert plain is not None, "a complete dense config is read as written"
    theirs = transformers_config(raw, family)
    assert _arch_spec(plain, model_type, family) == _arch_spec(theirs, model_type, family)
    spec = _arch_spec(plain, model_type, family)
    ours_rope = RopeTable(plain, spec.rope_dim, 64, torch.float32, torch.device("cpu"))
    their_rope = RopeTable(theirs, spec.rope_dim, 64, torch.float32, torch.device("cpu"))
    assert torch.equal(ours_rope.cos, their_rope.cos) and torch.equal(ours_rope.sin, their_rope.sin)


@pytest.mark.parametrize("family", DENSE)
def test_a_complete_config_reads_as_transformers_reads_it(family: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    tiny = raw_config(write_tiny_checkpoint(tmp_path, family))
    # Written by transformers' own class: every field it has a default for is in the file.
    full = AutoConfig.for_model(family, **{k: v for k, v in tiny.items() if k != "model_type"})
    raw = full.to_dict()
    assert_same_model(raw)
    # The older spelling of the RoPE base (rope_theta, rope_scaling null) too.
    theta = raw.pop("rope_parameters")["rope_theta"]
    assert_same_model({**raw, "rope_theta": theta, "rope_scaling": None})


@pytest.mark.parametrize(
    "change",
    [
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        {"partial_rotary_factor": 0.5},
        {"num_key_value_heads": None},
        {"tie_word_embeddings": None},
    ],
)
def test_anything_less_plain_is_left_to_transformers(
    change: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoConfig

    tiny = raw_config(write_tiny_checkpoint(tmp_path, "llama"))
    raw = AutoConfig.for_model("llama", **{k: v for k, v in tiny.items() if k != "model_type"})
    assert plain_config({**raw.to_dict(), **change}, "llama") is None


@pytest.mark.slow
def test_the_default_model_loads_without_transformers() -> None:
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from metrale.engine.config import RuntimeConfig\n"
        "from metrale.engine.load.loader import load_model\n"
        "loaded = load_model(None, RuntimeConfig(num_slots=1))\n"
        "print('transformers' in sys.modules, type(loaded.tokenizer).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout.split() == ["False", "FastTokenizer"]
    from metrale.engine.load.default_model import ensure_default_model

    assert_same_model(raw_config(ensure_default_model()))
