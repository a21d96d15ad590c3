"""The hybrid Qwen test checkpoints look like the releases, and their references are right.

``tests.support.hybrid_checkpoints`` is what the hybrid runtime is checked
against, so these tests check it against transformers: every family loads
with no key left over, the keys sit where the releases put them, the MTP
reference attends like the model's own full-attention layers, the exact-MTP
checkpoint drafts right when wired as vLLM does and wrong under each
miswiring, and the FP8 twin is the dequantized FP8.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.support.hybrid_checkpoints import (
    FAMILIES,
    NESTED,
    exact_perm,
    public_tensors,
    write_exact_mtp_checkpoint,
    write_hybrid_checkpoint,
)
from tests.support.hybrid_references import (
    ReferenceMtp,
    fuse_experts,
    load_reference,
    load_reference_mtp,
    main_hiddens,
    mtp_chain,
    mtp_logits,
    next_token_map,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MOE_FAMILIES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
PROMPT = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))  # [1, T]
HIDDEN = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {family: write_hybrid_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, tuple[Any, ReferenceMtp]]:
    """Each family's transformers model and MTP reference, loaded once (tests
    that change one work on a copy)."""
    return {f: (load_reference(p), load_reference_mtp(p)) for f, p in folders.items()}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def config_of(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


# ---------------------------------------------------------------- layout


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_in_transformers_with_no_key_missing_or_left_over(
    folders: dict[str, Path], family: str
) -> None:
    import transformers

    arch = config_of(folders[family])["architectures"][0]
    _, info = getattr(transformers, arch).from_pretrained(
        str(folders[family]), dtype=torch.float32, output_loading_info=True
    )
    # mtp.* is dropped by the model's _keys_to_ignore_on_load_unexpected, silently
    assert {kind: keys for kind, keys in info.items() if keys} == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_finite_varied_and_depend_on_earlier_tokens(
    references: dict[str, tuple[Any, ReferenceMtp]], family: str
) -> None:
    edited = PROMPT.clone()
    edited[0, 0] = (edited[0, 0] + 1) % 256
    model, _ = references[family]
    logits = main_hiddens(model, torch.cat([PROMPT, edited]))["logits"]  # [2, T, vocab]
    assert logits.shape == (2, PROMPT.shape[1], 260)
    assert torch.isfinite(logits).all()
    assert logits[0].argmax(-1).unique().numel() > PROMPT.shape[1] // 2
    # the first token reaches the last position through the DeltaNet and attention
    assert not torch.allclose(logits[0, -1], logits[1, -1], atol=1e-4)


@pytest.mark.parametrize("family", NESTED)
def test_nested_families_hold_the_language_model_the_vision_tower_and_mtp_at_the_top(
    folders: dict[str, Path], family: str
) -> None:
    names = set(tensors(folders[family]))
    roots = {".".join(n.split(".")[: 2 if n.startswith("model.") else 1]) for n in names}
    assert roots == {"model.language_model", "model.visual", "lm_head", "mtp"}
    config = config_of(folders[family])
    text = config["text_config"]
    assert (config["model_type"], text["model_type"]) == (family, family + "_text")
    assert text["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in config
    assert text["rope_parameters"]["mrope_section"] == [1, 1, 0]
    assert text["rope_parameters"]["mrope_interleaved"] is True
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(NESTED)))
def test_text_only_families_hold_flat_keys_and_a_flat_config(
    folders: dict[str, Path], family: str
) -> None:
    names = tensors(folders[family])
    assert {n.split(".")[0] for n in names} == {"model", "lm_head", "mtp"}
    assert "model.layers.0.input_layernorm.weight" in names
    config = config_of(folders[family])
    assert config["model_type"] == family and config["mtp_num_hidden_layers"] == 1
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_layer_holds_the_released_keys_and_shapes(
    folders: dict[str, Path], family: str
) -> None:
    mtp = {n: tuple(t.shape) for n, t in tensors(folders[family]).items() if n.startswith("mtp.")}
    at = "mtp.layers.0."
    expected = {
        "mtp.fc.weight": (HIDDEN, 2 * HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": (HIDDEN,),
        "mtp.pre_fc_norm_hidden.weight": (HIDDEN,),
        "mtp.norm.weight": (HIDDEN,),
        at + "input_layernorm.weight": (HIDDEN,),
        at + "post_attention_layernorm.weight": (HIDDEN,),
        at + "self_attn.q_proj.weight": (4 * 16 * 2, HIDDEN),  # per head [query | gate]
        at + "self_attn.k_proj.weight": (2 * 16, HIDDEN),
        at + "self_attn.v_proj.weight": (2 * 16, HIDDEN),
        at + "self_attn.o_proj.weight": (HIDDEN, 4 * 16),
        at + "self_attn.q_norm.weight": (16,),
        at + "self_attn.k_norm.weight": (16,),
    }
    if family in MOE_FAMILIES:
        expected[at + "mlp.gate.weight"] = (4, HIDDEN)
        expected[at + "mlp.shared_expert_gate.weight"] = (1, HIDDEN)
        for part, shape in (("gate", (32, HIDDEN)), ("up", (32, HIDDEN)), ("down", (HIDDEN, 32))):
            expected[f"{at}mlp.shared_expert.{part}_proj.weight"] = shape
            for e in range(4):
                expected[f"{at}mlp.experts.{e}.{part}_proj.weight"] = shape
    else:
        for part, shape in (("gate", (96, HIDDEN)), ("up", (96, HIDDEN)), ("down", (HIDDEN, 96))):
            expected[f"{at}mlp.{part}_proj.weight"] = shape
    assert mtp == expected


def test_qwen3_next_holds_fused_deltanet_projections_and_one_dense_layer(
    folders: dict[str, Path],
) -> None:
    names = {n: tuple(t.shape) for n, t in tensors(folders["qwen3_next"]).items()}
    # q, k: 2 heads x 8; v, z: 4 heads x 16 -> 2*16 + 2*64; b, a: 4 heads each
    assert names["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (160, HIDDEN)
    assert names["model.layers.0.linear_attn.in_proj_ba.weight"] == (8, HIDDEN)
    assert names["model.layers.1.mlp.gate_proj.weight"] == (96, HIDDEN)
    assert names["model.layers.2.mlp.experts.3.down_proj.weight"] == (HIDDEN, 32)


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_are_zero_centred_near_zero_and_the_gated_norm_near_one(
    folders: dict[str, Path], family: str
) -> None:
    weights = tensors(folders[family])
    centred = torch.cat(
        [t for n, t in weights.items() if n.endswith("layernorm.weight") or "mtp.norm" in n]
    )
    gated = torch.cat([t for n, t in weights.items() if "linear_attn.norm." in n])
    assert centred.abs().mean() < 0.2 and centred.std() > 0.05  # not skippable, not 1-centred
    assert (gated.mean() - 1).abs() < 0.05 and gated.std() > 0.05


def test_the_delta_rule_decay_keeps_memory_over_a_few_tokens(
    references: dict[str, tuple[Any, ReferenceMtp]],
) -> None:
    model, _ = references["qwen3_5_text"]
    decays = []
    for layer in model.model.layers:
        if layer.block_type != "linear_attention":
            continue
        seen: dict[str, torch.Tensor] = {}
        hook = layer.linear_attn.in_proj_a.register_forward_hook(
            lambda _m, _i, out, seen=seen: seen.update(a=out)
        )
        main_hiddens(model, PROMPT)
        hook.remove()
        attn = layer.linear_attn
        g = -attn.A_log.exp() * F.softplus(seen["a"] + attn.dt_bias)  # [1, T, heads]
        decays.append(g.exp().flatten().detach())
    low, mid, high = torch.cat(decays).quantile(torch.tensor([0.05, 0.5, 0.95]))
    assert 0.2 < mid < 0.8 and low > 0.01 and high < 0.97


def test_a_nested_family_and_its_text_twin_hold_the_same_language_model(
    folders: dict[str, Path], references: dict[str, tuple[Any, ReferenceMtp]]
) -> None:
    nested, flat = tensors(folders["qwen3_5_moe"]), tensors(folders["qwen3_5_moe_text"])
    for name, tensor in flat.items():
        twin = name.replace("model.", "model.language_model.", 1)
        assert torch.equal(nested[twin if name.startswith("model.") else name], tensor), name
    logits = [
        main_hiddens(references[f][0], PROMPT)["logits"]
        for f in ("qwen3_5_moe", "qwen3_5_moe_text")
    ]
    torch.testing.assert_close(logits[0], logits[1])


def test_fused_experts_hold_the_same_model_and_mtp_layer(
    references: dict[str, tuple[Any, ReferenceMtp]], tmp_path: Path
) -> None:
    fused = write_hybrid_checkpoint(tmp_path / "fused", "qwen3_5_moe", expert_layout="fused")
    names = {n: tuple(t.shape) for n, t in tensors(fused).items()}
    assert names["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, HIDDEN)
    assert names["mtp.layers.0.mlp.experts.down_proj"] == (4, HIDDEN, 32)
    assert not any(".experts.0." in n for n in names)
    model, mtp = references["qwen3_5_moe"]
    ours = model.state_dict()
    for name, tensor in load_reference(fused).state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    theirs = load_reference_mtp(fused).state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in mtp.state_dict().items())


def test_stacking_and_splitting_experts_are_inverse() -> None:
    stacked = {
        "mlp.experts.gate_up_proj": torch.randn(3, 8, 5),
        "mlp.experts.down_proj": torch.randn(3, 5, 4),
        "mlp.gate.weight": torch.randn(3, 5),
    }
    split = public_tensors(stacked)
    assert torch.equal(
        split["mlp.experts.2.gate_proj.weight"], stacked["mlp.experts.gate_up_proj"][2, :4]
    )
    back = fuse_experts(split)
    assert back.keys() == stacked.keys()
    assert all(torch.equal(back[n], stacked[n]) for n in stacked)


# ----------------------------------------------------------- MTP reference


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_reference_attends_like_the_models_own_full_attention_layer(
    references: dict[str, tuple[Any, ReferenceMtp]], family: str
) -> None:
    """Layer 3 of the main model, loaded into the MTP reference, gives the same
    output from the same input: the reference's mask, rotary positions (mRoPE
    included) and layer class are the model's."""
    model, mtp = references[family]
    mtp = copy.deepcopy(mtp)
    layer = model.model.language_model.layers[3] if family in NESTED else model.model.layers[3]
    assert type(mtp.layers[0]) is type(layer)
    assert type(mtp.layers[0].mlp) is type(layer.mlp)  # MoE, or dense for qwen3_5
    seen: dict[str, torch.Tensor] = {}

    def grab(_: Any, args: tuple[torch.Tensor, ...], out: Any) -> None:
        seen["in"], seen["out"] = args[0], out[0] if isinstance(out, tuple) else out

    hook = layer.register_forward_hook(grab)
    main_hiddens(model, PROMPT)
    hook.remove()
    mtp.layers[0].load_state_dict(layer.state_dict())
    with torch.no_grad():
        got = mtp.decode(seen["in"], torch.arange(PROMPT.shape[1]))  # [1, T, hidden]
    torch.testing.assert_close(got, seen["out"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_logits_depend_on_both_the_token_and_the_hidden(
    references: dict[str, tuple[Any, ReferenceMtp]], family: str
) -> None:
    model, mtp = references[family]
    normed, raw = mtp_logits(model, mtp, PROMPT), mtp_logits(model, mtp, PROMPT, "raw")
    assert normed.shape == (PROMPT.shape[1] - 1, 260) and torch.isfinite(normed).all()
    assert not torch.allclose(normed, raw, atol=1e-3)
    edited = PROMPT.clone()
    edited[0, -1] = (edited[0, -1] + 1) % 256  # only the last row's token changes
    other = mtp_logits(model, mtp, edited)
    torch.testing.assert_close(other[:-1], normed[:-1])
    assert not torch.allclose(other[-1], normed[-1], atol=1e-3)


# -------------------------------------------------------------- exact MTP


@pytest.fixture(scope="module")
def exact_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exact")
    return {family: write_exact_mtp_checkpoint(root / family, family) for family in FAMILIES}


def load_exact(path: Path) -> tuple[Any, ReferenceMtp, torch.Tensor]:
    """(transformers model, MTP reference, next-token map) of an exact-MTP checkpoint."""
    return load_reference(path), load_reference_mtp(path), exact_perm(260)


@pytest.fixture(scope="module", params=FAMILIES)
def exact(
    request: pytest.FixtureRequest, exact_folders: dict[str, Path]
) -> tuple[Any, ReferenceMtp, torch.Tensor]:
    return load_exact(exact_folders[request.param])


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def exact_moe(
    request: pytest.FixtureRequest, exact_folders: dict[str, Path]
) -> tuple[Any, ReferenceMtp, torch.Tensor]:
    """Two families suffice against miswirings: the construction that catches
    them (fc, norms, head) is the same in all five."""
    return load_exact(exact_folders[request.param])


def own_output(perm: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """[1, length]: ``start`` then the main model's greedy continuation."""
    ids = [start]
    while len(ids) < length:
        ids.append(int(perm[ids[-1]]))
    return torch.tensor([ids])


def test_the_exact_checkpoints_main_model_follows_its_next_token_cycle(
    exact_folders: dict[str, Path],
) -> None:
    perm = exact_perm(260)
    assert next_token_map(exact_folders["qwen3_5_text"]) == {t: int(perm[t]) for t in range(260)}
    cycle, t = {7}, int(perm[7])
    while t != 7:
        cycle.add(t)
        t = int(perm[t])
    assert cycle == set(range(256))  # one cycle: EOS never comes, no short loop


def test_exact_mtp_drafts_the_next_next_token_at_every_position_of_its_own_output(
    exact: tuple[Any, ReferenceMtp, torch.Tensor],
) -> None:
    model, mtp, perm = exact
    ids = own_output(perm, start=3, length=258)  # every byte is t_{p+1} once
    main = main_hiddens(model, ids)["logits"][0].argmax(-1)  # [T]
    assert torch.equal(main[:-1], ids[0, 1:])
    assert torch.equal(mtp_logits(model, mtp, ids).argmax(-1), main[1:])


def test_exact_mtp_chain_after_any_prompt_is_the_greedy_continuation(
    exact: tuple[Any, ReferenceMtp, torch.Tensor],
) -> None:
    model, mtp, perm = exact
    after = own_output(perm, int(PROMPT[0, -1]), 9)[0, 2:].tolist()  # t_{T+1} .. t_{T+7}
    assert mtp_chain(model, mtp, PROMPT, depth=7) == after


def swapped_fc(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    mtp = copy.deepcopy(mtp)
    with torch.no_grad():
        mtp.fc.weight.copy_(mtp.fc.weight.roll(HIDDEN, dims=1))  # hidden half first
    return mtp_logits(model, mtp, ids).argmax(-1)


def no_hidden(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    mtp = copy.deepcopy(mtp)
    with torch.no_grad():
        mtp.fc.weight[:, HIDDEN:] = 0.0  # the hidden half read as zeros
    return mtp_logits(model, mtp, ids).argmax(-1)


def pre_norm_hidden(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    return mtp_logits(model, mtp, ids, "raw").argmax(-1)


def next_position_hidden(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    hiddens = main_hiddens(model, ids)["normed"][:, 1:]  # row p gets hidden p + 1
    embeds = model.get_input_embeddings()(ids[:, 1:])
    with torch.no_grad():
        _, normed = mtp(embeds, hiddens, torch.arange(ids.shape[1] - 1))
        return model.lm_head(normed)[0].argmax(-1)


def plain_norm_scales(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    mtp = copy.deepcopy(mtp)
    with torch.no_grad():  # (1 + w') = w: the stored weight read as the scale
        for norm in (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.norm):
            norm.weight.sub_(1.0)
    return mtp_logits(model, mtp, ids).argmax(-1)


def embedding_as_head(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    return mtp_logits(model, mtp, ids).argmax(-1)


def pre_norm_chain(model: Any, mtp: ReferenceMtp, ids: torch.Tensor) -> torch.Tensor:
    """A chain after ``ids[0]`` fed the MTP output before ``mtp.norm``: its
    draft ``k`` guesses ``ids[k + 1]``."""
    return torch.tensor(mtp_chain(model, mtp, ids[:, :1], ids.shape[1] - 2, chain_hidden="raw"))


# name -> (the drafts a miswired MTP layer makes along the model's own output
# ids [1, T], guessing ids[2:]; the first draft the miswiring can touch)
MISWIRINGS: dict[str, tuple[Callable[[Any, ReferenceMtp, torch.Tensor], torch.Tensor], int]] = {
    "swapped_fc_halves": (swapped_fc, 0),
    "no_hidden": (no_hidden, 0),
    "pre_norm_main_hidden": (pre_norm_hidden, 0),
    "hidden_of_the_next_position": (next_position_hidden, 0),
    "norm_weights_read_as_scales": (plain_norm_scales, 0),
    "embedding_as_head": (embedding_as_head, 0),
    # the first draft reads the main model's hidden, not the MTP layer's
    "pre_norm_mtp_hidden_in_the_chain": (pre_norm_chain, 1),
}


@pytest.mark.parametrize("wiring", sorted(MISWIRINGS))
def test_exact_mtp_drafts_are_rejected_when_the_layer_is_miswired(
    exact_moe: tuple[Any, ReferenceMtp, torch.Tensor], wiring: str
) -> None:
    model, mtp, perm = exact_moe
    drafts, first = MISWIRINGS[wiring]
    ids = own_output(perm, start=11, length=24)
    expected = ids[0, 2:]  # [T - 2]
    accepted = (drafts(model, mtp, ids)[: expected.numel()] == expected).float()[first:]
    assert accepted.mean() < 0.15, accepted
