"""Block-FP8 checkpoints load exactly; every other quantization is refused by name.

A tiny dense Qwen3 is built with transformers' own classes, then quantized
here to block FP8 the way ``*-FP8`` releases are (per block
``scale = amax / 448``, ``q = w / scale`` in ``float8_e4m3fn``, the scale
stored beside the weight), with sizes that are not multiples of the block so
the last blocks are partial. Its twin holds ``q.float() * scale`` in float32,
computed block by block: metrale must run the two as the same model.
"""

from __future__ import annotations

import json
import re
import shutil
from math import ceil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.load.loader import load_model
from metrale.engine.load.quant import SUPPORTED, read_quant
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.fp8 import BlockFp8
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.weights import WeightStore
from tests.support.checkpoints import EOS_ID, TINY_VOCAB, _save_weights, write_byte_tokenizer
from tests.support.engine_runs import CHECKPOINT_PROMPTS, outputs, requests

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
PLAIN_MODULE = "model.layers.1.mlp.down_proj"  # listed as not converted: stays float32
# name -> (quant_method, block, shards). The sharded case puts scales and
# their weights in different files.
CASES: dict[str, tuple[str, tuple[int, int], int]] = {
    "fp8-128x128": ("fp8", (128, 128), 1),
    "fp8-32x48-sharded": ("fp8", (32, 48), 2),
    "compressed-tensors-128x128": ("compressed-tensors", (128, 128), 1),
}
SCALE_SUFFIX = {"fp8": "_scale_inv", "compressed-tensors": "_scale"}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}, "gptq"),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm", "zero_point": True}, "awq"),
    "bitsandbytes": (
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "bitsandbytes",
    ),
    "load_in_8bit": ({"load_in_8bit": True}, "bitsandbytes"),
    "unknown": ({"quant_method": "mystery"}, "mystery"),
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per tensor"),
    "fp8-static": (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        "static activation scales",
    ),
    "compressed-tensors-int4": (
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}},
        },
        "compressed-tensors (format pack-quantized)",
    ),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 as transformers saves it, in float32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("dense")
    config = Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=160,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.08,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms of ones would hide a runtime that skips them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(path))
    write_byte_tokenizer(path)
    return path


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [out, in] -> (q [out, in] float8_e4m3fn, scale [ceil(out/b0), ceil(in/b1)])."""
    b0, b1 = block
    scale = torch.empty(ceil(w.shape[0] / b0), ceil(w.shape[1] / b1))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = tile.abs().amax() / FP8_MAX
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / scale[i, j]).to(q.dtype)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q.float() * scale``, one block at a time. [out, in] float32."""
    b0, b1 = block
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].float()
            out[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = tile * scale[i, j]
    return out


def quant_config(method: str, block: tuple[int, int]) -> dict[str, Any]:
    """The config.json entry of a block-FP8 release (``fp8``) or of
    compressed-tensors' FP8_BLOCK scheme."""
    if method == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head", PLAIN_MODULE],
        }
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True}
    acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}
    group = {
        "format": "float-quantized",
        "targets": ["Linear"],
        "weights": {**weights, "dynamic": False, "block_structure": list(block)},
        "input_activations": {**acts, "dynamic": True},
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", PLAIN_MODULE],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "quantization_status": "compressed",
    }


def write_variant(
    source: Path,
    path: Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any] | None = None,
    shards: int = 1,
) -> Path:
    """``source``'s folder with other tensors and, when given, ``quantization_config``."""
    shutil.copytree(source, path)
    (path / "model.safetensors").unlink()
    _save_weights(path, tensors, shards)
    if config is not None:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    return path


