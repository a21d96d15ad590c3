"""A `.gguf` file as the model: converted once, exactly, or refused by name."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.engine.config import RuntimeConfig
from metrale.engine.load import gguf_cache, loader
from metrale.engine.load.convert_once import STAMP
from metrale.engine.load.gguf_config import GgufError
from metrale.engine.load.loader import LoadedModel, load_model
from metrale.engine.runtime.llama import LlamaModel
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.packed import PackedWeight
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.engine_runs import TWIN_PROMPTS, twin_greedy
from tests.support.gguf_files import dequantized_twin, write_gguf
from tests.support.rope_scalings import LLAMA3_ROPE

RUNTIME = RuntimeConfig(device="cpu", dtype="float32", num_slots=3, max_len=128)
WIDE = {"COLUMNS": "400", "NO_COLOR": "1"}


pytestmark = pytest.mark.usefixtures("cache_root")


def tiny(
    tmp_path: Path, family: str = "llama", tie_embeddings: bool = False, wide: bool = False
) -> Path:
    """The tiny checkpoint; ``wide`` rows hold 256 values, k-quants' block."""
    return write_tiny_checkpoint(
        tmp_path / f"{family}-twin",
        family,
        tie_embeddings=tie_embeddings,
        hidden_size=256 if wide else 64,
        intermediate_size=256 if wide else 128,
    )


