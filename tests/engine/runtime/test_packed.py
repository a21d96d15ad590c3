"""Packed weights: exact decoding, the kernel's products, and a packed model
that loads and decodes like its dense twin."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.kernels.binding import PackedKernel, kernel_built_with, packed_kernel
from metrale.engine.load.gguf_convert import packed_blocks
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.packed import PACKED_FILE, PackedStore, PackedWeight, save_packed
from metrale.engine.spec.calibration import calibration_key
from metrale.lookup import PromptLookupConfig
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.gguf_quants import kernel_weight
from tests.support.packing import gguf_blocks, pack_checkpoint, quantize

# The kernel's formats, and for those only GGUF writes, the GGUF type that
# makes them (Q6_K's 16-value scales are format q6_k).
GGUF_MADE = {"q4_0": "Q4_0", "q5_0": "Q5_0", "q5_1": "Q5_1", "q6_k": "Q6_K"}
FORMATS = ("q4_1", "q8_0", "bf16", *GGUF_MADE)


@pytest.fixture(scope="module")
def kernel() -> PackedKernel:
    found = packed_kernel()
    assert found is not None, "the test machine has a C compiler: the kernel must build"
    return found


def packed(kernel: PackedKernel, w: torch.Tensor, fmt: str) -> tuple[PackedWeight, torch.Tensor]:
    if fmt in GGUF_MADE:
        made, data, scales, dense = kernel_weight(w, GGUF_MADE[fmt])
        assert made == fmt
    else:
        data, scales, dense = quantize(w, fmt)
    return PackedWeight.from_rows(fmt, data, scales, kernel), dense


def random_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoding_is_bit_exact(kernel: PackedKernel, fmt: str) -> None:
    weight, dense = packed(kernel, random_weight(37, 96, seed=1), fmt)
    assert weight.shape == (37, 96)
    assert torch.equal(weight.dense(), dense)


@pytest.mark.parametrize("gguf_type", ["Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_what_gguf_dequantizes(kernel: PackedKernel, gguf_type: str) -> None:
    # Raw blocks as a GGUF file holds them -> the converter's packing -> the
    # kernel; the reference is gguf's own numpy dequantizer.
    data, scales, _ = quantize(random_weight(24, 128, seed=2), gguf_type.lower())
    raw = gguf_blocks(data, scales, gguf_type.lower())
    tensor = SimpleNamespace(tensor_type=GGMLQuantizationType[gguf_type], data=raw)
    found = packed_blocks(tensor)
    assert found is not None
    fmt, block_data, block_scales = found
    weight = PackedWeight.from_rows(
        fmt, torch.from_numpy(block_data.copy()), torch.from_numpy(block_scales), kernel
    )
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(24, 128))
    assert torch.equal(weight.dense(), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 16, 53])
def test_product_equals_the_dense_matmul(kernel: PackedKernel, fmt: str, rows: int) -> None:
    # 150 outputs: groups of 64 and a part of one (19 strips, the last 6 of
    # 8 rows); 160 columns: chunks of 2 blocks and a remainder of 1.
    weight, dense = packed(kernel, random_weight(150, 160, seed=3), fmt)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(4))
    expected = x.double() @ dense.double().T
    torch.testing.assert_close(weight.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_result_does_not_depend_on_its_batch(kernel: PackedKernel, fmt: str) -> None:
    # Bit-equal, not close: greedy verification of a 4-row draft must see the
    # logits a single-row step would, and a prefill row those of a decode row.
    weight, _ = packed(kernel, random_weight(150, 192, seed=5), fmt)
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(6))
    batch = weight.matmul(x)
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 16):  # every tile shape, and mixes of them
        assert torch.equal(weight.matmul(x[:rows]), batch[:rows])
    assert torch.equal(weight.matmul(x[13:14]), batch[13:14])
    threads = torch.get_num_threads()
    try:  # the threads split the outputs differently, never a sum
        torch.set_num_threads(1)
        assert torch.equal(weight.matmul(x), batch)
    finally:
        torch.set_num_threads(threads)


def _cpu_has(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in line.split() for line in text.splitlines() if line.startswith("flags"))


@pytest.mark.skipif(not _cpu_has("avx512f"), reason="no AVX-512 here: one build, one path")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_avx512_paths_give_the_bits_of_the_8_wide_ones(kernel: PackedKernel, fmt: str) -> None:
    # The same source built without AVX-512 takes the 8-wide paths: every
    # shape either way (one row, the register paths to six or eight, the
    # tiles past them, an odd strip left from the pairs) and both thread
    # splits.
    narrow = kernel_built_with("-mno-avx512f")
    assert (kernel.vector_lanes, narrow.vector_lanes) == (16, 8)
    weight, _ = packed(kernel, random_weight(150, 192, seed=9), fmt)  # 19 strips
    x = torch.randn(70, 192, generator=torch.Generator().manual_seed(10))
    threads = torch.get_num_threads()
    try:  # 3 threads: shares that start on an odd strip of a group
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 70):
                wide = kernel.linear(fmt, x[:rows], weight.tiles, weight.tile_scales, 150)
                eight = narrow.linear(fmt, x[:rows], weight.tiles, weight.tile_scales, 150)
                assert torch.equal(wide, eight), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_stacking_keeps_every_row(kernel: PackedKernel) -> None:
    a, dense_a = packed(kernel, random_weight(8, 64, seed=7), "q4_1")
    b, dense_b = packed(kernel, random_weight(5, 64, seed=8), "q4_1")
    assert torch.equal(PackedWeight.stack([a, b]).dense(), torch.cat([dense_a, dense_b]))
    c, _ = packed(kernel, random_weight(5, 96, seed=9), "q8_0")
    with pytest.raises(ValueError, match="one width"):
        PackedWeight.stack([a, c])


def test_weights_in_several_formats_stack_as_parts_that_keep_every_row_s_bits(
    kernel: PackedKernel,
) -> None:
    # A GGUF's q and k in Q5_0 and its v in Q8_0: the two Q5_0 neighbours are
    # joined, the v stays its own part; each row decodes and multiplies in
    # its own format, whatever the batch.
    (q, dense_q), (k, dense_k), (v, dense_v) = (
        packed(kernel, random_weight(n, 192, seed=20 + n), fmt)
        for n, fmt in ((72, "q5_0"), (40, "q5_0"), (40, "q8_0"))
    )
    qkv = PackedWeight.stack([q, k, v])
    assert qkv.fmt == "parts" and [p.fmt for p in qkv.parts] == ["q5_0", "q8_0"]
    assert qkv.shape == (152, 192)
    assert torch.equal(qkv.dense(), torch.cat([dense_q, dense_k, dense_v]))
    x = torch.randn(16, 192, generator=torch.Generator().manual_seed(21))
    whole = qkv.matmul(x)
    apart = torch.cat([w.matmul(x) for w in (PackedWeight.stack([q, k]), v)], dim=1)
    assert torch.equal(whole, apart)
    for rows in (1, 2, 3, 7):
        assert torch.equal(qkv.matmul(x[:rows]), whole[:rows])
    assert PackedWeight.stack([qkv, v]).parts[-1].shape == (80, 192)  # v joined to v


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_stacking_whole_groups_joins_their_tiles_as_re_packing_the_rows_would(
    kernel: PackedKernel, fmt: str
) -> None:
    a, dense_a = packed(kernel, random_weight(128, 96, seed=10), fmt)
    b, dense_b = packed(kernel, random_weight(64, 96, seed=11), fmt)
    joined = PackedWeight.stack([a, b])  # 64-row groups: no re-tiling
    data, scales = zip(*(p.row_blocks() for p in (a, b)), strict=True)
    repacked = PackedWeight.from_rows(fmt, torch.cat(data), torch.cat(scales), kernel)
    assert torch.equal(joined.tiles, repacked.tiles)
    assert torch.equal(joined.tile_scales, repacked.tile_scales)
    assert torch.equal(joined.dense(), torch.cat([dense_a, dense_b]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_selected_rows_decode_to_those_rows(kernel: PackedKernel, fmt: str) -> None:
    weight, dense = packed(kernel, random_weight(20, 64, seed=5), fmt)
    index = torch.tensor([0, 7, 8, 19])
    assert torch.equal(weight.rows(index).dense(), dense[index])


def test_blocks_or_scales_of_the_wrong_size_are_refused(kernel: PackedKernel) -> None:
    with pytest.raises(ValueError, match="40 columns: not a multiple of 32"):
        PackedWeight.from_rows(
            "q8_0", torch.zeros(2, 40, dtype=torch.uint8), torch.ones(2, 1), kernel
        )
    with pytest.raises(ValueError, match=r"scales \(2, 1\), expected \(2, 2\)"):
        PackedWeight.from_rows(
            "q4_1", torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 1), kernel
        )


@pytest.fixture(scope="module")
def packed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("packed"), "llama", mtp_layout="deepseek", tie_embeddings=True
    )
    names = pack_checkpoint(path)
    assert "model.layers.0.mlp.down_proj.weight" in names
    return path


def test_a_packed_model_loads_packed_and_counts_its_parameters_once(
    packed_checkpoint: Path,
) -> None:
    runtime = RuntimeConfig(device="cpu", dtype="float32", num_slots=2, max_len=64)
    packed_model = load_model(packed_checkpoint, runtime)
    dense_model = load_model(
        packed_checkpoint, RuntimeConfig(**{**vars(runtime), "weights": "dense"})
    )
    assert packed_model.info.weights == "packed (q4_1, q8_0)"
    assert dense_model.info.weights == "dense"
    assert packed_model.info.parameters == dense_model.info.parameters


def test_a_calibration_names_the_kernel_build_a_packed_model_runs_on(
    packed_checkpoint: Path, kernel: PackedKernel
) -> None:
    # Another build of the kernels prices verify rows differently (a faster
    # narrow product makes drafts cheaper): its runs must calibrate anew.
    runtime = RuntimeConfig(device="cpu", dtype="float32", num_slots=2, max_len=64)
    packed_key = calibration_key(load_model(packed_checkpoint, runtime))
    dense = load_model(packed_checkpoint, RuntimeConfig(**{**vars(runtime), "weights": "dense"}))
    assert kernel.build and packed_key["kernels"] == kernel.build
    assert calibration_key(dense)["kernels"] == "none"


def test_a_packed_model_is_not_used_off_float32(packed_checkpoint: Path) -> None:
    runtime = RuntimeConfig(device="cpu", dtype="bfloat16", num_slots=2, max_len=64)
    assert load_model(packed_checkpoint, runtime).info.weights.startswith("dense (")


def test_packed_and_dense_decode_the_same_tokens(packed_checkpoint: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42], list(range(60, 90))]
    outputs = {}
    for weights in ("dense", "auto"):
        runtime = RuntimeConfig(
            device="cpu", dtype="float32", num_slots=3, max_len=128, weights=weights
        )
        loaded = load_model(packed_checkpoint, runtime)
        for label, lookup in (("plain", None), ("lookup", PromptLookupConfig(min_match=2))):
            engine = Engine.from_loaded(
                loaded, EngineConfig(max_batch=3, mtp=lookup is not None, prompt_lookup=lookup)
            )
            params = SamplingParams(max_tokens=20)
            requests = (Request(str(i), tuple(p), params) for i, p in enumerate(prompts))
            results = {r.request_id: r.output_ids for r in engine.generate(requests)}
            outputs[weights, label] = results
    assert outputs["auto", "plain"] == outputs["dense", "plain"]
    assert outputs["auto", "lookup"] == outputs["auto", "plain"]


def test_parts_of_a_fused_weight_in_different_formats_load_as_parts(
    kernel: PackedKernel, tmp_path: Path
) -> None:
    path = write_tiny_checkpoint(tmp_path / "mixed", "llama", tie_embeddings=True)
    pack_checkpoint(path)
    # Re-pack one projection of the fused q/k/v in another format.
    store = PackedStore.open(path, kernel)
    assert store is not None
    weights = {
        name: (store.formats[name], *w.row_blocks())
        for name in store.formats
        if (w := store.get(name)) is not None
    }
    name = "model.layers.0.self_attn.k_proj.weight"
    dense = load_file(str(path / "model.safetensors"))[name]
    data, scales, _ = quantize(dense, "bf16")
    weights[name] = ("bf16", data, scales)
    save_packed(weights, path / PACKED_FILE)
    loaded = load_model(path, RuntimeConfig(device="cpu", dtype="float32", num_slots=1, max_len=32))
    block = loaded.model.stack.blocks[0]  # type: ignore[attr-defined]
    assert isinstance(block.qkv, PackedWeight) and block.qkv.fmt == "parts"
    assert [p.fmt for p in block.qkv.parts] == ["q4_1", "bf16", "q4_1"]


def test_a_packed_file_left_from_other_dense_weights_is_ignored(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path / "stale", "llama")
    pack_checkpoint(path)
    runtime = RuntimeConfig(device="cpu", dtype="float32", num_slots=1, max_len=32)
    assert load_model(path, runtime).info.weights.startswith("packed")
    # The dense weights change (a fine-tune saved over them): the packed copy
    # no longer describes this model.
    weights = load_file(str(path / "model.safetensors"))
    weights["extra.weight"] = torch.zeros(3)
    save_file(weights, str(path / "model.safetensors"))
    assert load_model(path, runtime).info.weights == "dense"


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_packed_embedding_decodes_the_rows_asked_for_bit_for_bit(
    kernel: PackedKernel, fmt: str
) -> None:
    from metrale.engine.runtime.embedding import Embedding

    weight, dense = packed(kernel, random_weight(100, 96, seed=12), fmt)
    embedding = Embedding(packed=weight)
    ids = torch.tensor([5, 0, 99, 5, 42])
    assert torch.equal(embedding(ids), dense[ids])
    assert torch.equal(embedding(ids), Embedding(dense)(ids))
    assert embedding.shape == (100, 96) and torch.equal(embedding.matrix(), dense)


def test_a_bfloat16_embedding_decodes_its_rows_bit_for_bit(kernel: PackedKernel) -> None:
    from metrale.engine.runtime.embedding import Embedding

    table = random_weight(40, 64, seed=13).to(torch.bfloat16)
    data = table.view(torch.uint8).reshape(40, -1)  # [n, 2 * k]
    weight = PackedWeight.from_rows("bf16", data, torch.zeros(40, 0), kernel)
    ids = torch.tensor([3, 39, 0])
    assert torch.equal(Embedding(packed=weight)(ids), table.float()[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_tiled_in_chunks_give_the_tiles_of_all_rows_at_once(
    kernel: PackedKernel, fmt: str
) -> None:
    weight, _ = packed(kernel, random_weight(200, 64, seed=14), fmt)
    data, scales = weight.row_blocks()
    whole = PackedWeight.from_rows(fmt, data, scales, kernel)
    chunks = ((data[i : i + 128], scales[i : i + 128]) for i in range(0, 200, 128))
    chunked = PackedWeight.from_row_chunks(fmt, 200, chunks, kernel)  # 128 rows, then 72
    assert chunked.shape == whole.shape
    assert torch.equal(chunked.tiles, whole.tiles)
    assert torch.equal(chunked.tile_scales, whole.tile_scales)


def test_chunks_that_split_a_group_or_miss_rows_are_refused(kernel: PackedKernel) -> None:
    weight, _ = packed(kernel, random_weight(200, 64, seed=15), "q8_0")
    data, scales = weight.row_blocks()
    with pytest.raises(ValueError, match="inside a group"):
        split = ((data[i : i + 100], scales[i : i + 100]) for i in range(0, 200, 100))
        PackedWeight.from_row_chunks("q8_0", 200, split, kernel)
    with pytest.raises(ValueError, match="held 128 rows, not 200"):
        PackedWeight.from_row_chunks("q8_0", 200, [(data[:128], scales[:128])], kernel)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_packed_rows_of_an_embedding_over_several_chunks_decode_to_those_rows(
    kernel: PackedKernel, fmt: str
) -> None:
    from metrale.engine.runtime import embedding as module

    weight, dense = packed(kernel, random_weight(3000, 64, seed=16), fmt)
    index = torch.randperm(3000, generator=torch.Generator().manual_seed(17))[:1500]
    index = index.sort().values  # a draft vocabulary: sorted ids, 1500 > _CHUNK_ROWS
    assert len(index) > module._CHUNK_ROWS
    rows = module.Embedding(packed=weight).packed_rows(index)
    assert torch.equal(rows.dense(), dense[index])
    assert torch.equal(rows.tiles, weight.rows(index).tiles)