def is_quantized(name: str) -> bool:
    return name.endswith("_proj.weight") and not name.startswith(PLAIN_MODULE)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(
    request: pytest.FixtureRequest, dense: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(block-FP8 checkpoint, its float32 dequantized twin)."""
    method, block, shards = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    stored: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(dense / "model.safetensors")).items():
        if not is_quantized(name):
            stored[name] = twin[name] = w
            continue
        q, scale = quantize(w, block)
        stored[name], stored[name + SCALE_SUFFIX[method]] = q, scale
        twin[name] = dequantized(q, scale, block)
    config = quant_config(method, block)
    return (
        write_variant(dense, root / "fp8", stored, config, shards),
        write_variant(dense, root / "twin", twin),
    )


def greedy(folder: Path) -> dict[str, list[int]]:
    loaded = load_model(folder, RuntimeConfig(device="cpu", dtype="float32", num_slots=4))
    prompts = [loaded.tokenizer.encode(p) for p in CHECKPOINT_PROMPTS]
    engine = Engine.from_loaded(loaded, EngineConfig(max_batch=4))
    return outputs(list(engine.generate(requests(prompts, max_tokens=20))))


def prefill_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    ckpt = read_checkpoint(folder)
    model = LlamaModel(
        ckpt.spec,
        ckpt.hf_config,
        ckpt.weights,
        num_slots=1,
        max_len=128,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return model.forward([Segment(0, 0, ids)]).logits  # [len(ids), vocab]


def test_block_fp8_generates_token_for_token_what_its_dequantized_twin_does(
    pair: tuple[Path, Path],
) -> None:
    fp8, twin = pair
    assert greedy(fp8) == greedy(twin)


def test_block_fp8_logits_equal_the_dequantized_twins(pair: tuple[Path, Path], dense: Path) -> None:
    fp8, twin = pair
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    got, expected = prefill_logits(fp8, ids), prefill_logits(twin, ids)
    assert (got - expected).abs().max().item() <= 1e-5
    # The quantization is not a no-op: reading the FP8 values as the original
    # weights would have been caught.
    assert (prefill_logits(dense, ids) - expected).abs().max().item() > 1e-3


def test_the_store_dequantizes_fp8_weights_and_hides_their_scales(
    pair: tuple[Path, Path],
) -> None:
    fp8, twin = pair
    ckpt = read_checkpoint(fp8)
    twin_weights = load_file(str(twin / "model.safetensors"))
    assert ckpt.quant is not None and ckpt.weights.quant == ckpt.quant
    assert ckpt.quant.skip == ("lm_head", PLAIN_MODULE)
    assert ckpt.weights.names() == sorted(twin_weights)  # no scale is a weight
    scale = ckpt.quant.scale_name("model.layers.0.mlp.up_proj.weight")
    assert scale in ckpt.weights.stored and scale not in ckpt.weights
    with pytest.raises(CheckpointError, match="missing"):
        ckpt.weights.get(scale)
    for name in ("model.layers.0.self_attn.k_proj.weight", PLAIN_MODULE + ".weight"):
        value = ckpt.weights.get(name)
        assert value.dtype == torch.float32 and torch.equal(value, twin_weights[name])


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_declared_block_fp8_is_read_from_either_config_key(case: str) -> None:
    method, block, _ = CASES[case]
    expected = BlockFp8(block, method, SCALE_SUFFIX[method], ("lm_head", PLAIN_MODULE))
    assert read_quant({"quantization_config": quant_config(method, block)}) == expected
    assert read_quant({"compression_config": quant_config(method, block)}) == expected
    assert read_quant({"quantization_config": None}) is None and read_quant({}) is None


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_quantizations_are_refused_naming_the_method(case: str) -> None:
    config, named = REFUSED[case]
    for key in ("quantization_config", "compression_config"):
        with pytest.raises(CheckpointError) as caught:
            read_quant({key: config})
        assert named in str(caught.value) and SUPPORTED in str(caught.value)


def gptq_folder(dense: Path, path: Path) -> Path:
    """``dense``'s tensors under a GPTQ config (what a config says is enough)."""
    tensors = load_file(str(dense / "model.safetensors"))
    return write_variant(dense, path, tensors, REFUSED["gptq"][0])


def test_a_gptq_checkpoint_is_refused_when_read(dense: Path, tmp_path: Path) -> None:
    folder = gptq_folder(dense, tmp_path / "gptq")
    with pytest.raises(CheckpointError, match="quantized with gptq"):
        read_checkpoint(folder)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("model.layers.0.mlp.up_proj.weight", torch.zeros(200, 160, dtype=torch.float8_e4m3fn)),
        ("model.layers.0.mlp.down_proj.qweight", torch.zeros(20, 160, dtype=torch.int32)),
        ("model.layers.0.mlp.down_proj.scales", torch.zeros(2, 160, dtype=torch.float16)),
    ],
)
def test_a_quantized_tensor_without_a_quantization_config_is_refused_by_name(
    dense: Path, tmp_path: Path, name: str, value: torch.Tensor
) -> None:
    tensors = {**load_file(str(dense / "model.safetensors")), name: value}
    folder = write_variant(dense, tmp_path / "stray", tensors)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(folder)
    assert repr(name) in str(caught.value) and "no quantization_config" in str(caught.value)
    if value.dtype == torch.float8_e4m3fn:  # the store alone refuses it too
        with pytest.raises(CheckpointError, match="FP8"):
            WeightStore.open_folder(folder).get(name)


@pytest.mark.parametrize("scale", [torch.ones(1, 2), None], ids=["wrong-shape", "missing"])
def test_a_scale_that_does_not_fit_its_weight_is_refused_naming_both(
    pair: tuple[Path, Path], tmp_path: Path, scale: torch.Tensor | None
) -> None:
    fp8, _ = pair
    ckpt = read_checkpoint(fp8)
    assert ckpt.quant is not None
    name = "model.layers.1.mlp.gate_proj.weight"  # [200, 160]
    scale_name = ckpt.quant.scale_name(name)
    tensors = {n: t for f in fp8.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    del tensors[scale_name]
    if scale is not None:
        tensors[scale_name] = scale
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    folder = write_variant(fp8.parent / "twin", tmp_path / "bad", tensors, config)
    expected = str(list(ckpt.quant.scale_shape((200, 160))))
    for read in (
        lambda: read_checkpoint(folder),
        lambda: WeightStore.open_folder(folder, ckpt.quant).get(name),
    ):
        with pytest.raises(CheckpointError) as caught:
            read()
        assert repr(name) in str(caught.value) and expected in str(caught.value)


def test_generate_on_a_gptq_checkpoint_is_a_usage_error_naming_the_method(
    dense: Path, tmp_path: Path
) -> None:
    folder = gptq_folder(dense, tmp_path / "gptq")
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(folder), "--device", "cpu"],
        input='{"prompt": "hi"}\n',
        env={"COLUMNS": "400", "NO_COLOR": "1"},
    )
    assert result.exit_code == 2, result.output
    assert "gptq" in result.stderr and "block-FP8" in result.stderr
    assert result.stdout == ""


def test_info_names_the_block_fp8_layout(pair: tuple[Path, Path]) -> None:
    fp8, twin = pair
    shown = {}
    for folder in (fp8, twin):
        result = CliRunner().invoke(app, ["info", str(folder)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        shown[folder] = " ".join(result.output.split())
    assert re.search(r"quantization block FP8 e4m3, \d+x\d+ blocks", shown[fp8])
    assert "quantization none" in shown[twin]
