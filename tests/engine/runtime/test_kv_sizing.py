"""The KV cache sized from a memory budget: the rule (``runtime/kv_sizing.py``),
the loader that applies it, and `--kv-cache-gb` through the CLI."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from typer.testing import CliRunner

from metrale.cli.main import app
from metrale.cli.options import with_flags
from metrale.engine.config import RuntimeConfig
from metrale.engine.load.checkpoint import read_checkpoint
from metrale.engine.load.loader import kv_budget, load_model, size_cache, weight_bytes
from metrale.engine.runtime.arch import CheckpointError
from metrale.engine.runtime.kv_cache import SlotKVCache
from metrale.engine.runtime.kv_sizing import (
    GIB,
    KvSizing,
    gib,
    kv_bytes_per_position,
    size_kv_cache,
)
from metrale.engine.runtime.static_step import HEADROOM
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.hybrid_checkpoints import write_hybrid_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# MiMo-7B in bfloat16, the module doc's worked example: 36 layers + 1 MTP
# module, 8 kv heads of 128 (2 x 1024 numbers a layer), context 32,768.
MIMO = kv_bytes_per_position(num_layers=36, num_mtp=1, kv_width=2 * 8 * 128, itemsize=2)
CONTEXT = 32_768
# The tiny checkpoint with one deepseek MTP module in float32: (2 + 1) layers
# x 2 kv heads of 16, keys and values, 4 bytes each.
TINY = 3 * 2 * 2 * 16 * 4
ENV = {"COLUMNS": "400", "NO_COLOR": "1"}
TINY_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-batch", "4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), mtp_layout="deepseek")


def test_bytes_per_position_of_the_worked_example() -> None:
    assert MIMO == 37 * 2048 * 2 == 151_552


@pytest.mark.parametrize(
    ("budget_gib", "max_len", "slots", "positions", "origin"),
    [
        # No max_len: 16 slots kept, positions cut to what fits, up to the context.
        (20, None, 16, 8_856, "budget"),  # 20 GiB // (16 x 151,552)
        (1, None, 16, 442, "budget"),
        (80, None, 16, 32_768, "context"),  # 35,424 would fit: the context caps it
        # A max_len asked for is kept; the slots are what fits, at most 16.
        (20, 32_768, 4, 32_768, "max_len"),  # 20 GiB // (32,768 x 151,552)
        (20, 4_096, 16, 4_096, "max_len"),  # 34 fit
        (1, 4_096, 1, 4_096, "max_len"),  # 1.73 fit
    ],
)
def test_a_budget_gives_the_documented_slots_and_positions(
    budget_gib: float, max_len: int | None, slots: int, positions: int, origin: str
) -> None:
    budget = int(budget_gib * GIB)
    sizing = size_kv_cache(budget, MIMO, max_slots=16, context_len=CONTEXT, max_len=max_len)
    assert (sizing.num_slots, sizing.max_len, sizing.positions_from) == (slots, positions, origin)
    assert sizing.slots_cut == (slots < 16)
    assert sizing.cache_bytes == slots * positions * MIMO <= budget


def test_the_rule_is_the_largest_shape_of_its_kind_that_fits() -> None:
    rng = random.Random(0)
    for _ in range(500):
        per_position, max_slots = rng.randint(1, 5000), rng.randint(1, 32)
        context = rng.randint(2, 10_000)
        asked = rng.choice([None, rng.randint(2, context)])
        budget = rng.randint(1, 10**9)
        try:
            s = size_kv_cache(budget, per_position, max_slots, context, asked)
        except ValueError:  # below the minimum: one slot of max_len, or every slot of 2
            assert budget < (per_position * asked if asked else per_position * 2 * max_slots)
            continue
        assert s.cache_bytes <= budget
        if asked is not None:  # max_len kept; one more slot would not fit, or the cap
            assert s.max_len == asked
            assert s.num_slots == max_slots or (s.num_slots + 1) * asked * per_position > budget
        else:  # the batch kept; one more position would not fit, or the context
            assert s.num_slots == max_slots
            assert s.max_len == context or max_slots * (s.max_len + 1) * per_position > budget


def test_a_slots_fixed_state_is_budgeted_with_its_positions() -> None:
    """A model with linear layers holds ``slot_bytes`` per slot whatever its
    length: each shape stays the largest that fits with them counted."""
    rng = random.Random(1)
    for _ in range(500):
        per_position, max_slots = rng.randint(1, 5000), rng.randint(1, 32)
        slot_bytes, headroom = rng.randint(1, 10**6), rng.choice([0, 16])
        context = rng.randint(2, 10_000)
        asked = rng.choice([None, rng.randint(2, context)])
        budget = rng.randint(1, 10**9)
        try:
            s = size_kv_cache(budget, per_position, max_slots, context, asked, headroom, slot_bytes)
        except ValueError:
            continue
        assert s.cache_bytes <= budget
        one_slot = (s.max_len + headroom) * per_position + slot_bytes
        assert s.cache_bytes == s.num_slots * one_slot
        if asked is not None:
            assert s.num_slots == max_slots or (s.num_slots + 1) * one_slot > budget
        else:
            wider = max_slots * ((s.max_len + 1 + headroom) * per_position + slot_bytes)
            assert s.max_len == context or wider > budget


@pytest.mark.parametrize(
    ("max_len", "needles"),
    [
        # One slot of 32,768 positions needs 32,768 x 151,552 bytes = 4.63 GiB.
        (32_768, ("a KV cache of 1 GiB holds no slot of 32,768", "minimum is 4.63 GiB")),
        # 16 slots of 2 positions need 16 x 2 x 151,552 bytes = 0.00452 GiB.
        (None, ("a KV cache of 0.001 GiB holds 0 positions", "minimum is 0.00452 GiB")),
    ],
)
def test_too_small_a_budget_is_a_value_error_naming_the_budget_and_the_minimum(
    max_len: int | None, needles: tuple[str, ...]
) -> None:
    budget = GIB if max_len else GIB // 1000
    with pytest.raises(ValueError) as caught:
        size_kv_cache(budget, MIMO, max_slots=16, context_len=CONTEXT, max_len=max_len)
    for needle in needles:
        assert needle in str(caught.value)


def test_gib_reads_three_significant_digits_and_a_minimum_rounds_up() -> None:
    assert [gib(n) for n in (2 * GIB, GIB // 4, 113 * GIB + GIB // 3)] == ["2", "0.25", "113"]
    assert gib(32_768 * MIMO) == "4.63" and gib(32_768 * MIMO, up=True) == "4.63"
    assert gib(GIB + GIB // 500) == "1" and gib(GIB + GIB // 500, up=True) == "1.01"


def test_the_shape_says_why_it_is_so() -> None:
    cut = KvSizing(4, 32_768, MIMO, "max_len", slots_cut=True, budget_bytes=20 * GIB)
    assert cut.describe() == (
        "4 slots of 32,768 positions, as max_len sets; the most slots a KV cache of 20 GiB holds"
    )
    fitted = KvSizing(16, 8_856, MIMO, "budget", budget_bytes=20 * GIB)
    assert fitted.describe("20 GiB (kv_cache_gb)") == (
        "16 slots of 8,856 positions, what a KV cache of 20 GiB (kv_cache_gb) holds at 16 slots"
    )
    assert (
        KvSizing(1, 512, 8, "context").describe() == "1 slot of 512 positions, the model's context"
    )
    assert with_flags(fitted.describe("20 GiB (kv_cache_gb)")).endswith(
        "(--kv-cache-gb) holds at 16 slots"
    )


def test_bytes_per_position_count_each_mtp_module_as_one_layer(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, mtp_layout="deepseek", num_mtp_layers=2)
    loaded = load_model(path, RuntimeConfig(device="cpu", dtype="float32", num_slots=2, max_len=64))
    spec = read_checkpoint(path).spec
    assert len(loaded.mtp) == 2
    expected = kv_bytes_per_position(spec.num_layers, 2, spec.kv_width, 4)
    assert loaded.info.kv_bytes_per_token == expected == (2 + 2) * 64 * 4


def test_a_loaded_cache_has_the_predicted_shape(tiny: Path) -> None:
    runtime = RuntimeConfig(device="cpu", dtype="float32", num_slots=4, kv_cache_gb=0.0003)
    loaded = load_model(tiny, runtime)
    predicted = size_kv_cache(
        int(0.0003 * GIB), TINY, max_slots=4, context_len=512, headroom=HEADROOM
    )
    # 322,122 // (4 x 768) = 104 positions a slot, 16 of them the device step's headroom.
    assert (predicted.num_slots, predicted.max_len) == (4, 88)
    caches = [loaded.model.stack.cache, *(m.stack.cache for m in loaded.mtp)]  # type: ignore[attr-defined]
    for cache in caches:
        assert isinstance(cache, SlotKVCache)
        assert all(k.shape == (4, 2, 104, 16) for k in cache.keys + cache.values)
    info = loaded.info
    assert (info.num_slots, info.max_len, info.kv_cache_bytes) == (4, 88, 4 * 104 * TINY)
    assert info.kv_cache_bytes <= int(0.0003 * GIB)
    assert info.kv_limit == (
        "4 slots of 88 positions, what a KV cache of 0.0003 GiB (kv_cache_gb) holds at 4 slots"
    )
    asked = load_model(
        tiny,
        RuntimeConfig(device="cpu", dtype="float32", num_slots=4, max_len=64, kv_cache_gb=0.0002),
    )
    # 214,748 // ((64 + 16) x 768) = 3 slots.
    assert (asked.model.num_slots, asked.model.max_len) == (3, 64)
    assert "as max_len sets; the most slots" in asked.info.kv_limit


def test_without_a_budget_the_cpu_keeps_every_slot_at_full_length(tiny: Path) -> None:
    loaded = load_model(tiny, RuntimeConfig(device="cpu", dtype="float32", num_slots=3))
    assert (loaded.model.num_slots, loaded.model.max_len) == (3, 512)
    assert loaded.info.kv_limit == "3 slots of 512 positions, the model's context"


def test_a_budget_too_small_for_the_model_is_refused_naming_the_setting(tiny: Path) -> None:
    runtime = RuntimeConfig(
        device="cpu", dtype="float32", num_slots=4, max_len=256, kv_cache_gb=1e-5
    )
    with pytest.raises(
        CheckpointError, match=r"^kv_cache_gb: a KV cache of .* holds no slot of 256"
    ):
        load_model(tiny, runtime)


def test_on_cuda_the_default_budget_is_a_fraction_of_the_memory_the_weights_leave(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = read_checkpoint(tiny)
    weights = weight_bytes(checkpoint, torch.bfloat16)
    # Every stored tensor at the runtime dtype: what the loaded model counts.
    loaded = load_model(tiny, RuntimeConfig(device="cpu", dtype="float32", num_slots=1, max_len=8))
    assert weights == loaded.info.parameters * 2
    free = weights + 10_000_000
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    cuda = torch.device("cuda")
    budget = kv_budget(checkpoint, RuntimeConfig(), cuda, torch.bfloat16, None)
    assert budget is not None and budget[:2] == (9_000_000, "kv_cache_fraction")
    assert "90% of the" not in budget[2] and "kv_cache_fraction 0.9 of the 0.00931 GiB" in budget[2]
    half = kv_budget(checkpoint, RuntimeConfig(kv_cache_fraction=0.5), cuda, torch.bfloat16, None)
    assert half is not None and half[0] == 5_000_000
    # An explicit budget wins; the CPU has none by default.
    assert kv_budget(checkpoint, RuntimeConfig(kv_cache_gb=1), cuda, torch.bfloat16, None) == (
        GIB,
        "kv_cache_gb",
        "1 GiB (kv_cache_gb)",
    )
    assert kv_budget(checkpoint, RuntimeConfig(), torch.device("cpu"), torch.float32, None) is None
    sizing, why = size_cache(checkpoint, RuntimeConfig(num_slots=4), cuda, torch.bfloat16, 1)
    assert (sizing.num_slots, sizing.max_len) == (4, 512)  # 9 MB hold 4 x 512 x 384 bytes
    assert why.startswith("4 slots of 512 positions, the model's context, in a KV cache of")
    # 900 bytes hold not even 4 slots of 2 positions: refused, naming where they came from.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (weights + 1000, 0))
    with pytest.raises(
        CheckpointError,
        match=r"^kv_cache_fraction: .*\(the budget: 0.000000838 GiB \(kv_cache_fraction 0.9 of",
    ):
        size_cache(checkpoint, RuntimeConfig(num_slots=4), cuda, torch.bfloat16, 1)


def invoke(args: list[str], input: str | None = None, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, input=input, env={**ENV, **(env or {})})


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("0", "--kv-cache-gb' (env var: 'METRALE_KV_CACHE_GB'): must be in (0, 1048576], got 0.0"),
        ("-2", "must be in (0, 1048576], got -2.0"),
        ("lots", "'--kv-cache-gb' (env var: 'METRALE_KV_CACHE_GB'): Input should be a valid"),
    ],
)
def test_the_cli_rejects_a_bad_budget_naming_the_flag(value: str, needle: str) -> None:
    result = invoke(["generate", "--kv-cache-gb", value], input="")
    assert result.exit_code == 2 and needle in result.output, result.output
    from_env = invoke(["info", "/nonexistent"], env={"METRALE_KV_CACHE_GB": value})
    assert from_env.exit_code == 2 and "--kv-cache-gb" in from_env.output


def test_a_budget_too_small_for_the_model_is_a_usage_error_on_the_flag(tiny: Path) -> None:
    result = invoke(["info", str(tiny), *TINY_ARGS, "--max-len", "256", "--kv-cache-gb", "0.00001"])
    assert result.exit_code == 2, result.output
    assert (
        "Invalid value for --kv-cache-gb: a KV cache of 0.00001 GiB holds no slot of 256"
        in result.output
    )
    assert "the minimum is 0.000195 GiB (one slot)" in result.output  # (256 + 16) x 768 bytes


def test_info_shows_the_cache_generate_would_get(tiny: Path) -> None:
    result = invoke(["info", str(tiny), *TINY_ARGS, "--kv-cache-gb", "0.0003"])
    assert result.exit_code == 0, result.output
    assert "4 x 88 positions (+16 for padded verify rows), 0.000298 GiB" in result.output
    assert "what a KV cache of 0.0003 GiB (--kv-cache-gb) holds at 4 slots" in result.output
    assert "none on the CPU" in result.output and "device              cpu" in result.output


def test_an_over_long_line_gets_an_error_record_naming_the_limit_and_the_rest_are_answered(
    tiny: Path,
) -> None:
    lines = [
        {"id": "short", "prompt": "hello", "max_tokens": 8},
        {"id": "long", "prompt": "x" * 120, "max_tokens": 8},
        {"id": "fits", "prompt": "y" * 70, "max_tokens": 8},
    ]
    text = "".join(orjson.dumps(line).decode() + "\n" for line in lines)
    result = invoke(
        ["generate", "--model", str(tiny), *TINY_ARGS, "--kv-cache-gb", "0.0003"], input=text
    )
    assert result.exit_code == 1, result.output  # one line failed
    out = {r["id"]: r for r in map(orjson.loads, result.stdout.splitlines())}
    assert (
        out["short"]["finish_reason"] in ("stop", "length")
        and out["fits"]["usage"]["completion_tokens"] >= 1
    )
    error = out["long"]["error"]
    assert out["long"]["finish_reason"] == "error" and error["field"] == "prompt"
    assert error["message"] == (
        "too long: 120 prompt tokens + max_tokens 8 exceed the model's 88 positions (4 slots of "
        "88 positions, what a KV cache of 0.0003 GiB (--kv-cache-gb) holds at 4 slots); "
        "shorten it or lower max_tokens"
    )
    assert math.isclose(0.0003 * GIB // (4 * TINY) - HEADROOM, 88)


def test_bench_refuses_a_cache_holding_fewer_slots_than_its_batch(
    tiny: Path, tmp_path: Path
) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "abc abc abc"}\n{"prompt": "xyz xyz"}\n')
    # The bench's slots are 64 positions long (the longest line, rounded up):
    # 0.00013 GiB = 139,586 bytes hold 2 such slots of (64 + 16 headroom) x 768 bytes.
    args = ["bench", str(workload), "--model", str(tiny), "--device", "cpu", "--batch", "3"]
    result = invoke([*args, "--repeats", "1", "--max-tokens", "4", "--kv-cache-gb", "0.00013"])
    assert result.exit_code == 2, result.output
    assert (
        "Invalid value for --kv-cache-gb: the KV cache holds 2 slots of 64 positions"
        in result.output
    )
    assert "fewer than the batch of 3; raise it or lower --batch" in result.output


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5"])
def test_the_cuda_budget_counts_a_nested_checkpoint_by_what_it_reads(
    family: str, tmp_path: Path
) -> None:
    # Qwen3.5's released layout is read renamed (model.language_model.* as
    # model.*) with its vision tower left out: the weights counted are the
    # language model's and its MTP layer's, which the loaded model holds.
    path = write_hybrid_checkpoint(tmp_path, family)
    checkpoint = read_checkpoint(path)
    assert any(name.startswith("model.visual.") for name in checkpoint.weights.headers())
    weights = weight_bytes(checkpoint, torch.bfloat16)
    loaded = load_model(path, RuntimeConfig(device="cpu", dtype="float32", num_slots=1, max_len=8))
    assert weights == loaded.info.parameters * 2
