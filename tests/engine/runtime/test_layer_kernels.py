"""The C kernels of a decoder layer: attention (kernels/attention.c), where
each segment's rows attend over their own cache slot as the float64
reference does and a segment's result does not depend on the segments beside
it; the operations between products (kernels/layer_ops.c), against torch's;
and a model that decodes the same tokens with them as with torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale.engine.api import Request, SamplingParams
from metrale.engine.config import EngineConfig, RuntimeConfig
from metrale.engine.engine import Engine
from metrale.engine.kernels.binding import PackedKernel, packed_kernel
from metrale.engine.load.loader import load_model
from metrale.engine.runtime.kv_cache import RowPlan, SlotKVCache, plan_rows
from metrale.engine.runtime.llama import KERNEL_ATTENTION_ROWS
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.ops import rms_norm
from metrale.engine.runtime.rope import apply_rope
from metrale.lookup import PromptLookupConfig
from tests.support.checkpoints import write_tiny_checkpoint

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN, SLOTS = 6, 2, 16, 48, 5
SEGMENTS = [  # mixed starts and row counts, slots out of order
    Segment(3, 10, [1] * 4),
    Segment(0, 40, [1]),
    Segment(1, 0, [1] * 3),
    Segment(4, 20, [1] * 6),
]


@pytest.fixture(scope="module")
def kernel() -> PackedKernel:
    found = packed_kernel()
    assert found is not None, "the test machine has a C compiler: the kernel must build"
    return found


def cache(seed: int, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (SLOTS, KV_HEADS, MAX_LEN, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    segments: list[Segment],
    window: int | None,
) -> torch.Tensor:
    """Row by row in float64: softmax over the positions the row may read."""
    head_dim = q.shape[-1]
    out = torch.empty(q.shape[0], HEADS * head_dim, dtype=torch.float64)
    group, row = HEADS // KV_HEADS, 0
    for seg in segments:
        for r in range(len(seg.token_ids)):
            pos = seg.start + r
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(HEADS):
                k = keys[seg.slot, h // group, lo : pos + 1].double()
                v = values[seg.slot, h // group, lo : pos + 1].double()
                weights = torch.softmax(k @ q[row, h].double() * head_dim**-0.5, dim=0)
                out[row, h * head_dim : (h + 1) * head_dim] = weights @ v
            row += 1
    return out


def attend(kernel: PackedKernel, q: torch.Tensor, plan: RowPlan, seed: int = 0) -> torch.Tensor:
    head_dim = q.shape[-1]
    keys, values = cache(seed, head_dim)
    assert plan.segment_table is not None
    window = plan.sliding_window or 0
    return kernel.attend(q, keys, values, plan.segment_table, window, head_dim**-0.5)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 12])  # 12: not whole 8-wide vectors
def test_each_row_attends_over_its_own_positions(
    kernel: PackedKernel, window: int | None, head_dim: int
) -> None:
    plan = plan_rows(SEGMENTS, SLOTS, MAX_LEN, torch.device("cpu"), window)
    # q as the model hands it over: a strided view of the fused q/k rows.
    fused = torch.randn(plan.num_tokens, HEADS + KV_HEADS, head_dim)
    q = fused[:, :HEADS]
    out = attend(kernel, q, plan)
    keys, values = cache(0, head_dim)
    expected = reference(q, keys, values, SEGMENTS, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_a_segment_result_does_not_depend_on_its_batch(kernel: PackedKernel) -> None:
    plan = plan_rows(SEGMENTS, SLOTS, MAX_LEN, torch.device("cpu"))
    q = torch.randn(plan.num_tokens, HEADS, HEAD_DIM)
    together = attend(kernel, q, plan)
    row = 0
    for seg in SEGMENTS:
        n = len(seg.token_ids)
        alone = attend(kernel, q[row : row + n], plan_rows([seg], SLOTS, MAX_LEN, q.device))
        assert torch.equal(alone, together[row : row + n]), f"segment at slot {seg.slot}"
        row += n


def test_what_the_c_side_would_misread_is_refused(kernel: PackedKernel) -> None:
    plan = plan_rows(SEGMENTS, SLOTS, MAX_LEN, torch.device("cpu"))
    keys, values = cache(0)
    assert plan.segment_table is not None
    q = torch.randn(plan.num_tokens, HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="float32 CPU"):
        kernel.attend(q.double(), keys, values, plan.segment_table, 0, 1.0)
    with pytest.raises(ValueError, match="segment table"):
        kernel.attend(q, keys, values, plan.segment_table.int(), 0, 1.0)
    with pytest.raises(ValueError, match="heads packed"):
        kernel.attend(q.transpose(1, 2), keys, values, plan.segment_table, 0, 1.0)
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.silu_mul(torch.randn(6, 4).t())


def test_heads_that_do_not_share_kv_heads_evenly_are_refused(kernel: PackedKernel) -> None:
    plan = plan_rows(SEGMENTS[:1], SLOTS, MAX_LEN, torch.device("cpu"))
    keys, values = cache(0)
    q = torch.randn(plan.num_tokens, 5, HEAD_DIM)
    assert plan.segment_table is not None
    with pytest.raises(ValueError, match="5 query heads over 2 kv heads"):
        kernel.attend(q, keys, values, plan.segment_table, 0, 1.0)


def test_rms_norm_matches_transformers_numerics(kernel: PackedKernel) -> None:
    x = torch.randn(7, 76) * 3  # 76: a tail after the 8-wide lanes
    weight = torch.randn(76)
    torch.testing.assert_close(kernel.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))


def test_rope_rotates_bit_for_bit_as_torch(kernel: PackedKernel) -> None:
    table_len, head_dim = 40, 16
    angles = torch.rand(table_len, head_dim) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([3, 0, 39, 17, 17])
    fused = torch.randn(5, 6, head_dim)  # rotate the first 4 heads of a wider row
    expected = apply_rope(fused[:, :4], cos[positions][:, None], sin[positions][:, None])
    untouched = fused[:, 4:].clone()
    kernel.rope_(fused[:, :4], cos, sin, positions)
    assert torch.equal(fused[:, :4], expected)
    assert torch.equal(fused[:, 4:], untouched)


def test_kv_write_stores_what_the_cache_write_stores(kernel: PackedKernel) -> None:
    plan = plan_rows(SEGMENTS, SLOTS, MAX_LEN, torch.device("cpu"))
    qkv = torch.randn(plan.num_tokens, 3 * KV_HEADS, HEAD_DIM)
    k = torch.randn(plan.num_tokens, KV_HEADS, HEAD_DIM)  # contiguous, as after a q/k norm
    v = qkv[:, 2 * KV_HEADS :]  # a strided view of the fused rows
    by_torch, by_kernel = (
        SlotKVCache(1, SLOTS, KV_HEADS, MAX_LEN, HEAD_DIM, torch.float32, torch.device("cpu"))
        for _ in range(2)
    )
    by_torch.write(0, plan, k, v)
    assert plan.segment_table is not None
    kernel.kv_write(k, v, by_kernel.keys[0], by_kernel.values[0], plan.segment_table)
    assert torch.equal(by_kernel.keys[0], by_torch.keys[0])
    assert torch.equal(by_kernel.values[0], by_torch.values[0])


def test_silu_mul_matches_torch(kernel: PackedKernel) -> None:
    gate_up = torch.randn(5, 2 * 44) * 8  # 44: a tail after the 8-wide vectors
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    torch.testing.assert_close(kernel.silu_mul(gate_up).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_checkpoint(folder)
    return folder


def decode(
    folder: Path, use_kernel: bool, prompts: list[tuple[int, ...]]
) -> tuple[list[tuple[int, ...]], int]:
    """Output ids of every prompt, and the copy tokens accepted."""
    loaded = load_model(folder, RuntimeConfig(num_slots=4, max_len=128, mtp=False))
    stack = loaded.model.stack  # type: ignore[attr-defined]
    assert stack.kernel is not None, "CPU float32: the kernel attends"
    if not use_kernel:
        stack.kernel = None
    # Copies of up to 8 tokens make verify segments of several rows.
    config = EngineConfig(max_batch=4, mtp=False, prompt_lookup=PromptLookupConfig(min_match=4))
    engine = Engine(loaded.model, None, config)
    params = SamplingParams(max_tokens=40)
    requests = (Request(str(i), p, params) for i, p in enumerate(prompts))
    results = sorted(engine.generate(requests), key=lambda r: int(r.request_id))
    return [r.output_ids for r in results], engine.stats().prompt_lookup.total.accepted


def test_a_forward_gives_the_logits_of_torch_layers(tiny: Path) -> None:
    loaded = load_model(tiny, RuntimeConfig(num_slots=4, max_len=128, mtp=False))
    model = loaded.model
    stack = model.stack  # type: ignore[attr-defined]
    kernel = stack.kernel
    ids = torch.randint(3, 200, (3, 40), generator=torch.Generator().manual_seed(0)).tolist()
    prefill = [Segment(s, 0, ids[s][:30]) for s in range(3)]
    steps = [
        Segment(0, 30, ids[0][30:31]),
        Segment(2, 30, ids[2][30:35]),
        Segment(1, 30, ids[1][30:40]),
    ]
    outputs = []
    for use in (kernel, None):
        stack.kernel = use
        model.forward(prefill)
        outputs.append(model.forward(steps))
    torch.testing.assert_close(outputs[0].logits, outputs[1].logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs[0].hidden, outputs[1].hidden, rtol=1e-5, atol=1e-5)


def test_a_model_decodes_the_same_tokens_as_with_torch_layers(tiny: Path) -> None:
    repeated = tuple(range(5, 25)) * 3
    prompts = [repeated, (3, 4, 5), tuple(range(40, 90)), repeated[7:]]
    assert KERNEL_ATTENTION_ROWS >= 9, "the copies here verify within the kernel's rows"
    with_kernel, accepted = decode(tiny, True, prompts)
    assert accepted > 0, "some copies were verified"
    assert with_kernel == decode(tiny, False, prompts)[0]
