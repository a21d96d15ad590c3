"""MLA attention against transformers' DeepseekV3Attention / Glm4MoeLiteAttention:
prefill, ragged verify rows, rollback, and what the latent cache holds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeLiteConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)
from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import (
    Glm4MoeLiteAttention,
    Glm4MoeLiteRotaryEmbedding,
)

from metrale.engine.runtime.arch import MlaSpec
from metrale.engine.runtime.kv_cache import plan_rows
from metrale.engine.runtime.latent_cache import LatentCache
from metrale.engine.runtime.mla import (
    MlaPath,
    expands,
    load_mla_weights,
    mla_attention,
)
from metrale.engine.runtime.model import Segment
from metrale.engine.runtime.rope import RopeTable

CPU = torch.device("cpu")
HIDDEN, HEADS, MAX_LEN, NUM_SLOTS, NUM_LAYERS, LAYER = 64, 4, 48, 3, 2, 1
TOL = 1e-5
PATHS: tuple[MlaPath, ...] = ("absorbed", "expanded")

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Both factors at work: cos/sin scaled by mscale / mscale_all_dim's ratio, the
# softmax by mscale_all_dim's squared.
YARN_MSCALE = {**YARN, "mscale": 0.9, "mscale_all_dim": 1.0}
ROPES = {"default": DEFAULT_ROPE, "yarn": YARN, "yarn_mscale": YARN_MSCALE}
# Both families' configs: v_head_dim differs from qk_head_dim (16) in every test.
SHAPES: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "num_hidden_layers": 1,
    "max_position_embeddings": 64,
}


def deepseek_config(
    q_lora_rank: int | None = 24,
    interleave: bool = True,
    rope: str = "yarn_mscale",
    bias: bool = False,
) -> DeepseekV3Config:
    config = DeepseekV3Config(
        **SHAPES,
        q_lora_rank=q_lora_rank,
        v_head_dim=12,
        rope_parameters=dict(ROPES[rope]),
        rope_interleave=interleave,
        attention_bias=bias,
    )
    config._attn_implementation = "eager"
    return config


def spec_of(config: Any) -> MlaSpec:
    """The spec as the loader fills it; the scale follows DeepSeek's yarn_get_mscale."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters
    if params.get("rope_type") == "yarn" and params.get("mscale_all_dim"):
        mscale = 0.1 * params["mscale_all_dim"] * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return MlaSpec(
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleave=bool(config.rope_interleave),
        softmax_scale=scale,
    )


class DictStore:
    """Names -> tensors, the two calls loading makes."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class Reference:
    """transformers' attention of one layer with random weights (norms included),
    run on a whole sequence at once."""

    def __init__(self, config: Any, attention: type[torch.nn.Module], rotary: Any) -> None:
        torch.manual_seed(0)
        self.attn: Any = attention(config, 0).eval()  # either family's module
        with torch.no_grad():
            for name, param in self.attn.named_parameters():
                param.normal_(1.0 if "layernorm" in name else 0.0, 0.2)
        self.rotary = rotary(config)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` ``[length, hidden]`` from position 0 -> ``[length, hidden]``."""
        length = h.shape[0]
        x = h.unsqueeze(0)  # [1, length, hidden]
        cos_sin = self.rotary(x, torch.arange(length).unsqueeze(0))
        blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
        mask = torch.zeros(1, 1, length, length).masked_fill(blocked, torch.finfo(h.dtype).min)
        with torch.no_grad():
            out, _ = self.attn(x, cos_sin, mask)
        return out[0]


@dataclass
class Fed:
    """Rows of one sequence fed to a slot at a position."""

    slot: int
    start: int
    h: torch.Tensor  # [rows, hidden]


class Runtime:
    """metrale's MLA layer ``LAYER`` of a ``NUM_LAYERS``-layer latent cache."""

    def __init__(self, config: Any, reference: Reference) -> None:
        self.spec = spec_of(config)
        state = {
            f"model.layers.{LAYER}.self_attn.{k}": v for k, v in reference.attn.state_dict().items()
        }
        self.weights = load_mla_weights(
            DictStore(state), f"model.layers.{LAYER}.", self.spec, HEADS, torch.float32, CPU
        )
        self.cache = LatentCache(
            NUM_LAYERS, NUM_SLOTS, MAX_LEN, self.spec.kv_lora_rank,
            self.spec.qk_rope_head_dim, torch.float32, CPU,
        )  # fmt: skip
        self.rope = RopeTable(config, self.spec.qk_rope_head_dim, MAX_LEN, torch.float32, CPU)

    def forward(self, fed: Sequence[Fed], path: MlaPath | None) -> list[torch.Tensor]:
        """One forward of ``fed``'s segments; each segment's output rows."""
        segments = [Segment(f.slot, f.start, [0] * f.h.shape[0]) for f in fed]
        plan = plan_rows(segments, NUM_SLOTS, MAX_LEN, CPU)
        h = torch.cat([f.h for f in fed])  # [num_tokens, hidden]
        out = mla_attention(
            h, self.weights, self.spec, HEADS, self.cache, LAYER, plan, self.rope, path=path
        )
        return list(out.split([f.h.shape[0] for f in fed]))


