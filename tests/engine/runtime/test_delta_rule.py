"""The gated delta rule against transformers' own torch implementations.

transformers' chunked form (prefill) and recurrent form (decode) are the
reference; each of metrale's forms is checked against its like, and the two
forms against each other, from a non-zero initial state and with value heads
sharing key heads, as in the released models.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from metrale.engine.runtime.delta_rule import (
    chunked_delta_rule,
    delta_rule_step,
    l2_normalize,
    read_state,
)

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 8, 16


def _inputs(length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(1, length, KEY_HEADS, KEY_DIM, generator=gen),
        "key": torch.randn(1, length, KEY_HEADS, KEY_DIM, generator=gen),
        "value": torch.randn(1, length, VALUE_HEADS, VALUE_DIM, generator=gen),
        # Decays from nearly none to strong forgetting, as trained models show.
        "g": -3.0 * torch.rand(1, length, VALUE_HEADS, generator=gen),
        "beta": torch.rand(1, length, VALUE_HEADS, generator=gen),
        "state": torch.randn(1, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen),
    }


def _ours(
    x: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs as metrale's layer hands them over: normalised, scaled,
    keys repeated for the value heads that share them."""
    repeat = VALUE_HEADS // KEY_HEADS
    q = (l2_normalize(x["query"][0]) / KEY_DIM**0.5).repeat_interleave(repeat, dim=1)
    k = l2_normalize(x["key"][0]).repeat_interleave(repeat, dim=1)
    return q, k, x["value"][0], x["g"][0], x["beta"][0]


def _reference(fn: object, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = fn(  # type: ignore[operator]
        x["query"],
        x["key"],
        x["value"],
        g=x["g"],
        beta=x["beta"],
        initial_state=x["state"].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_the_chunked_form_matches_transformers_chunked_form(length: int) -> None:
    x = _inputs(length, seed=length)
    want_out, want_state = _reference(torch_chunk_gated_delta_rule, x)
    out, state = chunked_delta_rule(*_ours(x), x["state"][0].clone())
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 40])
def test_the_token_by_token_form_matches_transformers_recurrent_form(length: int) -> None:
    x = _inputs(length, seed=100 + length)
    want_out, want_state = _reference(torch_recurrent_gated_delta_rule, x)
    q, k, v, g, beta = _ours(x)
    state, outs = x["state"][0].clone(), []
    for t in range(length):
        state = delta_rule_step(state, k[t], v[t], g[t], beta[t])
        outs.append(read_state(state, q[t]))
    torch.testing.assert_close(torch.stack(outs), want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)


def test_a_block_that_forgets_a_lot_stays_finite_in_the_chunked_form() -> None:
    """Pairwise decays, never a product of e^{g} and e^{-g}: a block whose
    decays sum past what float32 can exponentiate must not overflow."""
    x = _inputs(64, seed=7)
    x["g"] = torch.full_like(x["g"], -40.0)  # 64 tokens: e^{2560} overflows float32
    out, state = chunked_delta_rule(*_ours(x), x["state"][0].clone())
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    want_out, _ = _reference(torch_recurrent_gated_delta_rule, x)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
