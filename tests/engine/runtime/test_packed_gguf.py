"""GGUF's block types in the packed kernel: every type decodes bit for bit to
what the ``gguf`` package's dequantizer gives, as random blocks and as
tensors a GGUF file holds, and the portable C build gives the vector
build's bits."""

from __future__ import annotations

import platform
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from metrale.engine.kernels.binding import FORMATS, PackedKernel, kernel_built_with, packed_kernel
from metrale.engine.load.gguf_blocks import KERNEL_TYPES, kernel_blocks
from metrale.engine.runtime.packed import PackedWeight
from tests.support.gguf_quants import quantize_blocks, random_blocks

TYPES = tuple(KERNEL_TYPES)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K


@pytest.fixture(scope="module")
def kernel() -> PackedKernel:
    found = packed_kernel()
    assert found is not None, "the test machine has a C compiler: the kernel must build"
    return found


def decoded(kernel: PackedKernel, kind: str, raw: np.ndarray) -> np.ndarray:
    """``raw`` ``[n, row_bytes]`` through the converter's packing and the kernel."""
    found = kernel_blocks(kind, raw)
    assert found is not None
    fmt, data, scales = found
    weight = PackedWeight.from_rows(
        fmt, torch.from_numpy(data.copy()), torch.from_numpy(scales.copy()), kernel
    )
    return weight.dense().numpy()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as bit patterns: -0.0 is not 0.0 here."""
    return a.shape == b.shape and np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("kind", TYPES)
def test_random_blocks_of_every_type_decode_bit_for_bit_to_what_gguf_dequantizes(
    kernel: PackedKernel, kind: str
) -> None:
    # 70 rows: a group of 64 and a part of one; 512 columns: two K-quant
    # super-blocks. Every bit pattern of values, 6-bit scales and mins.
    raw = random_blocks(kind, 70, 512, np.random.default_rng(TYPES.index(kind)))
    expected = dequantize(raw, GGMLQuantizationType[kind]).reshape(70, 512)
    assert same_bits(decoded(kernel, kind, raw), expected)


def test_tensors_a_gguf_file_holds_decode_as_gguf_reads_them(
    kernel: PackedKernel, tmp_path: Path
) -> None:
    # Written by gguf's writer, read back by its reader: 2-D weights in every
    # type, and a 3-D expert tensor [experts, rows, cols] as llama.cpp writes one.
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(tmp_path / "blocks.gguf"), "llama")
    for kind in TYPES:
        values = rng.standard_normal((40, 256)).astype(np.float32) * 0.05
        qtype = GGMLQuantizationType[kind]
        writer.add_tensor(f"w.{kind}", quantize_blocks(values, kind), raw_dtype=qtype)
    experts = rng.standard_normal((3, 24, 512)).astype(np.float32) * 0.05
    raw_experts = quantize_blocks(experts.reshape(72, 512), "Q4_K").reshape(3, 24, -1)
    writer.add_tensor("experts", raw_experts, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = gguf.GGUFReader(str(tmp_path / "blocks.gguf")).tensors
    assert [t.tensor_type.name for t in tensors] == [*TYPES, "Q4_K"]
    for tensor in tensors:
        raw = np.asarray(tensor.data)
        found = kernel_blocks(tensor.tensor_type.name, raw.reshape(-1, raw.shape[-1]))
        assert found is not None
        fmt, data, scales = found
        weight = PackedWeight.from_rows(
            fmt, torch.from_numpy(data.copy()), torch.from_numpy(scales.copy()), kernel
        )
        expected = dequantize(tensor.data, tensor.tensor_type).reshape(weight.shape)
        assert same_bits(weight.dense().numpy(), expected), tensor.name


def test_k_quants_are_held_in_the_formats_their_arithmetic_matches() -> None:
    # Q4_K and Q5_K blocks compute d * q + m as Q4_1 and Q5_1 do; Q6_K has
    # its own format for its 16-value scales; every format is the kernel's.
    formats = {kind: fmt for kind, (fmt, _, _) in KERNEL_TYPES.items()}
    assert formats["Q4_K"] == "q4_1" and formats["Q5_K"] == "q5_1" and formats["Q6_K"] == "q6_k"
    assert set(formats.values()) <= set(FORMATS)


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the vector paths are x86's"
)
def test_the_portable_build_gives_the_bits_of_the_vector_build(kernel: PackedKernel) -> None:
    # Without AVX2 the kernel decodes with packed_columns.h's value1 and
    # multiplies with fmaf: the same floats and the same sums, where a
    # machine without AVX2 (or another architecture) runs it.
    if kernel.vector_lanes == 1:
        pytest.skip("this machine's build is the portable one already")
    portable = kernel_built_with("-mno-avx2")
    assert portable.vector_lanes == 1
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.standard_normal((9, 512)).astype(np.float32))
    for kind in TYPES:
        found = kernel_blocks(kind, random_blocks(kind, 70, 512, rng))
        assert found is not None
        fmt, data, scales = found
        weight = PackedWeight.from_rows(
            fmt, torch.from_numpy(data.copy()), torch.from_numpy(scales.copy()), kernel
        )
        tiles, tile_scales = weight.tiles, weight.tile_scales
        assert same_bits(
            portable.decode(fmt, tiles, tile_scales, 70, 512).numpy(),
            kernel.decode(fmt, tiles, tile_scales, 70, 512).numpy(),
        ), kind
        for rows in (1, 2, 5, 9):  # one row, the register paths, the tiles
            ours = kernel.linear(fmt, x[:rows], tiles, tile_scales, 70)
            theirs = portable.linear(fmt, x[:rows], tiles, tile_scales, 70)
            assert torch.equal(ours, theirs), (kind, rows)