def prefill_logits(loaded: LoadedModel) -> torch.Tensor:
    segments = [Segment(s, 0, ids) for s, ids in enumerate(TWIN_PROMPTS)]
    return loaded.model.forward(segments).logits  # [num_tokens, vocab]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_an_f32_gguf_converts_to_its_checkpoint_tensor_for_tensor(
    tmp_path: Path, family: str
) -> None:
    # llama's q/k rows are stored permuted (and must come back unpermuted);
    # Qwen's are stored as they are, with q/k/v biases (qwen2) or q/k norms (qwen3).
    twin = tiny(tmp_path, family)
    folder = gguf_cache.ensure_gguf_model(write_gguf(twin, tmp_path / "m.gguf"))
    ours, theirs = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(twin / "model.safetensors")),
    )
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    config, twin_config = (json.loads((f / "config.json").read_text()) for f in (folder, twin))
    for key in ("model_type", "architectures", "num_key_value_heads", "tie_word_embeddings"):
        assert config[key] == twin_config[key], key
    assert config["rope_parameters"] == twin_config["rope_parameters"]
    assert np.float32(config["rms_norm_eps"]) == np.float32(twin_config["rms_norm_eps"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_f32_gguf_generates_what_its_checkpoint_generates(tmp_path: Path, family: str) -> None:
    twin = tiny(tmp_path, family, tie_embeddings=family == "qwen3")
    path = write_gguf(twin, tmp_path / "m.gguf")
    ours, theirs = load_model(str(path), RUNTIME), load_model(twin, RUNTIME)
    assert torch.equal(prefill_logits(ours), prefill_logits(theirs))
    assert twin_greedy(ours) == twin_greedy(theirs)
    assert (
        ours.eos_token_ids == theirs.eos_token_ids
    )  # EOS and end of turn: <|endoftext|>, <|im_end|>
    assert ours.name == "m" and ours.info.source.startswith(f"gguf file {path}")


def test_llama3_rope_scaling_is_read_back_from_its_divisors(tmp_path: Path) -> None:
    # Heads of 32: 16 frequencies, two of them smoothed between the two wavelengths.
    twin = write_tiny_checkpoint(
        tmp_path / "llama3", "llama", num_heads=2, rope_parameters=LLAMA3_ROPE
    )
    path = write_gguf(twin, tmp_path / "m.gguf")
    ours, theirs = load_model(str(path), RUNTIME), load_model(twin, RUNTIME)
    config = json.loads((ours.folder / "config.json").read_text())
    assert config["rope_parameters"] == LLAMA3_ROPE
    assert "rope_freqs.weight" not in load_file(str(ours.folder / "model.safetensors"))
    assert torch.equal(prefill_logits(ours), prefill_logits(theirs))


def test_rope_divisors_no_llama3_scaling_gives_are_refused(tmp_path: Path) -> None:
    twin = write_tiny_checkpoint(
        tmp_path / "llama3", "llama", num_heads=2, rope_parameters=LLAMA3_ROPE
    )
    path = write_gguf(twin, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(path), "r+")
    (divisors,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    divisors.data[3] *= 1.5  # memory-mapped: edits the file
    del reader
    with pytest.raises(GgufError, match=r"rope_freqs\.weight holds RoPE divisors"):
        gguf_cache.ensure_gguf_model(path)


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    twin = tiny(tmp_path)
    ours = load_model(str(write_gguf(twin, tmp_path / "m.gguf")), RUNTIME).tokenizer
    theirs = load_model(twin, RUNTIME).tokenizer
    text = "héllo <|im_start|>user\n wörld<|im_end|>"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    chat = [{"role": "user", "content": "hi"}]
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    assert ours.apply_chat_template(chat, **kwargs) == theirs.apply_chat_template(chat, **kwargs)


# The block types and the packed format each is held in (K-quants need rows of 256).
BLOCK_TYPES = {
    "Q8_0": "q8_0",
    "Q4_1": "q4_1",
    "Q4_0": "q4_0",
    "Q5_0": "q5_0",
    "Q5_1": "q5_1",
    "Q4_K": "q4_1",
    "Q5_K": "q5_1",
    "Q6_K": "q6_k",
}


@pytest.mark.parametrize("qtype", list(BLOCK_TYPES))
def test_a_block_gguf_generates_what_its_dequantized_twin_generates(
    tmp_path: Path, qtype: str
) -> None:
    source = tiny(tmp_path, wide=qtype.endswith("_K"))
    twin = dequantized_twin(source, tmp_path / "dequantized", qtype)
    path = write_gguf(source, tmp_path / "m.gguf", qtype)
    dense = RuntimeConfig(**{**vars(RUNTIME), "weights": "dense"})
    ours, theirs = load_model(str(path), dense), load_model(twin, dense)
    assert torch.equal(prefill_logits(ours), prefill_logits(theirs))
    assert twin_greedy(ours) == twin_greedy(theirs)
    packed = load_model(str(path), RUNTIME)  # the blocks as stored, in the CPU kernel
    assert packed.info.weights == f"packed ({BLOCK_TYPES[qtype]})"
    assert twin_greedy(packed) == twin_greedy(theirs) == twin_greedy(packed, lookup=True)


# Types as llama.cpp's Q4_K_M gives a model whose rows are not all of 256:
# Q5_0 where Q4_K cannot go, v in Q8_0 (for Q6_K), down in Q4_K or Q6_K.
Q4_K_M_LIKE = {
    "v_proj": "Q8_0",
    "layers.0.mlp.down_proj": "Q4_K",
    "layers.1.mlp.down_proj": "Q6_K",
    "embed_tokens": "Q8_0",
    "lm_head": "Q6_K",
}


def test_a_gguf_of_mixed_types_runs_every_layer_packed_as_its_dequantized_twin(
    tmp_path: Path,
) -> None:
    # q/k in Q5_0 and v in Q8_0 stack as parts, so each layer's four
    # products stay packed and the whole stack runs in the C layers.
    source = tiny(tmp_path, wide=True)
    twin = dequantized_twin(source, tmp_path / "dequantized", "Q5_0", Q4_K_M_LIKE)
    path = write_gguf(source, tmp_path / "m.gguf", "Q5_0", Q4_K_M_LIKE)
    packed = load_model(str(path), RUNTIME)
    assert packed.info.weights == "packed (q4_1, q5_0, q6_k, q8_0)"
    assert packed.info.gguf_blocks == "Q5_0 x 10, F32 x 5, Q8_0 x 3, Q6_K x 2, Q4_K x 1"
    model = packed.model
    assert isinstance(model, LlamaModel) and model.stack.fused is not None
    qkv = model.stack.blocks[0].qkv
    assert isinstance(qkv, PackedWeight) and [p.fmt for p in qkv.parts] == ["q5_0", "q8_0"]
    theirs = load_model(twin, RuntimeConfig(**{**vars(RUNTIME), "weights": "dense"}))
    assert twin_greedy(packed) == twin_greedy(theirs) == twin_greedy(packed, lookup=True)


def test_without_the_kernel_a_k_quant_gguf_runs_dense_and_generates_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No C compiler (or METRALE_NO_KERNEL): the dense float32 weights the
    # conversion wrote, the same model.
    path = write_gguf(tiny(tmp_path, wide=True), tmp_path / "m.gguf", "Q4_K")
    packed = twin_greedy(load_model(str(path), RUNTIME))
    monkeypatch.setattr(loader, "packed_kernel", lambda: None)
    monkeypatch.setattr(loader, "kernel_problem", lambda: "no C compiler (cc or gcc) on PATH")
    fallback = load_model(str(path), RUNTIME)
    assert fallback.info.weights == "dense (no C compiler (cc or gcc) on PATH)"
    assert twin_greedy(fallback) == packed


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_half_precision_gguf_keeps_its_dtype(tmp_path: Path, qtype: str) -> None:
    source = tiny(tmp_path)
    twin = dequantized_twin(source, tmp_path / "rounded", qtype)
    folder = gguf_cache.ensure_gguf_model(write_gguf(source, tmp_path / "m.gguf", qtype))
    ours, theirs = (
        load_file(str(folder / "model.safetensors")),
        load_file(str(twin / "model.safetensors")),
    )
    dtype = torch.float16 if qtype == "F16" else torch.bfloat16
    assert ours["model.layers.0.self_attn.q_proj.weight"].dtype == dtype
    assert all(torch.equal(ours[name].float(), theirs[name]) for name in theirs)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "IQ4_NL"])
def test_an_unsupported_tensor_type_is_refused_naming_it_and_the_tensor(
    tmp_path: Path, cache_root: Path, qtype: str
) -> None:
    path = write_gguf(tiny(tmp_path, wide=True), tmp_path / "m.gguf", qtype)
    first = gguf.GGUFReader(str(path)).tensors[0].name  # a 2-D weight: norms stay F32
    with pytest.raises(
        GgufError, match=rf"tensor {first} is {qtype}; .*F32, F16, BF16, Q4_0, Q4_1, .*Q6_K"
    ):
        load_model(str(path), RUNTIME)
    assert not any(cache_root.iterdir())  # no folder, finished or not


def metadata_only(path: Path, arch: str, **numbers: int) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in numbers.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_other_architectures_and_mixtures_of_experts_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(GgufError, match=r"architecture 'gemma2' is not supported; .*qwen3"):
        gguf_cache.ensure_gguf_model(metadata_only(tmp_path / "g.gguf", "gemma2"))
    mixtral = metadata_only(tmp_path / "x.gguf", "llama", expert_count=8)
    with pytest.raises(GgufError, match=r"llama\.expert_count is 8"):
        gguf_cache.ensure_gguf_model(mixtral)


def test_a_gguf_converts_once_and_again_when_the_file_changes(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny(tmp_path), tmp_path / "m.gguf")
    first = gguf_cache.ensure_gguf_model(path)
    assert json.loads((first / STAMP).read_text())["source"] == str(path.resolve())

    def never(*_: Any) -> None:
        raise AssertionError("converted twice")

    with monkeypatch.context() as patched:
        patched.setattr(gguf_cache, "convert_gguf", never)
        assert gguf_cache.ensure_gguf_model(path) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new copy
    second = gguf_cache.ensure_gguf_model(path)
    assert second != first and (second / STAMP).exists()
    assert [p.name for p in cache_root.iterdir()] == [second.name]  # the stale one is gone


def test_info_names_the_gguf_and_its_block_types_and_refuses_a_bad_one_with_exit_2(
    tmp_path: Path,
) -> None:
    path = write_gguf(tiny(tmp_path), tmp_path / "m.gguf", "Q5_0")
    result = CliRunner().invoke(app, ["info", str(path)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert f"gguf file {path}" in result.output
    # 16 weights in Q5_0 (7 a layer, the embedding, the LM head), 5 norms in F32.
    assert "GGUF tensors        Q5_0 x 16, F32 x 5" in result.output
    streamed = load_model(str(path), RUNTIME).info.streamed_bytes
    assert f"({streamed:,} bytes) a decoded token reads" in result.output
    bad = write_gguf(tiny(tmp_path / "k", wide=True), tmp_path / "k.gguf", "Q3_K")
    result = CliRunner().invoke(app, ["info", str(bad)], env=WIDE)
    assert result.exit_code == 2
    assert "is Q3_K" in result.output