def sequences(count: int, length: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, HIDDEN, generator=generator) for _ in range(count)]


def deepseek(config: DeepseekV3Config) -> tuple[Reference, Runtime]:
    reference = Reference(config, DeepseekV3Attention, DeepseekV3RotaryEmbedding)
    return reference, Runtime(config, reference)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_lone_prefill_matches_transformers(
    q_lora_rank: int | None, interleave: bool, rope: str, path: MlaPath
) -> None:
    reference, runtime = deepseek(deepseek_config(q_lora_rank, interleave, rope))
    (h,) = sequences(1, 11)
    (out,) = runtime.forward([Fed(1, 0, h)], path)
    torch.testing.assert_close(out, reference(h), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("interleave", [True, False])
def test_ragged_verify_rows_equal_each_sequence_run_alone(interleave: bool, path: MlaPath) -> None:
    reference, runtime = deepseek(deepseek_config(interleave=interleave, bias=True))
    seqs = sequences(3, 20)
    prefill = [Fed(2, 0, seqs[0][:9]), Fed(0, 0, seqs[1][:4]), Fed(1, 0, seqs[2][:13])]
    runtime.forward(prefill, path)
    # slots out of order (gathered window), rows 3 / 1 / 5 at positions 9 / 4 / 13
    verify = [Fed(2, 9, seqs[0][9:12]), Fed(0, 4, seqs[1][4:5]), Fed(1, 13, seqs[2][13:18])]
    outs = runtime.forward(verify, path)
    for fed, seq, out in zip(verify, [seqs[0], seqs[1], seqs[2]], outs, strict=True):
        end = fed.start + fed.h.shape[0]
        torch.testing.assert_close(out, reference(seq[:end])[fed.start :], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("path", PATHS)
def test_rollback_then_other_rows_equal_a_fresh_run(path: MlaPath) -> None:
    reference, runtime = deepseek(deepseek_config())
    seq, other = sequences(2, 16)
    runtime.forward([Fed(0, 0, seq[:7]), Fed(1, 0, other[:3])], path)
    runtime.forward([Fed(0, 7, seq[7:12])], path)  # a verify of 5 rows
    # only 2 accepted: seq_len moves back to 9 and the next rows differ
    replaced = torch.cat((seq[:9], other[9:12]))  # [12, hidden]
    (out,) = runtime.forward([Fed(0, 9, replaced[9:12])], path)
    torch.testing.assert_close(out, reference(replaced)[9:], atol=TOL, rtol=TOL)


def test_cache_holds_the_normed_latent_and_rotated_key_only() -> None:
    config = deepseek_config()
    reference, runtime = deepseek(config)
    spec, cache = runtime.spec, runtime.cache
    assert cache.bytes_per_token == NUM_LAYERS * (spec.kv_lora_rank + spec.qk_rope_head_dim) * 4
    assert cache.entries[LAYER].shape == (
        NUM_SLOTS, MAX_LEN, spec.kv_lora_rank + spec.qk_rope_head_dim,
    )  # fmt: skip
    # small rows, so that the latent norm's eps (not the config's) shows
    h = sequences(1, 6)[0] * 1e-3  # [6, hidden]
    runtime.forward([Fed(2, 0, h)], None)
    with torch.no_grad():
        kv_a = reference.attn.kv_a_proj_with_mqa(h)  # [6, kv_lora_rank + rope]
        latent = reference.attn.kv_a_layernorm(kv_a[:, : spec.kv_lora_rank])
    torch.testing.assert_close(cache.latent(LAYER)[2, :6], latent, atol=TOL, rtol=TOL)
    assert not cache.latent(LAYER)[[0, 1]].any() and not cache.entries[0].any()


@pytest.mark.parametrize("path", PATHS)
def test_glm4_moe_lite_attention_matches_transformers(path: MlaPath) -> None:
    config = Glm4MoeLiteConfig(
        **SHAPES,
        q_lora_rank=24,
        v_head_dim=20,  # wider than qk_head_dim here (narrower in the DeepSeek tests)
        rope_parameters=dict(DEFAULT_ROPE),
    )
    config._attn_implementation = "eager"
    reference = Reference(config, Glm4MoeLiteAttention, Glm4MoeLiteRotaryEmbedding)
    runtime = Runtime(config, reference)
    first, second = sequences(2, 14)
    runtime.forward([Fed(0, 0, first[:8])], path)
    outs = runtime.forward([Fed(0, 8, first[8:11]), Fed(2, 0, second[:5])], path)
    torch.testing.assert_close(outs[0], reference(first[:11])[8:], atol=TOL, rtol=TOL)
    torch.testing.assert_close(outs[1], reference(second[:5]), atol=TOL, rtol=TOL)


def test_decode_absorbs_and_a_lone_prefill_expands() -> None:
    spec = spec_of(deepseek_config())  # a pair: 2 * 16 wide expanded, 2 * (16 + 8) absorbed
    assert not expands(spec, rows=1, ctx_len=MAX_LEN)
    assert not expands(spec, rows=4, ctx_len=MAX_LEN)
    assert expands(spec, rows=40, ctx_len=40)
    assert expands(spec, rows=2, ctx_len=2)
