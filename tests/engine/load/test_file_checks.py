"""Damaged model files are described by their fault, sound ones pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from metrale.engine.load.default_model import find_gguf
from metrale.engine.load.file_checks import gguf_problem, index_problem, safetensors_problem
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.gguf_files import write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_shards=2)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    single = write_tiny_checkpoint(tmp_path_factory.mktemp("single"))
    return write_gguf(single, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def shard(folder: Path, i: int = 1) -> Path:
    return folder / f"model-{i:05d}-of-00002.safetensors"


def cut(source: Path, target: Path, keep: int) -> Path:
    target.write_bytes(source.read_bytes()[:keep])
    return target


def test_sound_files_have_no_problem(tiny: Path, gguf: Path) -> None:
    assert safetensors_problem(shard(tiny)) is None
    index = tiny / "model.safetensors.index.json"
    assert index_problem(index, set(json.loads(index.read_text())["weight_map"].values())) is None
    assert gguf_problem(gguf) is None


def test_the_embedded_default_models_gguf_is_sound() -> None:
    # A llama.cpp file with every kind of field (string arrays, Q4_1 blocks).
    assert gguf_problem(find_gguf()) is None


@pytest.mark.parametrize("keep", [0, 5, 100, -1])
def test_a_truncated_safetensors_file_is_named_truncated(
    tiny: Path, tmp_path: Path, keep: int
) -> None:
    source = shard(tiny)
    size = source.stat().st_size
    broken = cut(source, tmp_path / "w.safetensors", keep if keep >= 0 else size - 1)
    problem = safetensors_problem(broken)
    assert problem is not None and problem.startswith(f"{broken} is truncated")
    assert "download or copy it again" in problem


def test_bytes_after_the_last_tensor_are_corruption(tiny: Path, tmp_path: Path) -> None:
    broken = tmp_path / "w.safetensors"
    broken.write_bytes(shard(tiny).read_bytes() + b"\0" * 7)
    assert safetensors_problem(broken) == (
        f"{broken} is corrupt: 7 bytes follow its last tensor; download or copy it again"
    )


def test_a_header_that_is_not_json_is_corruption(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(shard(tiny).read_bytes())
    data[8:12] = b"\xff\xfe{["
    broken = tmp_path / "w.safetensors"
    broken.write_bytes(bytes(data))
    problem = safetensors_problem(broken)
    assert problem is not None and "is corrupt: its header is not" in problem


def test_an_index_naming_an_absent_shard_names_it(tiny: Path) -> None:
    index = tiny / "model.safetensors.index.json"
    named = {shard(tiny).name, "model-00002-of-00002.safetensors", "extra.safetensors"}
    problem = index_problem(index, named)
    assert problem is not None
    assert problem.startswith(f"{index} names extra.safetensors, which is missing")


def test_an_index_leaving_out_a_shard_of_its_series_names_the_first(tmp_path: Path) -> None:
    for i in (1, 3):
        (tmp_path / f"m-{i:05d}-of-00003.safetensors").write_bytes(b"")
    problem = index_problem(
        tmp_path / "index.json", {f"m-{i:05d}-of-00003.safetensors" for i in (1, 3)}
    )
    assert problem is not None
    assert "leaves out 1 of the 3 shards of m (first: m-00002-of-00003.safetensors)" in problem


@pytest.mark.parametrize("keep", [0, 3, 20, 200])
def test_a_gguf_cut_inside_its_header_says_where(gguf: Path, tmp_path: Path, keep: int) -> None:
    broken = cut(gguf, tmp_path / "x.gguf", keep)
    problem = gguf_problem(broken)
    assert problem is not None and f"{broken} is truncated: its header stops at byte" in problem


def test_a_gguf_cut_inside_its_tensors_gives_the_size_it_needs(gguf: Path, tmp_path: Path) -> None:
    size = gguf.stat().st_size
    broken = cut(gguf, tmp_path / "x.gguf", size - 1)
    assert gguf_problem(broken) == (
        f"{broken} is truncated: its tensors need {size:,} bytes, the file has {size - 1:,}; "
        "download or copy it again"
    )


def test_a_file_that_is_not_gguf_is_named_corrupt(tmp_path: Path) -> None:
    other = tmp_path / "x.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    assert gguf_problem(other) == (
        f"{other} is corrupt: it does not start with GGUF: not a GGUF file; "
        "download or copy it again"
    )
